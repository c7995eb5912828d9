"""The page's web application (Starlette) and its server (uvicorn): the optional `serve` extra.

Routes: `/` the page, `/static/...` its script and style and plotly.js (from the installed plotly package: the
page loads nothing from elsewhere, and its Content-Security-Policy says so), `/api/options` the form's fields,
`/api/plan` (POST {field: value} as application/json) one plan, or 400 {"error": the CLI's one-line message,
"field": which input}; `/api/rl` (POST {"args": [memfit rl's arguments]}) an RL step's phase bars (memfit.serve.rl). What a request must be (Host, origin, content type, size) is checked before it is read:
RequestGuard and `_plan`; a refusal is a 4xx with one line, never a 5xx.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from importlib import resources

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import core
from . import rl as rl_page
from ..errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
MAX_BODY_BYTES = 64 * 1024
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_WORKERS = 4
log = logging.getLogger("memfit.serve")

# plotly draws with inline styles; everything else, scripts included, comes from this server only.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "font-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8",
           "plotly.min.js": "text/javascript; charset=utf-8"}


@lru_cache(maxsize=None)
def _asset(name: str) -> bytes:
    if name == "plotly.min.js":
        from plotly.offline import get_plotlyjs

        return get_plotlyjs().encode("utf-8")
    return resources.files("memfit.serve").joinpath("static", name).read_bytes()


def _headers(cache: bool = False) -> dict[str, str]:
    return {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "Cache-Control": "max-age=3600" if cache else "no-cache"}


async def _index(request: Request) -> Response:
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=_headers())


async def _static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _STATIC:
        return Response("not found", status_code=404, media_type="text/plain")
    return Response(_asset(name), media_type=_STATIC[name], headers=_headers(cache=name == "plotly.min.js"))


def _all_options() -> dict:
    """The plan form's fields and the RL section's (memfit.serve.rl.form_fields)."""
    return {**core.options(), "rl": rl_page.form_fields()}


async def _options(request: Request) -> Response:
    return JSONResponse(await run_in_threadpool(_all_options), headers=_headers())


def _error(message: str, field: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message, "field": field}, status_code=status, headers=_headers())


class _TooLarge(Exception):
    pass


async def _body(request: Request) -> bytes:
    """The request's body, refused (_TooLarge) past MAX_BODY_BYTES: by its Content-Length before a byte is read,
    and while it streams in (a body sent in chunks, or longer than it said), so a large post never sits in memory."""
    declared = request.headers.get("content-length")
    if declared is not None:
        text = declared.strip()
        if not (text.isascii() and text.isdigit()):
            raise ValueError("the request's Content-Length is not a number of bytes")
        if int(text) > MAX_BODY_BYTES:
            raise _TooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(body: bytes):
    """The form's values from a JSON body, or None when it is not a JSON object (or not JSON at all)."""
    try:
        values = json.loads(body or b"{}")
    except (ValueError, RecursionError):  # not JSON, not UTF-8, digits past int's limit, nested past the stack
        return None
    return values if isinstance(values, dict) else None


_NOT_AN_OBJECT = "send a JSON object of the form's values, e.g. {\"model\": \"llama-3.1-8b\", \"batch\": \"4\"}"


async def _read_json(request: Request, what: str) -> tuple[object, Response | None]:
    """The request's JSON body (parsed, not yet checked to be an object), or the error Response to send: not JSON
    (415, `what` says what to send), over MAX_BODY_BYTES (413, the connection closed so the rest is never read),
    cut short, or not text."""
    if _media_type(request.headers.get("content-type", "")) != "application/json":
        return None, _error(f"send {what} as JSON (Content-Type: application/json)", status=415)
    try:
        return await _body(request), None
    except _TooLarge:
        response = _error(f"the request is over {MAX_BODY_BYTES // 1024} KiB", status=413)
        response.headers["Connection"] = "close"
        return None, response
    except ClientDisconnect:
        return None, _error("the request ended before its body did")
    except ValueError as error:
        return None, _error(str(error))


async def _plan(request: Request) -> Response:
    body, refused = await _read_json(request, "the form's values")
    if refused is not None:
        return refused
    values = _json_object(body)
    if values is None:
        return _error(_NOT_AN_OBJECT)
    try:
        answer = await run_in_threadpool(request.app.state.answers.get, values)
    except core.InputError as error:
        return _error(error.message, error.field)
    except Exception as error:  # a bug, not the caller's mistake: one line in the log and in the answer
        line = f"{type(error).__name__}: {core._one_line(error)[:300]}"
        log.error("memfit serve: /api/plan failed on %s: %s", core._one_line(json.dumps(values))[:300], line)
        return _error(f"memfit failed on these values ({line}); please report it", status=500)
    return Response(answer, media_type="application/json", headers=_headers())


async def _rl(request: Request) -> Response:
    """The RL phase bars (memfit.serve.rl): {"args": [memfit rl's arguments]} -> its estimate, figure and line."""
    body, refused = await _read_json(request, "{\"args\": [...]}")
    if refused is not None:
        return refused
    values = _json_object(body)
    args = values.get("args") if values is not None else None
    if not isinstance(args, list):
        return _error("send a JSON object {\"args\": [...]}: memfit rl's arguments, e.g. [\"qwen2.5-7b\", "
                      "\"--trainer\", \"grpo\", \"--vllm\"]")
    try:
        answer = await run_in_threadpool(rl_page.rl_for, args)
    except core.InputError as error:
        return _error(error.message, error.field)
    except Exception as error:  # a bug, not the caller's mistake
        line = f"{type(error).__name__}: {core._one_line(error)[:300]}"
        log.error("memfit serve: /api/rl failed on %s: %s", core._one_line(json.dumps(args))[:300], line)
        return _error(f"memfit failed on these arguments ({line}); please report it", status=500)
    return JSONResponse(answer, headers=_headers())


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _encode(answer: dict) -> bytes:
    return json.dumps(answer, separators=(",", ":")).encode("utf-8")


class RequestGuard:
    """What a request must be before the page answers it (an ASGI middleware):

    - its Host header names this server (`allowed_hosts`; the CLI passes the loopback names when it listens on
      loopback, so a page elsewhere cannot reach it by DNS rebinding), parsed here for IPv6 too ('[::1]:8765');
    - an /api/ request does not come from another site: a browser's `Sec-Fetch-Site` is same-origin (or none:
      typed by the user), and an `Origin` header, when sent, is this server's own. Together with /api/plan taking
      application/json only (which a cross-site form or text/plain post cannot send without a CORS preflight this
      server never grants), no other page can make it compute."""

    def __init__(self, app, allowed_hosts: Sequence[str] | None = None):
        self.app = app
        self.allowed = None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message = refusal
            await _error(message, status=status)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope, headers: Headers) -> tuple[int, str] | None:
        host_header = headers.get("host", "")
        if self.allowed is not None and host_name(host_header) not in self.allowed:
            return 400, "invalid Host header: this server answers " + ", ".join(sorted(self.allowed)) + " only"
        if not scope.get("path", "").startswith("/api/"):
            return None
        site = headers.get("sec-fetch-site")
        if site is not None and site.lower() not in ("same-origin", "none"):
            return 403, f"refused: a request from another site ({site})"
        origin = headers.get("origin")
        if origin is not None and origin.lower() != f"{scope.get('scheme', 'http')}://{host_header}".lower():
            return 403, f"refused: a request from another origin ({core._one_line(origin)[:100]})"
        return None


def host_name(host_header: str) -> str | None:
    """'::1' from '[::1]:8765', 'localhost' from 'LOCALHOST:80'; None when the header is malformed."""
    text = host_header.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return text[1:end]
    name, _, port = text.partition(":")
    if not name or (port and not port.isdigit()) or ":" in port:
        return None
    return name


def _encoded_plan(argv: list[str]) -> bytes:
    return _encode(core.plan_for(argv))


def _worker_start() -> None:
    # Ctrl-C in a terminal signals the whole process group; the server shuts its workers down itself, so a worker
    # prints no KeyboardInterrupt traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Workers:
    """Plans computed in `count` worker processes, so that as many cores answer at once (threads share one
    interpreter lock, and a plan is pure Python). Spawned, not forked: the server runs threads. A worker holds
    ~50 MB; an answer comes back as its JSON bytes."""

    def __init__(self, count: int):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_worker_start)
        for _ in range(count):  # start them all now (each imports memfit, ~1 s), not on the first busy moment
            self._pool.submit(core.form_fields)

    def __call__(self, argv: list[str]) -> bytes:
        return self._pool.submit(_encoded_plan, argv).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def create_app(*, allowed_hosts: Sequence[str] | None = None, workers: Workers | None = None) -> Starlette:
    """The application. `allowed_hosts`: the Host names it answers (RequestGuard); None answers any. `workers`:
    where plans are computed (default: in this process, on the server's threads)."""
    middleware = [Middleware(RequestGuard, allowed_hosts=allowed_hosts)]
    routes = [Route("/", _index), Route("/static/{name}", _static), Route("/api/options", _options),
              Route("/api/plan", _plan, methods=["POST"]), Route("/api/rl", _rl, methods=["POST"])]
    app = Starlette(routes=routes, middleware=middleware)
    app.state.answers = core.Answers(workers or _encoded_plan)
    return app


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); a ConfigError naming the address if it is taken."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ConfigError(f"cannot listen on {host}: {error.strerror or error}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as error:
        sock.close()
        reason = error.strerror or error
        raise ConfigError(f"cannot listen on {host}:{port}: {reason} (choose another --port)") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def make_server(sock: socket.socket, workers: Workers | None = None):
    import uvicorn

    host = sock.getsockname()[0]
    allowed = [*LOOPBACK_NAMES, host] if is_loopback(host) else None
    app = create_app(allowed_hosts=allowed, workers=workers)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", server_header=False)
    return uvicorn.Server(config)


def _warm(app: Starlette) -> None:
    """Compute the page's first plan (every visitor's first update) while the server starts."""
    try:
        app.state.answers.get(core.options()["initial"])
    except Exception:  # the page will show the same failure as one line when asked
        pass


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, on_ready=None, workers: int = 0) -> None:
    """Serve the page until interrupted (Ctrl-C). `on_ready(url)` is called once the socket listens. `workers`:
    processes computing plans (0: the server's own threads; `memfit serve` uses one per core, up to
    MAX_WORKERS). With workers, call this under `if __name__ == "__main__":` in a script (they are spawned)."""
    sock = bind(host, port)
    pool = Workers(workers) if workers > 0 else None
    try:
        server = make_server(sock, pool)
        threading.Thread(target=_warm, args=(server.config.app,), name="memfit-warm", daemon=True).start()
        if on_ready is not None:
            on_ready(url_of(sock))
        server.run(sockets=[sock])
    finally:
        sock.close()
        if pool is not None:
            pool.close()


@contextlib.contextmanager
def running(host: str = DEFAULT_HOST, port: int = 0, *, timeout_s: float = 15.0) -> Iterator[str]:
    """Serve the page from a background thread while the block runs; yields its URL (for tests and notebooks)."""
    sock = bind(host, port)
    server = make_server(sock)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="memfit-serve", daemon=True)
    thread.start()
    try:
        for _ in range(int(timeout_s / 0.02)):
            if server.started or not thread.is_alive():
                break
            time.sleep(0.02)
        if not server.started:
            raise RuntimeError("the memfit page server did not start")
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
        sock.close()

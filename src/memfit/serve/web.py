"""The page's web application (Starlette) and its server (uvicorn): the optional `serve` extra.

Routes: `/` the page, `/static/...` its script and style and plotly.js (from the installed plotly package: the
page loads nothing from elsewhere, and its Content-Security-Policy says so), `/api/options` the form's fields,
`/api/plan` (POST {field: value}) one plan, or 400 {"error": the CLI's one-line message, "field": which input}.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from importlib import resources

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import core
from ..errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
MAX_BODY_BYTES = 64 * 1024
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")

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


async def _options(request: Request) -> Response:
    return JSONResponse(await run_in_threadpool(core.options), headers=_headers())


def _error(message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field}, status_code=400, headers=_headers())


async def _plan(request: Request) -> Response:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return _error(f"the request is over {MAX_BODY_BYTES // 1024} KiB")
    try:
        import json

        values = json.loads(body or b"{}")
    except ValueError:
        values = None
    if not isinstance(values, dict):
        return _error("send a JSON object of the form's values, e.g. {\"model\": \"llama-3.1-8b\", \"batch\": \"4\"}")
    try:
        answer = await run_in_threadpool(core.plan_page, values)
    except core.InputError as error:
        return _error(error.message, error.field)
    return JSONResponse(answer, headers=_headers())


def create_app(*, allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The application. `allowed_hosts`: the Host headers it answers (the CLI passes the loopback names when it
    listens on loopback, so a page elsewhere cannot reach it by DNS rebinding); None answers any."""
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))] if allowed_hosts else []
    routes = [Route("/", _index), Route("/static/{name}", _static), Route("/api/options", _options),
              Route("/api/plan", _plan, methods=["POST"])]
    return Starlette(routes=routes, middleware=middleware)


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


def make_server(sock: socket.socket):
    import uvicorn

    host = sock.getsockname()[0]
    # Starlette's host check reads an IPv6 Host header ('[::1]:8765') as '[': it guards IPv4 loopback only
    allowed = [*LOOPBACK_NAMES, host] if is_loopback(host) and ":" not in host else None
    config = uvicorn.Config(create_app(allowed_hosts=allowed), log_level="warning", access_log=False,
                            lifespan="off", server_header=False)
    return uvicorn.Server(config)


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, on_ready=None) -> None:
    """Serve the page until interrupted (Ctrl-C). `on_ready(url)` is called once the socket listens."""
    sock = bind(host, port)
    server = make_server(sock)
    if on_ready is not None:
        on_ready(url_of(sock))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


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

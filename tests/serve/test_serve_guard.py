"""memfit serve under hostile or careless requests (issue 22): a body over the cap is refused before it is read, a
request from another site or in another content type is refused, the Host check holds on every loopback address,
and malformed input is a 4xx with one line and nothing in the server's log; an update is the library's own plan,
computed once per command line."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading

import pytest

pytest.importorskip("starlette", reason="memfit serve needs the serve extra: pip install -e '.[test]'")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from memfit.api import typical_setup  # noqa: E402
from memfit.diagnose import DEFAULT_MARGIN  # noqa: E402
from memfit.finetune import Finetune, Method  # noqa: E402
from memfit.hardware import make_hardware  # noqa: E402
from memfit.plan import plan  # noqa: E402
from memfit.plan_output import plan_json  # noqa: E402
from memfit.serve import core, web  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client():
    with TestClient(web.create_app()) as test_client:
        yield test_client


# ---- one update ------------------------------------------------------------------------------------------------

def test_an_update_is_the_librarys_plan_and_its_chart(client):
    """The page's answer for a QLoRA setup is memfit.plan's Plan for the same setup, built here from the library,
    and its chart is the report's plotly figure (plotly's own JSON) of that plan."""
    from memfit.report.figures import breakdown_figure, report_data

    values = {"model": "llama-3.1-8b", "gpu": "RTX-4090", "method": "qlora", "batch": "2", "seq": "1024"}
    answer = client.post("/api/plan", json=values).json()
    spec, hardware = resolve_model("llama-3.1-8b"), make_hardware("RTX-4090")
    setup = typical_setup(spec, hardware, micro_batch_size=2, seq_len=1024, finetune=Finetune(method=Method.QLORA))
    expected = plan(spec, setup, hardware, margin=DEFAULT_MARGIN,
                    explicit=frozenset({"micro_batch_size", "seq_len", "finetune"}), keep=None)
    assert answer["plan"] == plan_json(expected)
    setup_json = answer["plan"]["initial_setup"]
    assert setup_json["finetune"]["method"] == "qlora" and setup_json["seq_len"] == 1024
    assert answer["figure"] == json.loads(breakdown_figure(report_data(expected)).to_json())
    totals = [expected.initial_estimate.total_bytes] + [s.estimate.total_bytes for s in expected.steps]
    assert [float(r["gib"]) for r in answer["view"]["rungs"]] == pytest.approx([t / 2**30 for t in totals], abs=0.006)
    assert answer["view"]["fits"] is expected.fits
    assert answer["command"] == "memfit plan llama-3.1-8b --gpu RTX-4090 --method qlora --batch 2 --seq 1024"
    again = client.post("/api/plan", json=dict(reversed(list(values.items()))))
    assert again.json() == answer  # the same command line: the answer computed once


def test_one_command_line_is_computed_once_however_many_ask_at_once():
    calls, release = [], threading.Event()

    def compute(argv):
        calls.append(argv)
        release.wait(10)
        return {"argv": argv}

    answers = core.Answers(compute, size=2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(answers.get({"model": "gpt2", "batch": "2"})))
               for _ in range(8)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert calls == [["gpt2", "--batch", "2"]] and results == [{"argv": ["gpt2", "--batch", "2"]}] * 8
    for batch in ("3", "4", "2"):  # an LRU of 2: the first is gone by the third
        answers.get({"model": "gpt2", "batch": batch})
    assert len(calls) == 4


# ---- the body cap ------------------------------------------------------------------------------------------------

def _drive(app, headers: dict[str, str], chunks, *, method: str = "POST", path: str = "/api/plan"):
    """Run one request through the ASGI app with a body sent in `chunks`; (status, body, bytes the app pulled)."""
    pulled, sent = [0], []
    chunks = iter(chunks)

    async def receive():
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8765)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    _drive.headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], json.loads(body), pulled[0]


def _endless(chunk_bytes: int = 64 * 1024, total: int = 50 * 2**20):
    for _ in range(total // chunk_bytes):
        yield b" " * chunk_bytes


def test_a_body_declared_over_the_cap_is_refused_unread():
    status, answer, pulled = _drive(web.create_app(), {"host": "127.0.0.1:8765", "content-type": "application/json",
                                                       "content-length": str(50 * 2**20)}, _endless())
    assert (status, pulled) == (413, 0) and "64 KiB" in answer["error"]
    assert _drive.headers["connection"] == "close"  # the server hangs up: the rest is never read


def test_a_body_streamed_past_the_cap_is_refused_at_the_cap():
    """No Content-Length (chunked), or one that lies: reading stops at the first chunk past 64 KiB."""
    for headers in ({}, {"content-length": "100"}):
        status, answer, pulled = _drive(web.create_app(), {"host": "127.0.0.1:8765",
                                                           "content-type": "application/json", **headers},
                                        _endless(chunk_bytes=16 * 1024))
        assert status == 413 and pulled <= web.MAX_BODY_BYTES + 16 * 1024, headers


@pytest.mark.parametrize("length", ["-1", "1e9", "abc", "99999999999999999999999"])
def test_a_malformed_content_length_is_a_4xx(length):
    status, answer, _ = _drive(web.create_app(), {"host": "127.0.0.1:8765", "content-type": "application/json",
                                                  "content-length": length}, [b"{}"])
    assert 400 <= status < 500 and "\n" not in answer["error"]


# ---- other sites, other content types ----------------------------------------------------------------------------

BODY = json.dumps({"model": "gpt2"})


@pytest.mark.parametrize("headers,status", [
    ({"Content-Type": "text/plain"}, 415),  # what a cross-site <form> or fetch can send without a preflight
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({}, 415),
    ({**JSON, "Origin": "http://attacker.example"}, 403),
    ({**JSON, "Origin": "null"}, 403),
    ({**JSON, "Origin": "http://testserver:8080"}, 403),
    ({**JSON, "Sec-Fetch-Site": "cross-site"}, 403),
    ({**JSON, "Sec-Fetch-Site": "same-site"}, 403),
    ({**JSON, "Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}, 200),  # the page itself
    ({"Content-Type": "application/json; charset=utf-8"}, 200),
])
def test_only_the_page_itself_may_post(client, headers, status):
    reply = client.post("/api/plan", content=BODY, headers=headers)
    assert reply.status_code == status, reply.text
    if status != 200:
        assert reply.json()["error"] and "\n" not in reply.json()["error"]


def test_another_site_cannot_read_the_options_but_can_link_to_the_page(client):
    assert client.get("/api/options", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.get("/", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200


@pytest.mark.parametrize("header,name", [("[::1]:8765", "::1"), ("[::1]", "::1"), ("LOCALHOST:80", "localhost"),
                                         ("127.0.0.1", "127.0.0.1"), ("[::1", None), ("a:b:c", None),
                                         ("[::1]x", None), ("", None), ("evil.example:1:2", None)])
def test_host_headers_are_parsed_for_ipv6_too(header, name):
    assert web.host_name(header) == name


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not _ipv6_loopback(), reason="no IPv6 loopback here"))])
def test_the_host_check_holds_on_every_loopback_address(host):
    """A DNS-rebinding page reaches the server under its own name: on 127.0.0.1 and on ::1 alike it is refused."""
    with web.running(host) as url:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        shown = f"[{host}]" if ":" in host else host
        for header, status in [(f"{shown}:{port}", 200), (f"localhost:{port}", 200),
                               (f"attacker.example:{port}", 400), ("attacker.example", 400)]:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/api/options", headers={"Host": header})
            reply = conn.getresponse()
            assert reply.status == status, header
            reply.read()
            conn.close()


# ---- malformed input ---------------------------------------------------------------------------------------------

MALFORMED = [
    b"{", b"not json", b"\xff\xfe{}", b"[]", b"null", b"42", b'"gpt2"',
    b"[" * 30000 + b"]" * 30000,  # nested past the parser's stack
    b'{"model": ' + b"[" * 20000 + b"]" * 20000 + b"}",
    json.dumps({"model": {"name": "gpt2"}}).encode(),
    json.dumps({"model": ["gpt2"]}).encode(),
    json.dumps({"model": 7}).encode(),
    json.dumps({"model": None}).encode(),
    json.dumps({"model": "gpt2", "batch": [1, 2]}).encode(),
    json.dumps({"model": "gpt2", "batch": True}).encode(),
    json.dumps({"model": "gpt2", "batch": -1}).encode(),
    json.dumps({"model": "gpt2", "batch": 10**100}).encode(),
    b'{"model": "gpt2", "batch": ' + b"9" * 5000 + b"}",  # past int's digit limit
    b'{"model": "gpt2", "batch": 1e400}',
    b'{"model": "gpt2", "margin": NaN}',
    json.dumps({"model": "gpt2", "margin": "nan"}).encode(),
    json.dumps({"model": "gpt2", "gpu": "1e400GiB"}).encode(),
    json.dumps({"model": "gpt2", "gpus": "1" * 150}).encode(),
    json.dumps({"model": "gpt2", "seq": "\x00"}).encode(),
    json.dumps({"model": "gpt2", "x" * 5000: "1"}).encode(),
    json.dumps({f"k{i}": i for i in range(3000)}).encode(),
    json.dumps({"model": "../../etc/passwd"}).encode(),
    json.dumps({"model": "gpt2", "method": "full", "lora_rank": "8"}).encode(),  # LoRA details on a full fine-tune
]


@pytest.mark.parametrize("body", MALFORMED, ids=lambda b: b[:30].decode("utf-8", "replace"))
def test_malformed_input_is_a_4xx_with_one_line_and_a_quiet_log(client, body, caplog):
    with caplog.at_level(logging.WARNING):
        reply = client.post("/api/plan", content=body, headers=JSON)
    assert 400 <= reply.status_code < 500, reply.text[:300]
    error = reply.json()["error"]
    assert error and "\n" not in error and len(error) < 2000
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_failure_inside_memfit_is_one_line_in_the_log_and_the_answer(caplog):
    """A bug (not the caller's mistake) is a 500 whose body and log entry are one line each, never a traceback."""
    def broken(argv):
        raise KeyError("boom")

    app = web.create_app()
    app.state.answers = core.Answers(broken)
    with TestClient(app) as broken_client, caplog.at_level(logging.WARNING):
        reply = broken_client.post("/api/plan", json={"model": "gpt2"})
    assert reply.status_code == 500 and "KeyError" in reply.json()["error"]
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1 and records[0].exc_info is None and "\n" not in records[0].getMessage()


@pytest.mark.processes
def test_the_page_computes_with_the_library_not_a_cli_command():
    """An update imports no CLI command (memfit.cli.app and the modules it registers): only the options'
    declarations (memfit.cli.options) and the one-line error type (memfit.cli.common)."""
    import subprocess
    import sys

    code = ("import sys; from memfit.serve import core; core.plan_page({'model': 'gpt2', 'method': 'lora'}); "
            "print(sorted(m for m in sys.modules if m.startswith('memfit.cli')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # memfit.cli.progress / .interrupt: the progress reporter and the Ctrl-C handler cli.common installs (no command)
    assert set(eval(result.stdout.strip())) <= {"memfit.cli", "memfit.cli.common", "memfit.cli.options",
                                                 "memfit.cli.progress", "memfit.cli.interrupt"}

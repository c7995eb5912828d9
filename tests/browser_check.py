"""Drive a headless Chromium over the DevTools protocol: open a file offline, wait for plotly to draw, and report
what a person would see (element counts, screenshots) and what went wrong (console errors, exceptions, requests
that left the file, dialogs). `Chromium.tab()` keeps a served page open for a test to drive (test_serve.py).
Used by test_report.py and test_serve.py; Chromium comes from scripts/install_test_browser.sh."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

INSTALL_HINT = "install it with `sudo bash scripts/install_test_browser.sh` (Debian's chromium package)"
_NO_HOSTS = "--host-resolver-rules=MAP * ~NOTFOUND"
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--disable-extensions", "--mute-audio", "--hide-scrollbars",
          # Nothing may leave the machine: any host name fails to resolve, so a CDN script could not load.
          _NO_HOSTS)

# Waits until every plotly graph on the page has drawn, then counts what it drew.
_RENDERED_JS = """
(async () => {
  const plots = () => [...document.querySelectorAll('.js-plotly-plot')];
  const ready = () => plots().every(d => d._fullLayout && d.querySelector('.main-svg'));
  const deadline = Date.now() + %(timeout_ms)d;
  while (!ready()) {
    if (Date.now() > deadline) throw new Error('plotly graphs did not render in time');
    await new Promise(r => setTimeout(r, 50));
  }
  // plotly may redraw once more (automargin, legend): measure until two frames 100 ms apart agree
  const measure = () => {
    const out = {};
    for (const d of plots()) {
      const bars = [...d.querySelectorAll('g.trace.bars g.point path')];
      const drawn = bars.filter(p => { const b = p.getBBox(); return b.width > 0 && b.height > 0; });
      const r = d.getBoundingClientRect();
      out[d.id] = {
        bars: bars.length, bars_drawn: drawn.length,
        bar_extent: Math.round(drawn.reduce((sum, p) => sum + p.getBBox().height + p.getBBox().width, 0)),
        bar_traces: d.querySelectorAll('g.trace.bars').length,
        scatter_traces: d.querySelectorAll('g.scatterlayer g.trace').length,
        fills: d.querySelectorAll('g.scatterlayer path.js-fill').length,
        shapes: d.querySelectorAll('g.shapelayer path').length,
        legend_items: d.querySelectorAll('g.legend g.traces').length,
        text: d.textContent,
        rect: {x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height},
      };
    }
    return out;
  };
  const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  let out = measure(), previous = null;
  while (JSON.stringify(out) !== previous) {
    if (Date.now() > deadline) throw new Error('plotly graphs kept changing');
    previous = JSON.stringify(out);
    await frame();
    await new Promise(r => setTimeout(r, 100));
    out = measure();
  }
  return out;
})()
"""


def find_chromium() -> str | None:
    """MEMFIT_CHROMIUM, else Debian's /usr/bin/chromium, else a `chromium` on PATH."""
    for candidate in (os.environ.get("MEMFIT_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class PageReport:
    url: str
    plots: dict[str, dict]
    """Per plotly div id: counts of drawn elements, its text and its rectangle on the page."""
    text: str
    """The page's visible text (document.body.innerText)."""
    screenshots: dict[str, bytes]
    """PNG of each plotly div, by id."""
    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    img_count: int = 0

    @property
    def problems(self) -> list[str]:
        return ([f"console: {m}" for m in self.console_errors] + [f"exception: {m}" for m in self.exceptions]
                + [f"request left the file: {u}" for u in self.external_requests]
                + [f"request failed: {u}" for u in self.failed_requests]
                + [f"dialog opened: {m}" for m in self.dialogs])


class Chromium:
    """One headless browser process; `open()` loads a page in a fresh tab and returns a PageReport."""

    def __init__(self, executable: str, *, timeout_s: float = 30.0, local_hosts: tuple[str, ...] = ()):
        """`local_hosts`: addresses the browser may still reach (a test's own server on 127.0.0.1); every other
        host name fails to resolve."""
        import websocket  # websocket-client, in the `test` extra

        self.timeout_s = timeout_s
        flags = [_NO_HOSTS + "".join(f", EXCLUDE {host}" for host in local_hosts) if f == _NO_HOSTS else f
                 for f in _FLAGS]
        self._profile = tempfile.TemporaryDirectory(prefix="memfit-chromium-", ignore_cleanup_errors=True)
        self._proc = subprocess.Popen(
            [executable, *flags, f"--user-data-dir={self._profile.name}", "--remote-debugging-port=0",
             "--window-size=1280,900", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            url = self._devtools_url()
            self._ws = websocket.create_connection(url, timeout=timeout_s, suppress_origin=True,
                                                   enable_multithread=False)
        except Exception:
            self.close()
            raise
        self._next_id = 0
        self._events: list[dict] = []

    def _devtools_url(self) -> str:
        lines: queue.Queue = queue.Queue()
        seen: list[str] = []

        def pump():
            for line in self._proc.stderr:
                lines.put(line)

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self._proc.poll() is not None:
                    break
                continue
            seen.append(line)
            match = re.search(r"DevTools listening on (ws://\S+)", line)
            if match:
                return match.group(1)
        raise RuntimeError("chromium did not start its DevTools endpoint; its stderr:\n" + "".join(seen[-20:]))

    # ---- protocol ------------------------------------------------------------------------------------------------

    def _call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._ws.send(json.dumps(message))
        while True:
            reply = json.loads(self._ws.recv())
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._on_event(reply)

    def _on_event(self, event: dict) -> None:
        self._events.append(event)
        if event["method"] == "Page.javascriptDialogOpening":  # never leave a page blocked on alert()
            self._ws.send(json.dumps({"id": 0, "method": "Page.handleJavaScriptDialog",
                                      "params": {"accept": False}, "sessionId": event.get("sessionId")}))

    def _wait_event(self, method: str, session: str, since: int) -> dict:
        """The first `method` event of `session` at or after self._events[since], waiting for it if need be."""
        deadline = time.monotonic() + self.timeout_s
        seen = since
        while time.monotonic() < deadline:
            for event in self._events[seen:]:
                if event["method"] == method and event.get("sessionId") == session:
                    return event
            seen = len(self._events)
            reply = json.loads(self._ws.recv())
            if "method" in reply:
                self._on_event(reply)
        raise TimeoutError(f"no {method} within {self.timeout_s} s")

    def _new_target(self) -> tuple[str, str]:
        """A blank tab and the session attached to it."""
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        return target, self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _navigate(self, session: str, url: str, width: int, height: int) -> int:
        """Enable the domains the checks read, size the viewport, load `url`; the index of its first event."""
        for domain in ("Page", "Runtime", "Log", "Network"):
            self._call(f"{domain}.enable", session=session)
        self._call("Emulation.setDeviceMetricsOverride",
                   {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        start = len(self._events)
        self._call("Page.navigate", {"url": url}, session)
        self._wait_event("Page.loadEventFired", session, start)
        return start

    # ---- a page --------------------------------------------------------------------------------------------------

    def open(self, path: str | Path, *, width: int = 1280, height: int = 900) -> PageReport:
        url = Path(path).resolve().as_uri()
        target, session = self._new_target()
        try:
            start = self._navigate(session, url, width, height)
            plots = self._evaluate(_RENDERED_JS % {"timeout_ms": int(self.timeout_s * 1000)}, session)
            text = self._evaluate("document.body.innerText", session)
            img_count = self._evaluate("document.querySelectorAll('img').length", session)
            shots = {div_id: self._screenshot(info["rect"], session) for div_id, info in plots.items()}
            report = PageReport(url, plots, text, shots, img_count=img_count)
            self._collect(report, [e for e in self._events[start:] if e.get("sessionId") == session], url)
            return report
        finally:
            self._call("Target.closeTarget", {"targetId": target})

    def _evaluate(self, expression: str, session: str):
        result = self._call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                 "returnByValue": True}, session)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def _screenshot(self, rect: dict, session: str) -> bytes:
        clip = {"x": rect["x"], "y": rect["y"], "width": rect["width"], "height": rect["height"], "scale": 1}
        data = self._call("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True},
                          session)["data"]
        return base64.b64decode(data)

    @staticmethod
    def _collect(report: PageReport, events: list[dict], url: str, *, origin: str | None = None) -> None:
        """Sort the page's events into the report. A request is external when it is not for `url` itself, or,
        given `origin` (scheme://host:port of a served page), when it goes anywhere else than that origin."""
        for event in events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
                report.console_errors.append(" ".join(str(a.get("value", a.get("description", "")))
                                                      for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                report.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
                report.console_errors.append(params["entry"].get("text", ""))
            elif method == "Network.requestWillBeSent":
                request_url = params.get("request", {}).get("url", "")
                local = (origin_of(request_url) == origin) if origin is not None else request_url == url
                if not local and not request_url.startswith(("data:", "blob:", "about:")):
                    report.external_requests.append(request_url)
            elif method == "Network.loadingFailed":
                report.failed_requests.append(params.get("errorText", ""))
            elif method == "Page.javascriptDialogOpening":
                report.dialogs.append(params.get("message", ""))

    @contextlib.contextmanager
    def tab(self, url: str, *, width: int = 1280, height: int = 900):
        """Open `url` (a page a test serves) in a fresh tab and keep it open while the block runs: yields a Tab to
        evaluate scripts in and to read, at any moment, what went wrong so far."""
        target, session = self._new_target()
        try:
            start = self._navigate(session, url, width, height)
            yield Tab(self, session, url, start)
        finally:
            self._call("Target.closeTarget", {"targetId": target})

    def close(self) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            try:
                self._call("Browser.close")
            except Exception:  # already gone: fall through to the signal
                pass
            ws.close()
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)
        pump = getattr(self, "_pump", None)
        if pump is not None:
            pump.join(timeout=5)  # ends at EOF, once the browser has exited
        self._proc.stderr.close()
        self._profile.cleanup()

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def origin_of(url: str) -> str:
    """'http://127.0.0.1:8765' for 'http://127.0.0.1:8765/static/app.js'."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class Tab:
    """A page kept open by `Chromium.tab()`: run scripts in it; `report()` says what went wrong since it opened."""

    def __init__(self, browser: Chromium, session: str, url: str, start: int):
        self._browser, self._session, self.url, self._start = browser, session, url, start

    def evaluate(self, expression: str):
        """The value of a JavaScript expression (a promise is awaited); a thrown error raises RuntimeError."""
        return self._browser._evaluate(expression, self._session)

    def plots(self) -> dict[str, dict]:
        """Once every plotly graph has drawn and stopped changing: per div id, the counts `Chromium.open` gives."""
        return self.evaluate(_RENDERED_JS % {"timeout_ms": int(self._browser.timeout_s * 1000)})

    def report(self) -> PageReport:
        """The page's text and plots now, and its console errors, exceptions, dialogs, failed requests and the
        requests that left its origin since it opened (screenshots are not taken)."""
        plots = self.plots()
        text = self.evaluate("document.body.innerText")
        img_count = self.evaluate("document.querySelectorAll('img').length")
        report = PageReport(self.url, plots, text, {}, img_count=img_count)
        events = [e for e in self._browser._events[self._start:] if e.get("sessionId") == self._session]
        Chromium._collect(report, events, self.url, origin=origin_of(self.url))
        return report

    def requests(self) -> list[str]:
        """Every URL the page has requested since it opened."""
        return [e["params"]["request"]["url"] for e in self._browser._events[self._start:]
                if e.get("sessionId") == self._session and e["method"] == "Network.requestWillBeSent"]


def browser_for(what: str, **kwargs):
    """A Chromium for a module's tests (a generator for a pytest fixture): skipped without Chromium or
    websocket-client, failed instead on CI (or with MEMFIT_REQUIRE_BROWSER) where both must be there."""
    import os

    import pytest

    required = bool(os.environ.get("CI") or os.environ.get("MEMFIT_REQUIRE_BROWSER"))
    give_up = pytest.fail if required else pytest.skip
    executable = find_chromium()
    if executable is None:
        give_up(f"{what} need(s) Chromium at /usr/bin/chromium: {INSTALL_HINT}")
    try:
        import websocket  # noqa: F401
    except ImportError:
        give_up(f"{what} need(s) websocket-client: pip install -e '.[test]'")
    with Chromium(executable, **kwargs) as chromium:
        yield chromium

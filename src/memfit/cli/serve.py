"""`memfit serve`: the local page (memfit.serve). The web framework is an optional extra, imported only when the
command runs; without it the command is one line naming the extra, and exit code 2."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated

import typer

from ..errors import ConfigError
from . import interrupt
from .common import app, examples

SERVE_PANEL = "Server"
NEEDED = ("starlette", "uvicorn", "plotly")

HostOpt = Annotated[str, typer.Option(
    "--host", rich_help_panel=SERVE_PANEL, metavar="ADDRESS",
    help="Address to listen on. The default answers this machine only; another address serves the page, which has "
         "no login, to the network.")]
PortOpt = Annotated[int, typer.Option(
    "--port", rich_help_panel=SERVE_PANEL, metavar="N", min=0, max=65535,
    help="Port to listen on (0: any free one).")]
NoBrowserOpt = Annotated[bool, typer.Option(
    "--no-browser", rich_help_panel=SERVE_PANEL, help="Print the address only; do not open a browser.")]


def _missing() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _has_desktop() -> bool:
    """Whether a graphical browser can open: on a bare terminal, webbrowser would start a text one in it."""
    return (sys.platform in ("darwin", "win32") or bool(os.environ.get("BROWSER"))
            or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")))


@app.command("serve", epilog=examples("memfit serve", "memfit serve --port 9000 --no-browser"))
def serve_command(host: HostOpt = "127.0.0.1", port: PortOpt = 8765, no_browser: NoBrowserOpt = False) -> None:
    """A local page to play with a plan: pick the model, GPU and setup; the breakdown chart, the ladder and the
    verdict update as you change them, with the numbers `memfit plan` gives. Ctrl-C stops it."""
    missing = _missing()
    if missing:
        raise ConfigError(f"memfit serve needs {', '.join(missing)}: pip install 'memfit[serve]'")
    from ..serve.web import MAX_WORKERS, is_loopback, serve

    def ready(url: str) -> None:
        typer.echo(f"memfit serve: {url} (Ctrl-C stops it)")
        if not is_loopback(host):
            typer.echo(f"memfit serve: listening on {host}, not only this machine: anyone who can reach it can use "
                       "the page", err=True)
        if not no_browser and _has_desktop():
            import webbrowser

            try:
                webbrowser.open(url)
            except Exception:  # no browser here: the address is printed
                pass

    try:
        with interrupt.awaited():  # Ctrl-C is how the page stops: exit 0 once its workers end, no watchdog
            serve(host, port, on_ready=ready, workers=min(MAX_WORKERS, os.cpu_count() or 1))
    except KeyboardInterrupt:
        pass

"""Progress of a first (slow) derivation on stderr: a rich progress bar, quiet when asked (--json) or when stderr is
no terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_QUIET: list[bool] = []


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """No progress output inside this block (the CLI's --json)."""
    _QUIET.append(enabled)
    try:
        yield
    finally:
        _QUIET.pop()


def _is_quiet() -> bool:
    if _QUIET:
        return _QUIET[-1]
    if "--json" in sys.argv[1:]:  # the CLI's machine-readable mode: stdout is JSON, keep stderr clean too
        return True
    return not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())


@contextlib.contextmanager
def reporting(title: str):
    """Yields progress(message, fraction) for derive_kind."""
    if _is_quiet():
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(title, total=1.0)

        def progress(message: str, fraction: float) -> None:
            bar.update(task, completed=fraction, description=f"{title}: {message}")

        yield progress

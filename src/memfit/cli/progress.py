"""Progress on stderr for the work that takes seconds to minutes (building and stepping a model, deriving an
architecture, tracing): a rich bar with the phase, drawn only here. The library reports through callbacks,
`progress(message, fraction)`, and never prints (memfit.measure.Progress, memfit.derive.progress).

No bar when stderr is not a terminal, under --json (scripts read stdout; stderr stays clean), or with the global
--quiet."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

Progress = Callable[[str, float], None]

_HIDDEN: list[bool] = [False]
"""The innermost scope's answer: True while the command runs with --json, or after `memfit --quiet`."""


def hide(hidden: bool = True) -> None:
    """The global --quiet: no progress for the rest of this command."""
    _HIDDEN[0] = hidden


@contextlib.contextmanager
def hidden(when: bool = True) -> Iterator[None]:
    """No progress inside this block when `when` (a command's --json)."""
    _HIDDEN.append(when or _HIDDEN[-1])
    try:
        yield
    finally:
        _HIDDEN.pop()


def shown() -> bool:
    return not _HIDDEN[-1] and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(title: str) -> Iterator[Progress | None]:
    """Yields progress(message, fraction) that updates a transient bar titled `title`, or None when not shown."""
    if not shown():
        yield None
        return
    from rich.progress import Progress as Bar

    from .common import console

    with Bar(transient=True, console=console(stderr=True)) as bar:
        task = bar.add_task(title, total=1.0)

        def progress(message: str, fraction: float) -> None:
            bar.update(task, completed=max(0.0, min(1.0, fraction)), description=f"{title}: {message}")

        yield progress


def install() -> None:
    """Draw memfit.derive's progress (a first derivation takes minutes) with this module's bar."""
    from ..derive import progress as derive_progress

    derive_progress.set_reporter(progress_bar)

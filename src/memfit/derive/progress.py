"""Progress of a first (slow) derivation: a hook, so the library never prints. The CLI installs one that draws a
bar on stderr (memfit.cli.progress); a library user may install their own with `set_reporter`.

A reporter is `reporter(title)`: a context manager that yields `progress(message, fraction)` or None."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager

Progress = Callable[[str, float], None]
Reporter = Callable[[str], ContextManager["Progress | None"]]

_REPORTER: list[Reporter | None] = [None]
_QUIET: list[bool] = []


def set_reporter(reporter: Reporter | None) -> Reporter | None:
    """Report derivations through `reporter` from now on (None: silently); returns the previous one."""
    previous, _REPORTER[0] = _REPORTER[0], reporter
    return previous


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """No progress reported inside this block."""
    _QUIET.append(enabled)
    try:
        yield
    finally:
        _QUIET.pop()


@contextlib.contextmanager
def reporting(title: str) -> Iterator[Progress | None]:
    """Yields progress(message, fraction) for derive_kind / derive_stacks, or None when nobody listens."""
    reporter = _REPORTER[0]
    if reporter is None or (_QUIET and _QUIET[-1]):
        yield None
        return
    with reporter(title) as progress:
        yield progress

"""Ctrl-C: every command ends within 2 s of SIGINT with exit code 130 and nothing half-written.

While a command runs (`handling()`, entered by the CLI's main):
- SIGINT raises KeyboardInterrupt in the main thread, also when the process was started with SIGINT ignored (a
  background job of a shell script: `memfit trace ... & kill -INT $!` would otherwise be ignored for good);
- a watchdog thread, woken by the signal through signal.set_wakeup_fd (written by the C-level handler, so it wakes
  even while the main thread is inside a long C call or an import that swallowed the KeyboardInterrupt), ends the
  process with 130 GRACE_S later if the command has not ended by then;
- a critical section (memfit.atomic.critical: the renames that publish --emit's files) is not cut: the interrupt
  is raised, and the watchdog fires, only after it.
Files are written to temporary names and renamed (memfit.atomic), so an interrupt leaves the old files or the new
ones, never part of one."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from .. import atomic

INTERRUPTED = 130
"""128 + SIGINT, what a shell reports for a command ended by Ctrl-C."""
GRACE_S = 1.0
"""How long the main thread has to unwind (print its line, remove temporary files) before the watchdog ends it."""


class _State:
    def __init__(self) -> None:
        self.hit = False
        self.awaited = False
        """The command stops on Ctrl-C by design (serve): no watchdog, its own exit code."""
        self.done = threading.Event()


_state: _State | None = None


def interrupted() -> bool:
    """Whether SIGINT arrived while the current command ran."""
    return _state is not None and _state.hit


def _on_sigint(signum, frame) -> None:
    state = _state
    if state is None:
        raise KeyboardInterrupt
    state.hit = True
    if atomic.defer_interrupt():  # raised when the critical section ends
        return
    raise KeyboardInterrupt


def _watch(receiver: socket.socket, state: _State) -> None:
    if hasattr(signal, "pthread_sigmask"):  # the main thread's handler raises; this thread only watches
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    while not state.done.is_set():
        try:
            data = receiver.recv(64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            break
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline or atomic.in_critical():
        if state.done.wait(0.05) or state.awaited:
            return
    try:
        os.write(2, b"\ninterrupted\n")
    finally:
        os._exit(INTERRUPTED)


@contextmanager
def handling() -> Iterator[None]:
    """SIGINT handling for one command (a no-op outside the main thread: signals go to the main thread only)."""
    global _state
    if _state is not None or threading.current_thread() is not threading.main_thread():
        yield  # already handled (the console script enters before the commands are imported), or not ours
        return
    state = _State()
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    previous_fd = signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    previous = signal.signal(signal.SIGINT, _on_sigint)
    saved, _state = _state, state
    watcher = threading.Thread(target=_watch, args=(receiver, state), name="memfit-sigint", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        state.done.set()
        signal.signal(signal.SIGINT, previous)
        signal.set_wakeup_fd(previous_fd)
        _state = saved
        sender.close()  # the watcher's recv returns b"": it ends
        watcher.join(1.0)
        receiver.close()


@contextmanager
def awaited() -> Iterator[None]:
    """Around a command whose normal stop is Ctrl-C (`memfit serve`): it handles the KeyboardInterrupt itself
    and exits 0; the watchdog leaves it alone."""
    if _state is not None:
        _state.awaited = True
    yield


def exit_now(code: int) -> None:
    """End the console-script process at once (after an interrupt: the interpreter's teardown of torch can take
    seconds, and nothing is left to clean up)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

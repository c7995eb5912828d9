"""The `memfit` command line. `main` is the console script; the commands live in app.py.

This module and the package above it (memfit/__init__.py, lazy) import nothing heavy: the console script runs
`from memfit.cli import main; main()`, and until main() installs a SIGINT handler a Ctrl-C gets Python's default
(a KeyboardInterrupt traceback)."""

import signal


_EARLY: list[int] = []
"""SIGINTs that arrived before the full handler: the KeyboardInterrupt raised for one can land where Python swallows
it (an import lock's weakref callback prints "Exception ignored" and goes on), so main() also checks this."""


def _interrupted_early(signum, frame) -> None:
    _EARLY.append(signum)
    raise KeyboardInterrupt


def main() -> None:
    """Run the memfit command line (console script `memfit`)."""
    # First, before memfit.cli.interrupt and the commands' modules are imported: Ctrl-C during those imports ends
    # the command as one later does (exit 130, one line), also when started with SIGINT ignored (a background job).
    previous = _install(_interrupted_early)
    try:
        from .interrupt import INTERRUPTED, handling

        with handling():  # the full handler (watchdog, critical sections) while the command runs
            if _EARLY:  # a Ctrl-C during the imports above that Python swallowed: it still ends the command
                raise KeyboardInterrupt
            from .app import main as run

            run()
    except KeyboardInterrupt:
        _stop(announce=True)
    except SystemExit as done:
        if done.code == INTERRUPTED:
            _stop(announce=False)  # skip the interpreter's teardown (torch's takes seconds): Ctrl-C ends in 2 s
        raise
    finally:
        _install(previous)


def _install(handler):
    """Set the SIGINT handler and return the one before; None outside the main thread (main() called from a thread
    of another program: signals are the main thread's)."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:
        return None


def _stop(*, announce: bool) -> None:
    _install(signal.SIG_IGN)  # a second Ctrl-C while this ends changes nothing
    from .interrupt import INTERRUPTED, exit_now

    if announce:
        print("interrupted", file=__import__("sys").stderr)
    exit_now(INTERRUPTED)


__all__ = ["main"]

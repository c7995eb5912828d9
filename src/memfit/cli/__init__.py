"""The `memfit` command line. `main` is the console script; the commands live in app.py."""


def main() -> None:
    """Run the memfit command line (console script `memfit`)."""
    from .interrupt import INTERRUPTED, exit_now, handling

    try:
        with handling():  # before the commands' modules are imported: Ctrl-C during the imports counts too
            from .app import main as run

            run()
    except KeyboardInterrupt:
        print("interrupted", file=__import__("sys").stderr)
        exit_now(INTERRUPTED)
    except SystemExit as done:
        if done.code == INTERRUPTED:
            exit_now(INTERRUPTED)  # skip the interpreter's teardown (torch's takes seconds): Ctrl-C ends in 2 s
        raise


__all__ = ["main"]

"""The `memfit` command line. `main` is the console script; the commands live in app.py."""


def main() -> None:
    """Run the memfit command line (console script `memfit`)."""
    from .app import main as run

    run()


__all__ = ["main"]

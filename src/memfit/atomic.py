"""Writing files all or nothing: each file is written in full under a temporary name in its own folder, and only
when every one is written are they renamed over their targets (os.replace: atomic within a file system). A disk
that fills, a write that fails or a Ctrl-C before the renames leaves the old files untouched and no temporary file
behind; the renames run as one `critical()` section that an interrupt waits for (memfit.cli.interrupt)."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_critical = 0
_pending = False


def defer_interrupt() -> bool:
    """For a SIGINT handler: True (and the interrupt raised when the section ends) while a critical section runs."""
    global _pending
    if _critical:
        _pending = True
        return True
    return False


def in_critical() -> bool:
    return _critical > 0


@contextmanager
def critical() -> Iterator[None]:
    """A section an interrupt must not cut (a handler that honours defer_interrupt raises it when it ends)."""
    global _critical, _pending
    _critical += 1
    try:
        yield
    finally:
        _critical -= 1
        if not _critical and _pending:
            _pending = False
            raise KeyboardInterrupt


def write_files(files: list[tuple[Path, bytes]]) -> None:
    """Write every (path, content) or none: temporary files first (removed on any failure, OSError or interrupt,
    which is then raised), then the renames."""
    temps: list[tuple[str, Path]] = []
    mode = _file_mode()
    try:
        for path, data in files:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            temps.append((tmp, path))
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)  # mkstemp's 0600 -> what open() would give (0666 less the umask)
            _write(fd, data)
        with critical():
            for tmp, path in temps:
                os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass  # already renamed
        raise


def _write(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_text(path: str | Path, text: str) -> Path:
    """One UTF-8 text file, all or nothing."""
    path = Path(path)
    write_files([(path, text.encode("utf-8"))])
    return path

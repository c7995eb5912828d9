"""What is installed, read without importing it: the versions that decide how a config or a call is spelled
(transformers' TrainingArguments names, from_pretrained's dtype keyword)."""

from __future__ import annotations

import sys


def installed_version(name: str) -> str | None:
    """The installed distribution's version, read once per process: reading package metadata parses files (~10 ms,
    three times per plan shown), and what is installed does not change under a running process."""
    if name not in _INSTALLED:
        from importlib import metadata

        try:
            _INSTALLED[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            _INSTALLED[name] = None
    return _INSTALLED[name]


_INSTALLED: dict[str, str | None] = {}


def transformers_version() -> tuple[int, int] | None:
    """The installed transformers' (major, minor): its `__version__` when already imported, else the installed
    distribution's version, read without importing it (importing transformers takes seconds); None without it."""
    version = getattr(sys.modules.get("transformers"), "__version__", None) or installed_version("transformers")
    if version is None:
        return None
    parts = str(version).split(".")
    try:
        return int(parts[0]), int("".join(c for c in (parts[1] if len(parts) > 1 else "0") if c.isdigit()) or 0)
    except ValueError:
        return None


def transformers_major() -> int | None:
    version = transformers_version()
    return version[0] if version else None


def dtype_keyword() -> str:
    """from_pretrained's dtype keyword: `dtype` since transformers 4.56 (and without transformers), `torch_dtype`
    before (which silently ignores `dtype`)."""
    version = transformers_version()
    return "torch_dtype" if version is not None and version < (4, 56) else "dtype"


def legacy_checkpointing_names() -> bool:
    """True where TrainingArguments only knows gradient_checkpointing (transformers 4.x); 5.x names otherwise."""
    major = transformers_major()
    return major is not None and major < 5

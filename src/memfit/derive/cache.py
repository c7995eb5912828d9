"""Derived models on disk: one JSON file per (config, library versions, setup kind).

Where: $MEMFIT_CACHE_DIR, else $XDG_CACHE_HOME/memfit/derived, else ~/.cache/memfit/derived. Files are written
atomically (a temporary file in the same folder, then os.replace), so a reader never sees half a file; one that
does not parse, or holds another key, is ignored and derived again. memfit also ships derived files for catalog
models whose family has no recipe (memfit/data/derived, keyed by config and kind: they were derived under the
versions they record).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from .. import errors
from .._version import __version__

from .model import KindFit

FORMAT = 1
"""The layout of the payloads whose meaning has not changed since the first version: parameter tensors
(memfit.derive.spec, memfit.derive.stacks_spec), stacked fits (memfit.derive.stacks_estimate), compiled fits."""

FIT_FORMAT = 2
"""memfit.derive.fit's one-stack fits. Bump it when a change there gives other numbers for some config, so that the
fits cached on disk and shipped before the change are derived again (scripts/ship_derived.py re-ships those whose
recorded format differs). 2: a dense prefix (first_k_dense_replace, DeepSeek-V2 / V3) is the depth-weighted mean
of the dense and routed blocks; a sliding window under sdpa is fitted on both sides of it (Gemma 3)."""


def cache_dir() -> Path:
    explicit = os.environ.get("MEMFIT_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "memfit" / "derived"


def config_hash(config: dict[str, Any]) -> str:
    """Of the values that describe the architecture (names and paths do not change memory)."""
    skip = {"_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"}
    text = json.dumps({k: v for k, v in config.items() if k not in skip}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def library_versions() -> dict[str, str]:
    """memfit's, torch's and transformers' versions, read once per process: package metadata is parsed from files
    (~5 ms per read, on every estimate's cache key), and what is installed does not change under a running
    process."""
    if not _VERSIONS:
        from importlib.metadata import PackageNotFoundError, version

        out = {"memfit": __version__}
        for name in ("torch", "transformers"):
            try:
                out[name] = version(name)
            except PackageNotFoundError:
                out[name] = "missing"
        _VERSIONS.update(out)
    return dict(_VERSIONS)


_VERSIONS: dict[str, str] = {}


def cache_key(config: dict[str, Any], kind: str, versions: dict[str, str] | None = None,
              format_version: int = FORMAT) -> str:
    versions = versions or library_versions()
    text = json.dumps({"config": config_hash(config), "versions": versions, "kind": kind, "format": format_version},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def shipped_name(config: dict[str, Any], kind: str) -> str:
    return f"{config_hash(config)}-{kind.replace('/', '_')}.json"


def cache_path(config: dict[str, Any], kind: str, format_version: int = FORMAT) -> Path:
    return cache_dir() / f"{cache_key(config, kind, format_version=format_version)}.json"


def read_json(path: Path, key: str, format_version: int = FORMAT) -> dict[str, Any] | None:
    """The file's payload when it parses, holds `key` and has this format; None otherwise (missing, corrupt,
    foreign, older)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or data.get("format") != format_version:
        return None
    return data


def write_json(path: Path, data: dict[str, Any]) -> bool:
    """Atomic write (memfit.atomic); False (and nothing left behind) when the folder is not writable."""
    from ..atomic import write_files

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_files([(path, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))])
    except OSError:
        return False
    return True


def shipped_data(config: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The payload memfit ships for this config and kind (memfit/data/derived), or None."""
    try:
        text = resources.files("memfit").joinpath("data/derived").joinpath(shipped_name(config, kind)).read_text(
            encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError, TypeError, FileNotFoundError):
        return None
    return data if isinstance(data, dict) else None


def _shipped(config: dict[str, Any], kind: str) -> KindFit | None:
    """The shipped fit, unless it was derived under another FIT_FORMAT (then it is derived again)."""
    data = shipped_data(config, kind)
    if data is not None and data.get("format") != FIT_FORMAT:
        return None
    try:
        return KindFit.from_dict(data["fit"]) if data is not None else None
    except (ValueError, KeyError, TypeError):
        return None


_MEMORY: dict[str, KindFit] = {}


@contextlib.contextmanager
def one_line_failure(config: dict[str, Any], label: str = "", *, everything: bool = True):
    """A failure while the copies of a model are built and traced is one ModelSourceError line: transformers
    reads config attributes a hand-made config.json may not set (T5's decoder_start_token_id builds the decoder's
    inputs in transformers/models/t5/modeling_t5.py `_shift_right`), and then the line names the attribute.
    `everything`: any other exception too (a derive); else (`memfit trace`) only the missing attribute."""
    what = label or str(config.get("model_type"))
    try:
        yield
    except errors.MemfitError:
        raise
    except AttributeError as error:
        name = getattr(error, "name", None)
        if name and "config" in type(getattr(error, "obj", None)).__name__.lower():
            raise errors.ModelSourceError(f"{what}: the config lacks '{name}', which transformers reads to run "
                                   f"model_type '{config.get('model_type')}': add it to the config") from None
        if not everything:
            raise
        raise errors.ModelSourceError(f"{what}: deriving the memory model failed ({first_line(error)})") from None
    except Exception as error:  # noqa: BLE001 - a config transformers cannot run: one line, never a traceback
        if not everything:
            raise
        raise errors.ModelSourceError(f"{what}: deriving the memory model failed ({first_line(error)})") from None


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's first line, whitespace collapsed and cut to `limit`: how a derive failure quotes it."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_or_derive(config: dict[str, Any], kind: str, *, label: str = "") -> tuple[KindFit, str]:
    """(fit, where it is stored): from this process, the shipped data, the disk cache, or derived now."""
    shipped = _shipped(config, kind)
    if shipped is not None:
        return shipped, "memfit/data/derived (shipped)"
    path = cache_path(config, kind, FIT_FORMAT)
    key = path.stem
    if key in _MEMORY:
        return _MEMORY[key], str(path)
    data = read_json(path, key, FIT_FORMAT)
    if data is not None:
        try:
            fit = KindFit.from_dict(data["fit"])
            _MEMORY[key] = fit
            return fit, str(path)
        except (KeyError, TypeError, ValueError):
            pass  # a corrupt entry: derive it again
    from .progress import reporting
    from .fit import derive_kind

    started = time.perf_counter()
    with (failures_cached(path, key, FIT_FORMAT, kind=kind, model_type=config.get("model_type"),
                          versions=library_versions()),
          reporting(f"deriving {label or config.get('model_type')} ({kind})") as progress,
          one_line_failure(config, label)):
        fit = derive_kind(config, kind, progress=progress)
    _MEMORY[key] = fit
    payload = {"key": key, "format": FIT_FORMAT, "kind": kind, "model_type": config.get("model_type"),
               "config_hash": config_hash(config), "versions": library_versions(),
               "derive_seconds": round(time.perf_counter() - started, 3), "fit": fit.to_dict()}
    stored = write_json(path, payload)
    return fit, str(path) if stored else "memory only (cache folder not writable)"


# ---- failures -----------------------------------------------------------------------------------------------------
# A derivation that fails (an architecture transformers builds but memfit cannot fit) fails again the same way with
# the same config, libraries and memfit code, after the same minutes of tracing: its error is cached beside the
# success file, keyed like it plus a fingerprint of memfit's own source, so any code change derives again.


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of memfit's Python sources (an edit, a new release: failures cached before it are derived again)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for source in sorted(root.rglob("*.py")):
        digest.update(source.relative_to(root).as_posix().encode())
        with contextlib.suppress(OSError):
            digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def failure_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.failed.json")


@contextlib.contextmanager
def failures_cached(path: Path, key: str, format_version: int = FORMAT, **fields: Any) -> Iterator[None]:
    """Around a derivation whose success is stored at `path` under `key`: first raise the error it cached, if it
    failed before with this key and this code; then, if the block raises a MemfitError (other than a missing
    dependency, which an install fixes), cache it with `fields` before it propagates."""
    failed = failure_path(path)
    data = read_json(failed, key, format_version)
    if data is not None and data.get("code") == code_fingerprint() and isinstance(data.get("error"), str):
        cls = getattr(errors, str(data.get("error_type")), None)
        raise (cls if isinstance(cls, type) and issubclass(cls, errors.MemfitError) else errors.ModelSourceError)(
            data["error"])
    started = time.perf_counter()
    try:
        yield
    except errors.MissingDependencyError:
        raise
    except errors.MemfitError as error:
        write_json(failed, {"key": key, "format": format_version, "code": code_fingerprint(),
                            "error_type": type(error).__name__, "error": str(error),
                            "derive_seconds": round(time.perf_counter() - started, 3), **fields})
        raise


def clear_memory() -> None:
    """Forget what this process loaded (tests and benchmarks time the disk cache this way)."""
    _MEMORY.clear()

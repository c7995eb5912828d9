"""What the verl and OpenRLHF readers share (memfit.rl.frameworks): the Reading they return, the files' keys
flattened and their `${a.b}` interpolations resolved, a launch script's words, which framework a file is for, and
the typed reading of one key (_Keys)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...readers._reader import Reader, show
from ...readers.files import read_bounded

VERL = "verl"
OPENRLHF = "openrlhf"
_INTERPOLATION = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


@dataclass
class Reading:
    """What one framework config gave: RLSetup keyword arguments, the model, the GPUs, and the reading's record."""

    framework: str
    settings: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    gpus: int | None = None
    mapped: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    """Keys read that set nothing at their value (the model, a switch left at its default, the optimizer's batch)."""


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """`${a.b}` values replaced by a.b's value (a chain of them followed a few steps; an unknown name stays as
    written)."""
    out = dict(flat)
    for _ in range(4):
        changed = False
        for key, value in out.items():
            match = _INTERPOLATION.match(value) if isinstance(value, str) else None
            if match and match.group(1) in out and out[match.group(1)] is not value:
                out[key] = out[match.group(1)]
                changed = True
        if not changed:
            break
    return out


def _scalar(text: str) -> Any:
    """A Hydra override's value: null / true / false / a number / a string."""
    lowered = text.lower()
    if lowered in ("null", "none", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("'\"")


def _tokens(path: Path, shown: str) -> list[str]:
    """A launch script's words, line continuations joined, comments and shell variables' assignments kept as
    words (they are not arguments: the readers skip what they do not know)."""
    text = read_bounded(path, shown).decode("utf-8", errors="replace").replace("\\\n", " ")
    words: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words += shlex.split(line, comments=True)
        except ValueError as error:
            raise ConfigError(f"{shown}: cannot split the command line ({error})") from None
    return words


def detect(path: Path) -> str | None:
    """'verl', 'openrlhf' or None (TRL's config) from the file's content."""
    try:
        head = read_bounded(path, str(path)).decode("utf-8", errors="replace")
    except (OSError, ConfigError):
        return None
    if "actor_rollout_ref" in head:
        return VERL
    if "openrlhf" in head.lower() or re.search(r"(^|\s)--(pretrain|colocate_all_models|micro_train_batch_size)\b",
                                                head):
        return OPENRLHF
    return None


def _done(read: Reader, flat: Mapping[str, Any], handled: set[str], shown: str) -> tuple[str, ...]:
    """Every handled key the reading has no record of yet is recorded as read (it changes nothing at its value)."""
    for key in sorted(handled):
        if key in flat and key not in read.consumed.get(shown, set()):
            read.defer(key, flat[key], "read: changes nothing at this value")
    return tuple(e.text for e in read.entries() if not e.sets or e.sets[0][0] == "model")


def _int(read: Reader, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{read.file}: {key} must be an integer, got {show(value)}")
    return value


def _count(read: Reader, key: str, value: Any, least: int = 1) -> int:
    """A whole number of at least `least`: GPUs, nodes, a micro-batch, a length (the readers divide by them)."""
    if _int(read, key, value) < least:
        raise ConfigError(f"{read.file}: {key} must be at least {least}, got {show(value)}")
    return value


def _bool(read: Reader, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{read.file}: {key} must be true or false, got {show(value)}")
    return value


def _float(read: Reader, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{read.file}: {key} must be a number, got {show(value)}")
    return float(value)


@dataclass
class _Keys:
    """A reading under way: the file's keys, the RLSetup settings they gave so far, the keys handled; `flag` is how
    the file writes a key ('' verl, '--' OpenRLHF); a null value is the key's absence when `null_is_absent`."""

    read: Reader
    keys: Mapping[str, Any]
    out: dict[str, Any]
    flag: str = ""
    null_is_absent: bool = True
    handled: set[str] = field(default_factory=set)

    def get(self, key: str, default: Any = None) -> Any:
        return self.keys.get(key, default)

    def take(self, key: str, target: str, convert, note: str = "", transform=lambda v: v) -> Any:
        """keys[key], converted (ConfigError on the wrong type), as the setting `target`; None when absent."""
        self.handled.add(key)
        if key not in self.keys or (self.null_is_absent and self.keys[key] is None):
            return None
        value = transform(convert(self.read, self.flag + key, self.keys[key]))
        self.out[target] = value
        self.read.set(target, value, self.flag + key, self.keys[key], note)
        return value

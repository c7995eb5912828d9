"""What a reading records: the TrainingSetup fields a config sets, each config field read (its value and what it
set) and each one left out (and why). One Reader serves the live objects memfit.check reads (lenient: what it cannot
map is listed) and the files memfit.readers reads (strict: what it cannot map is a one-line ConfigError)."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

from ..errors import ConfigError
from ..setup import FIELD_LABELS

NOT_RELEVANT = "not memory-relevant"
NOT_SIZED = "not sized by memfit yet"
OFF = "off: nothing to size"
_MISSING = object()


def _get(args: Any, name: str, default: Any = None) -> Any:
    if isinstance(args, Mapping):
        return args.get(name, default)
    return getattr(args, name, default)


def _value(obj: Any) -> Any:
    return getattr(obj, "value", obj)


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict") and not isinstance(value, type):
        return jsonable(value.to_dict())
    if isinstance(value, Enum):
        return value.value
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return str(value)


PART_LABELS = {"finetune.method": "method", "finetune.rank": "LoRA rank", "finetune.alpha": "LoRA alpha",
               "finetune.dropout": "LoRA dropout", "finetune.targets": "LoRA targets",
               "finetune.modules_to_save": "modules_to_save", "finetune.base": "base weights",
               "finetune.double_quant": "double quantization", "finetune.dora": "DoRA",
               "finetune.rslora": "rsLoRA", "finetune.recipe": "LoRA recipe"}
"""How the parts of a composite setup field (the Finetune's) are named in `mapped` and ReadEntry.text."""


def label(field: str) -> str:
    return FIELD_LABELS.get(field) or PART_LABELS.get(field, field)


def _shown(value: Any) -> Any:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "()"
    return _value(value)


_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict, _QUOTE.maxset = 4, 12, 12, 12, 12
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 400, 400, 400


def show(value: Any, limit: int = 60) -> str:
    """The value as a message quotes it: repr, cut to `limit` characters. reprlib formats only what fits (a few
    items per level, a few levels), so quoting a huge value (a YAML alias bomb) costs nothing."""
    text = _QUOTE.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class ReadEntry:
    """One config field memfit read: its value and the TrainingSetup fields it set (none when it defers)."""

    file: str
    field: str
    value: Any
    sets: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    @property
    def text(self) -> str:
        sets = ", ".join(f"{label(f)} {_shown(v)}" for f, v in self.sets) or "nothing"
        return f"{self.field}={show(self.value)} -> {sets}" + (f" ({self.note})" if self.note else "")

    def to_dict(self) -> dict:
        return {"file": self.file, "field": self.field, "value": jsonable(self.value),
                "sets": {f: jsonable(v) for f, v in self.sets}, "note": self.note}


@dataclass(frozen=True)
class IgnoredEntry:
    """One config field memfit did not use, and why: not memory-relevant, or not sized by memfit yet."""

    file: str
    field: str
    value: Any
    why: str

    @property
    def text(self) -> str:
        return f"{self.field}={show(self.value)}: {self.why}"

    def to_dict(self) -> dict:
        return {"file": self.file, "field": self.field, "value": jsonable(self.value), "why": self.why}


@dataclass(frozen=True)
class ReadSetup:
    """TrainingSetup fields read from the training script's objects, and what was read and what was not."""

    fields: dict[str, Any]
    mapped: tuple[str, ...]
    """'per_device_train_batch_size=4 -> micro-batch 4', one per field read."""
    ignored: tuple[str, ...]
    """Settings that were seen but are not part of the estimate, and why."""


class Reader:
    """Collects one reading. `strict` (files): a value that cannot be mapped raises a ConfigError naming the file,
    field and value, and a false switch counts as the user's choice; otherwise (live objects) it is listed in
    `ignored`. `overridden`: setup fields given elsewhere ({field: '--optimizer'}): the config's value is recorded
    as overridden and never raises."""

    def __init__(self, *, file: str = "", strict: bool = False, overridden: Mapping[str, str] | None = None,
                 assumed_dtype: bool = False) -> None:
        self.file, self.prefix, self.strict = file, "", strict
        self.overridden = dict(overridden or {})
        self.assumed_dtype = assumed_dtype
        """True when the model's load dtype is assumed (fp32), not known: the precision says so."""
        self.fields: dict[str, Any] = {}
        self.sources: dict[str, tuple[str, str]] = {}
        self.weak: set[str] = set()
        self.mapped: list[str] = []
        self.ignored: list[str] = []
        self.skipped: list[IgnoredEntry] = []
        self.consumed: dict[str, set[str]] = {}
        self.model: tuple[str, str, str] | None = None
        """(model reference, file, field)."""
        self.num_nodes: int | None = None
        self.deepspeed_at: tuple[str, str] = ("", "")
        """(file, key prefix) of the DeepSpeed config being read with TrainingArguments / accelerate."""
        self.ds_optimizer = False
        """The DeepSpeed config's optimizer block set the optimizer (TrainingArguments' optim is then unused)."""
        self.base_hint: tuple | None = None
        """(method, {finetune part: value}) of a from_pretrained quantization_config, for the adapters another file
        gives (read_config applies it)."""
        self._entries: dict[tuple[str, str], list] = {}

    @contextmanager
    def scope(self, file: str, prefix: str = "") -> Iterator[None]:
        saved = self.file, self.prefix
        self.file, self.prefix = file, prefix
        try:
            yield
        finally:
            self.file, self.prefix = saved

    def consume(self, key: str) -> None:
        self.consumed.setdefault(self.file, set()).add(self.prefix + key)

    def _entry(self, key: str, raw: Any, sets: tuple = (), note: str = "") -> None:
        self.consume(key)
        entry = self._entries.setdefault((self.file, self.prefix + key), [None if raw is _MISSING else raw, [], []])
        entry[1].extend(s for s in sets if s not in entry[1])
        if note and note not in entry[2]:
            entry[2].append(note)

    def set(self, field: str, value: Any, key: str, raw: Any = _MISSING, note: str = "", *,
            weak: bool = False, text: str | None = None) -> None:
        """The config's `key` (= `raw`) sets `field` to `value`. `text`: how `mapped` names the source."""
        if field in self.overridden:
            self._entry(key, raw, (), f"{label(field)} overridden by {self.overridden[field]}")
            return
        self.fields[field] = value
        self.sources[field] = (self.file, self.prefix + key)
        (self.weak.add if weak else self.weak.discard)(field)
        source = text or (key if raw is _MISSING else f"{key}={show(raw, 120)}") + (f" ({note})" if note else "")
        self.mapped.append(f"{source} -> {label(field)} {_value(value)}")
        self._entry(key, raw, ((field, value),), note)

    def annotate(self, field: str, note: str) -> None:
        """Add `note` to the entry that set `field` (a later look at the whole setup changed what it means)."""
        if field in self.sources:
            self._entries.setdefault(self.sources[field], [None, [], []])[2].append(note)

    def set_part(self, field: str, part: str, value: Any, key: str, raw: Any = _MISSING, note: str = "") -> None:
        """The config's `key` (= `raw`) gives one part of the composite setup `field` (set whole by `set`): it
        is recorded as read, with what it gave ('lora_r=16 -> LoRA rank 16')."""
        if field in self.overridden:
            self._entry(key, raw, (), f"{label(field)} overridden by {self.overridden[field]}")
            return
        self._entry(key, raw, ((f"{field}.{part}", value),), note)

    def set_model(self, value: str, key: str, raw: Any = _MISSING, note: str = "") -> None:
        self.model = (value, self.file, self.prefix + key)
        self._entry(key, value if raw is _MISSING else raw, (("model", value),), note)

    def defer(self, key: str, raw: Any, note: str) -> None:
        """Read, but it sets nothing itself ('auto', or another field decides)."""
        self._entry(key, raw, (), note)

    def ignore(self, key: str, raw: Any, why: str, *, text: str | None = None) -> None:
        self.consume(key)
        self.skipped.append(IgnoredEntry(self.file, self.prefix + key, None if raw is _MISSING else raw, why))
        self.ignored.append(text or f"{key}={show(raw, 120)}: {why}")

    def unmappable(self, field: str, key: str, raw: Any, why: str, *, fallback: str = "") -> None:
        """A value memfit cannot map to `field`: a ConfigError when strict (unless the field is overridden)."""
        if field in self.overridden:
            self.ignore(key, raw, f"{why}; {label(field)} overridden by {self.overridden[field]}")
            return
        if self.strict:
            where = f"{self.file}: " if self.file else ""
            raise ConfigError(f"{where}{self.prefix}{key}={show(raw, 120)}: {why}")
        self.ignore(key, raw, why + (f"; {fallback}" if fallback else ""))

    def entries(self) -> list[ReadEntry]:
        return [ReadEntry(file, key, raw, tuple(sets), "; ".join(notes))
                for (file, key), (raw, sets, notes) in self._entries.items()]

    def result(self) -> ReadSetup:
        return ReadSetup(dict(self.fields), tuple(self.mapped), tuple(self.ignored))

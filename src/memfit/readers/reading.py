"""read_config: one or more config files -> the TrainingSetup fields they set, the model they name, what was read
and what was left out. Files combine: TrainingArguments / axolotl / LLaMA-Factory / accelerate follow the DeepSpeed
config they name; a from_pretrained kwargs file gives the others the weights' dtype; two files that set one field
to different values are a ConfigError naming both."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..setup import FIELD_LABELS, FsdpVersion, TrainingSetup
from ..typical import typical_setup
from ._reader import IgnoredEntry, ReadEntry, Reader, _value, jsonable, label, show
from .files import FORMATS, detect_format, display_path, load_mapping, unknown_format
from .formats import MAPPERS, ConfigFile, Context, load_dtype
from .lora import same_as_auto, with_base

OPTION_OF_FIELD = {"micro_batch_size": "--batch", "seq_len": "--seq", "grad_accum_steps": "--accum",
                   "precision": "--precision", "optimizer": "--optimizer", "checkpointing": "--checkpointing",
                   "attention": "--attention", "sharding": "--zero", "offload": "--offload", "engine": "--engine",
                   "num_gpus": "--gpus", "finetune": "--method"}


@dataclass(frozen=True)
class ConfigReading:
    """What the config files say about the training step."""

    files: tuple[ConfigFile, ...]
    overrides: dict[str, Any]
    """TrainingSetup fields the files set (num_gpus too, when they say how many ranks)."""
    model: str | None
    """The model the files name (axolotl base_model, LLaMA-Factory model_name_or_path, torchtune model), or None."""
    read: tuple[ReadEntry, ...]
    """Each field read: its value and what it set (nothing when it defers: 'auto', or another field decides)."""
    ignored: tuple[IgnoredEntry, ...]
    """Each field not used, and why: not memory-relevant, or not sized by memfit yet."""
    num_nodes: int | None = None
    """Machines (accelerate num_machines), when the files say more than one."""

    def layout(self) -> tuple[int, int]:
        """(GPUs per node, nodes) for the files' num_gpus."""
        world = self.overrides.get("num_gpus", 1)
        if self.num_nodes and world % self.num_nodes == 0:
            return world // self.num_nodes, self.num_nodes
        return (world, 1) if world <= 8 or world % 8 else (8, world // 8)

    def setup(self, spec: Any, hardware: Any, **given: Any):
        """The TrainingSetup: the files' fields, then `given` (the caller's, which win), a typical fine-tune's
        defaults for the rest (memfit.typical.typical_setup; the world size is the hardware's)."""
        fields = {k: v for k, v in self.overrides.items() if k != "num_gpus"}
        fields.update({k: v for k, v in given.items() if v is not None})
        return typical_setup(spec, hardware, **fields)

    def to_dict(self) -> dict:
        return {"files": [f.to_dict() for f in self.files], "model": self.model,
                "overrides": {k: jsonable(v) for k, v in self.overrides.items()},
                "read": [e.to_dict() for e in self.read], "ignored": [e.to_dict() for e in self.ignored]}


@dataclass
class _File:
    path: Path
    shown: str
    data: dict
    format: str
    resolved: Path = field(init=False)

    def __post_init__(self) -> None:
        self.resolved = self.path.resolve()


@dataclass(frozen=True)
class InMemory:
    """A config held as a mapping rather than a file (what memfit's own emitters write, read back to check it):
    `name` stands for the file in what is read and ignored."""

    name: str
    data: Mapping[str, Any]


def _load(ref: str | os.PathLike | InMemory) -> _File:
    if isinstance(ref, InMemory):
        kind = detect_format(dict(ref.data))
        if kind is None:
            raise unknown_format(ref.name, dict(ref.data))
        return _File(Path(ref.name), ref.name, dict(ref.data), kind)
    path = Path(ref).expanduser()
    shown = display_path(path) if path.is_absolute() else str(ref)
    data = load_mapping(path, shown)
    kind = detect_format(data)
    if kind is None:
        raise unknown_format(shown, data)
    return _File(path, shown, data, kind)


def read_config(*paths: str | os.PathLike | InMemory, num_gpus: int | None = None,
                overridden: Mapping[str, str] | None = None) -> ConfigReading:
    """Read TrainingArguments (JSON / YAML), DeepSpeed JSON, accelerate YAML, axolotl, LLaMA-Factory and torchtune
    recipe files and peft LoraConfigs (adapter_config.json, memfit's peft.json), alone or together; the format comes
    from each file's keys. `num_gpus`: the data-parallel size when the caller knows it (otherwise the files' own:
    accelerate num_processes, DeepSpeed train_batch_size; else 1). `overridden`: setup fields the caller sets itself
    ({'optimizer': '--optimizer'}): the files' values for them are recorded as overridden and never raise.
    A file that cannot be read, has no known format or holds a value memfit cannot map is a one-line ConfigError
    naming the file, field and value."""
    if not paths:
        raise ConfigError("read_config needs at least one config file")
    overridden = dict(overridden or {})
    if num_gpus is not None:
        overridden.setdefault("num_gpus", "num_gpus=")
    files = [_load(p) for p in paths]
    dtype = _weights_dtype(files)

    def run(world: int | None, skip: set[Path]) -> tuple[list[Reader], list[ConfigFile], set[Path]]:
        readers, records, referenced = [], [], set()
        for f in files:
            if f.format == "deepspeed" and f.resolved in skip:
                continue
            records.append(ConfigFile(f.shown, f.format))
            ctx = Context(f.path, f.shown, world, dtype, records, referenced)
            read = Reader(file=f.shown, strict=True, overridden=overridden, assumed_dtype=not dtype)
            MAPPERS[f.format](read, f.data, ctx)
            readers.append(read)
        return readers, records, referenced

    first, _, referenced = run(None, set())
    world = num_gpus
    if world is None:
        hints = _merge(first)[0]
        world = hints.get("num_gpus", 1)
    readers, records, _ = run(world, referenced)
    overrides, model, nodes = _merge(readers)
    _finetune(readers, overrides, overridden)
    _fsdp1_sized(readers, overrides)
    if num_gpus is not None:
        overrides.pop("num_gpus", None)
    read_entries, ignored = _entries(readers)
    unique = list({f.path: f for f in records}.values())
    return ConfigReading(tuple(unique), overrides, model, read_entries, ignored, nodes)


def _weights_dtype(files: list[_File]) -> str:
    """The weights' load dtype the from_pretrained kwargs files agree on ('' when none says)."""
    dtype, dtype_from = "", ""
    for f in files:
        found = load_dtype(f.data) if f.format == "from_pretrained" else None
        if found and found[0] in ("bf16", "fp32", "fp16"):
            if dtype and dtype != found[0]:
                raise ConfigError(f"{dtype_from} loads the weights in {dtype} but {f.shown} in {found[0]}")
            dtype, dtype_from = found[0], f.shown
    return dtype


def _entries(readers: list[Reader]) -> tuple[tuple[ReadEntry, ...], tuple[IgnoredEntry, ...]]:
    """Each file's field read once (the first reading of it), and each (file, field, reason) left out once."""
    seen: set[tuple[str, str]] = set()
    read_entries = []
    for r in readers:
        for entry in r.entries():
            if (entry.file, entry.field) not in seen:
                seen.add((entry.file, entry.field))
                read_entries.append(entry)
    ignored, ignored_seen = [], set()
    for r in readers:
        for entry in r.skipped:
            key = (entry.file, entry.field, entry.why)
            if key not in ignored_seen:
                ignored_seen.add(key)
                ignored.append(entry)
    return tuple(read_entries), tuple(ignored)


def _finetune(readers: list[Reader], overrides: dict[str, Any], overridden: Mapping[str, str]) -> None:
    """The adapters on the quantized base a from_pretrained kwargs file gives, and a LoRA base stored in the
    precision's compute dtype said as 'auto' (what memfit's options give for it)."""
    hints = [r for r in readers if r.base_hint is not None]
    ft = overrides.get("finetune")
    if hints and "finetune" not in overridden:
        read = hints[0]
        method, values = read.base_hint
        if ft is None or not ft.adapters:
            what = ("no file gives LoRA adapters" if ft is None else
                    f"{read_source(readers, 'finetune')} is a full fine-tune")
            raise ConfigError(f"{read.file}: quantization_config: a quantized base trains only through LoRA "
                              f"adapters, but {what}: give the adapter config (adapter_config.json) or --method")
        quantized = with_base(ft, method, values)
        if ft.base.quantized and ft.base_storage("bf16") != quantized.base_storage("bf16"):
            raise ConfigError(f"{read_source(readers, 'finetune')} stores the base {ft.base} but {read.file}: "
                              f"quantization_config {quantized.base_storage('bf16')}: make the files agree")
        overrides["finetune"] = quantized
    ft = overrides.get("finetune")
    if ft is not None and "precision" in overrides:
        overrides["finetune"] = same_as_auto(ft, overrides["precision"].compute_dtype)


def _fsdp1_sized(readers: list[Reader], overrides: dict[str, Any]) -> None:
    """A config that runs FSDP1 where memfit does not size FSDP1 yet (QLoRA, DoRA, ...: TrainingSetup's FSDP1
    check) is sized as FSDP2, as before, and says so on the entry that named FSDP1."""
    if overrides.get("fsdp_version") is not FsdpVersion.V1:
        return
    try:
        TrainingSetup(**overrides)
    except ConfigError as error:
        if "FSDP1" not in str(error):
            return
        overrides["fsdp_version"] = FsdpVersion.V2
        for read in readers:
            read.annotate("fsdp_version", f"sized as FSDP2: {error}")
    except TypeError:
        return


def read_source(readers: list[Reader], name: str) -> str:
    for read in readers:
        if name in read.sources:
            file, key = read.sources[name]
            return f"{file}: {key}"
    return "no file"


def _merge(readers: list[Reader]) -> tuple[dict[str, Any], str | None, int | None]:
    values: dict[str, Any] = {}
    origin: dict[str, tuple[tuple[str, str], bool]] = {}
    model, model_at, nodes = None, ("", ""), None
    for read in readers:
        for name, value in read.fields.items():
            weak = name in read.weak
            where = read.sources[name]
            if name not in values or (origin[name][1] and not weak):
                values[name], origin[name] = value, (where, weak)
            elif values[name] != value and not weak:
                (file, key), _ = origin[name]
                raise ConfigError(f"{file}: {key} sets {label(name)} {_value(values[name])} but {where[0]}: "
                                  f"{where[1]} sets {_value(value)}: make the files agree, or give "
                                  f"{OPTION_OF_FIELD.get(name, name)}")
        if read.model is not None:
            if model is not None and read.model[0] != model:
                raise ConfigError(f"{model_at[0]}: {model_at[1]} names the model {show(model, 100)} but "
                                  f"{read.model[1]}: {read.model[2]} names {show(read.model[0], 100)}")
            model, model_at = read.model[0], read.model[1:]
        nodes = read.num_nodes or nodes
    return values, model, nodes


__all__ = ["ConfigReading", "FIELD_LABELS", "FORMATS", "OPTION_OF_FIELD", "read_config"]

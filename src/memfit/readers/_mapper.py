"""What every config mapper shares (memfit.readers.formats registers the mappers): the reasons a field is left
out, the Context a mapper reads beyond its file (the DeepSpeed config it names, the load dtype), and finish(), which
lists every leaf a mapper did not read as ignored with its format table's reason."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..setup import Padding
from ._reader import NOT_RELEVANT, NOT_SIZED, OFF, Reader, _positive, _value
from .files import detect_format, display_path, flatten, load_mapping, resolve_reference

ADAPTER = f"{NOT_SIZED} (LoRA / QLoRA adapter setting)"
QUANTIZED = f"{NOT_SIZED} (quantized base weights)"
EVAL = f"{NOT_RELEVANT} (evaluation, not the training step)"
SAVING = f"{NOT_RELEVANT} (checkpoint saving, not the step)"
LOADING = f"{NOT_RELEVANT} (model loading, not the step)"
WRAPPING = f"{NOT_SIZED} (memfit sizes one FSDP unit per transformer block)"
HOST = f"{NOT_RELEVANT} (host side of the offload)"
COMPILE = f"{NOT_SIZED} (torch.compile)"


@dataclass(frozen=True)
class ConfigFile:
    """A file a reading used: given by the caller, or named by another (`via`)."""

    path: str
    format: str
    via: str = ""

    def to_dict(self) -> dict:
        return {"path": self.path, "format": self.format, "via": self.via}


@dataclass
class Context:
    """What a mapper knows beyond its file: the data-parallel size (None: not known yet), the weights' load dtype
    from a from_pretrained kwargs file ('' unknown), and where to record the files it follows."""

    path: Path
    shown: str
    world: int | None
    dtype: str = ""
    files: list[ConfigFile] = field(default_factory=list)
    referenced: set[Path] = field(default_factory=set)

    def deepspeed(self, read: Reader, value: Any, key: str) -> tuple[dict | None, str, str]:
        """The DeepSpeed config `key` names: (config, file it is in, key prefix), inline or a file resolved next to
        this one. read.deepspeed_at points the shared mapping at it."""
        if value is None or value == "" or value is False:
            if value is not None:
                read.consume(key)
            return None, "", ""
        if isinstance(value, Mapping):
            read.deepspeed_at = (read.file, read.prefix + key + ".")
            read.defer(key, "{...}", "inline DeepSpeed config")
            return dict(value), read.file, read.prefix + key + "."
        path = resolve_reference(value, self.path, self.shown, read.prefix + key)
        shown = display_path(path)
        data = load_mapping(path, shown)
        kind = detect_format(data)
        if kind != "deepspeed":
            raise ConfigError(f"{self.shown}: {read.prefix}{key}={str(value)!r}: {shown} is not a DeepSpeed config"
                              + (f" (it reads as {kind})" if kind else ""))
        self.referenced.add(path.resolve())
        if shown not in [f.path for f in self.files]:
            self.files.append(ConfigFile(shown, "deepspeed", via=f"{self.shown}: {read.prefix}{key}"))
        read.deepspeed_at = (shown, "")
        read.defer(key, value, f"reads {shown}")
        return data, shown, ""


def _lookup(table: Mapping[str, str], key: str) -> str:
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in table:
            return table[".".join(parts[:end])]
    for prefix, why in table.items():
        if prefix.endswith((".", "_")) and key.startswith(prefix):
            return why
    return NOT_RELEVANT


def finish(read: Reader, data: Mapping, table: Mapping[str, str], *, file: str | None = None,
           prefix: str = "") -> None:
    """Every leaf of `data` the mapper did not read goes to `ignored`, with the table's reason (a switch that is off
    is 'off: nothing to size')."""
    file = read.file if file is None else file
    consumed = read.consumed.get(file, set())
    with read.scope(file, ""):
        for key, value in flatten(data, prefix):
            if key in consumed:
                continue
            why = _lookup(table, key[len(prefix):]) if prefix else _lookup(table, key)
            if why.startswith(NOT_SIZED) and (value is None or value is False or value in ("", [], {})):
                why = OFF
            read.ignore(key, value, why)


def _section(read: Reader, data: Mapping, key: str, field_: str) -> Mapping:
    """The block of settings at `key` ({} when absent or empty); a value that is not a mapping is unmappable."""
    value = data.get(key)
    if isinstance(value, Mapping):
        return value
    if value not in (None, "", [], False):
        read.unmappable(field_, key, value, "not a mapping of settings")
    return {}


def _truthy(value: Any) -> bool:
    return _value(value) in (True, "true", "True", "auto") or (isinstance(value, int) and not isinstance(value, bool)
                                                               and value > 0)


def _whole(read: Reader, field_: str, data: Mapping, key: str, note: str = "") -> Any:
    value = data.get(key)
    if value is None:
        if key in data:
            read.consume(key)
        return None
    if _positive(value):
        read.set(field_, value, key, value, note)
        return value
    read.unmappable(field_, key, value, "not a positive whole number")
    return None


# ------------------------------------------------------------------------------------------------ DeepSpeed tables

DEEPSPEED_TABLE = {
    "_memfit_warning": f"{NOT_RELEVANT} (memfit's does-not-fit warning)",
    "zero_optimization.offload_optimizer.ratio": f"{NOT_SIZED} (partial offload)",
    "zero_optimization.offload_optimizer.": HOST,
    "zero_optimization.offload_param.": HOST,
    "zero_optimization.zero_quantized_weights": NOT_SIZED,
    "zero_optimization.zero_quantized_gradients": NOT_SIZED,
    "zero_optimization.zero_hpz_partition_size": NOT_SIZED,
    "zero_optimization.mics_shard_size": NOT_SIZED,
    "activation_checkpointing.": f"{NOT_SIZED} (DeepSpeed's own checkpointing API; the model's checkpointing "
                                 "switch decides)",
    "communication_data_type": NOT_SIZED,
    "data_types.": NOT_SIZED,
    "sparse_attention.": NOT_SIZED,
    "pipeline.": NOT_SIZED,
    "tensor_parallel.": NOT_SIZED,
    "compression_training.": NOT_SIZED,
}


def _finish_deepspeed(read: Reader, ds: dict | None, file: str, prefix: str) -> None:
    if ds is None:
        return
    finish(read, ds, DEEPSPEED_TABLE, file=file, prefix=prefix)


def _packing(read: Reader, data: Mapping, key: str, length: str, padded_to_max: bool = False) -> None:
    """Packed: every sequence holds `length` tokens. Unpacked, the collators pad each batch to its longest sample
    (torchtune padded_collate_sft, DataCollatorForSeq2Seq), unless told to pad to the maximum (`padded_to_max`)."""
    if key not in data:
        return
    if _truthy(data[key]) or padded_to_max:
        read.set("padding", Padding.MAX_LENGTH, key, data[key], f"every sequence holds {length} tokens" + (
            " (packed)" if _truthy(data[key]) else " (padded to it)"))
    else:
        read.set("padding", Padding.LONGEST, key, data[key], "unpacked: each batch padded to its longest sample, "
                 f"the peak is the longest sample's batch (give --longest-sample; else {length} bounds it)")


def _activation_offloading(read: Reader, data: Mapping, key: str, note: str) -> None:
    """axolotl `activation_offloading` / torchtune `enable_activation_offloading` -> activation_offload (full
    training: with LoRA adapters memfit does not size it yet)."""
    if key not in data:
        return
    finetune = read.fields.get("finetune")
    if not _truthy(data[key]):
        read.ignore(key, data[key], OFF)
    elif finetune is not None and finetune.adapters:
        read.ignore(key, data[key], f"{NOT_SIZED} (activation offloading with {finetune.method})")
    else:
        read.set("activation_offload", True, key, data[key], note)

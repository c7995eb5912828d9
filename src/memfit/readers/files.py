"""Loading a config file (JSON or YAML, refused in one line when it is not a text mapping) and telling its format
from its keys."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MissingDependencyError
from ._reader import show

FORMATS = {
    "training_args": "HF TrainingArguments",
    "deepspeed": "DeepSpeed",
    "accelerate": "accelerate config",
    "axolotl": "axolotl",
    "llamafactory": "LLaMA-Factory",
    "torchtune": "torchtune recipe",
    "from_pretrained": "from_pretrained kwargs",
    "peft": "peft LoraConfig (adapter_config.json / peft.json)",
    "memfit_apply": "memfit_apply.json (memfit.apply_)",
    "litgpt": "LitGPT finetune config",
    "lightning_cli": "LightningCLI config (trainer: block)",
}
"""Format key -> what it is called in messages."""

_ACCELERATE = frozenset({"distributed_type", "compute_environment"})
_DEEPSPEED = frozenset({"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
                        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "gradient_clipping",
                        "steps_per_print", "wall_clock_breakdown"})
_LLAMAFACTORY = frozenset({"finetuning_type", "cutoff_len", "template", "dataset_dir", "quantization_bit",
                           "lora_rank", "lora_target", "pure_bf16", "flash_attn", "stage",
                           "disable_gradient_checkpointing"})
_AXOLOTL = frozenset({"base_model", "base_model_config", "micro_batch_size", "sequence_len", "sample_packing",
                      "lora_r", "lora_target_linear", "num_epochs", "pad_to_sequence_len", "flash_attention",
                      "sdp_attention", "xformers_attention", "tokenizer_type", "adapter", "load_in_4bit"})
_TRAINING_ARGS = frozenset({
    "output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "optim", "bf16", "fp16",
    "learning_rate", "num_train_epochs", "max_steps", "gradient_checkpointing", "activation_checkpointing",
    "deepspeed", "fsdp", "fsdp_config", "logging_steps", "save_steps", "eval_strategy", "save_strategy",
    "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "report_to",
    "torch_compile", "per_device_eval_batch_size", "dataloader_num_workers", "tf32", "optim_args"})
_LITGPT = frozenset({"checkpoint_dir", "out_dir", "precision", "quantize", "devices", "num_nodes", "lora_r",
                     "lora_alpha", "lora_dropout", "lora_query", "lora_key", "lora_value", "lora_projection",
                     "lora_mlp", "lora_head", "data", "train", "eval", "log", "optimizer", "logger_name", "seed",
                     "resume", "access_token"})
"""litgpt finetune_lora / finetune_full setup() arguments (litgpt 0.5.13): memfit.readers.litgpt."""
_LITGPT_OWN = frozenset({"quantize", "lora_r", "lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp",
                         "lora_head"})
_LIGHTNING_CLI = frozenset({"trainer", "model", "data", "seed_everything", "optimizer", "lr_scheduler", "ckpt_path"})
"""A LightningCLI config's top-level keys (lightning/pytorch/cli.py: the subcommand's arguments)."""
_FROM_PRETRAINED = frozenset({"attn_implementation", "dtype", "torch_dtype", "quantization_config"})
_FROM_PRETRAINED_ALL = _FROM_PRETRAINED | {"use_cache", "low_cpu_mem_usage", "device_map", "trust_remote_code",
                                           "revision", "quantization_config", "use_safetensors", "variant"}


def yaml_module():
    try:
        import yaml
    except ImportError:
        raise MissingDependencyError("reading YAML configs needs PyYAML: pip install pyyaml") from None
    return yaml


def display_path(path: Path) -> str:
    """How a file is named in the output: relative to the current directory when under it."""
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""A config file is a few kB; anything this large is some other file."""
MAX_DEPTH = 64
"""Real configs nest a few levels; deeper is hostile (the parsers and every walk over it recurse)."""
MAX_VALUES = 20_000
"""Values a --config may hold (YAML aliases expanded): real configs hold hundreds. A "billion laughs" file (ten
lines of nested aliases) holds ~10^9, and every walk over it (the refusal quoting it too) never ends; PyYAML's
pure-Python parser reads ~10^4 values a second on a slow machine, so the bound also keeps a refusal quick."""


def read_bounded(path: Path, shown: str, error: type[Exception] = ConfigError, *,
                 limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a config file, refused (`error`, one line) when it is not a regular file (a device such as
    /dev/zero is read until memory runs out, a FIFO blocks forever) or is larger than `limit`. OSErrors (no such
    file, no permission) are the caller's to word."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise error(f"cannot read {shown}: not a regular file (a device, FIFO or socket)")
    if info.st_size > limit:
        raise error(f"{shown} is {info.st_size:,} bytes: not a config file (memfit reads up to {limit:,})")
    with open(path, "rb") as handle:
        raw = handle.read(limit + 1)  # /proc files say size 0: the cap holds whatever stat says
    if len(raw) > limit:
        raise error(f"{shown} is over {limit:,} bytes: not a config file")
    return raw


def check_shape(data: Any, shown: str, error: type[Exception] = ConfigError, *, max_depth: int = MAX_DEPTH,
                max_values: int = MAX_VALUES) -> None:
    """Refuse a loaded config nested deeper than `max_depth` or holding more than `max_values` values (aliases
    expanded). Iterative, and it stops at the first bound crossed: it never walks a whole alias bomb."""
    stack, count = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > max_values:
            raise error(f"{shown} holds more than {max_values:,} values (YAML aliases expanded): not a config file")
        if depth > max_depth:
            raise error(f"{shown} nests deeper than {max_depth} levels: not a config file")
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


def read_config_bytes(path: Path, shown: str) -> bytes:
    """read_bounded with its OSErrors worded: a missing or unreadable config file is one ConfigError line."""
    try:
        return read_bounded(path, shown)
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such file") from None
    except OSError as error:
        raise ConfigError(f"cannot read {shown}: {error.strerror or error}") from None


def load_mapping(path: Path, shown: str | None = None) -> dict:
    """The file's top-level mapping; a ConfigError naming the file when it is not a readable JSON / YAML mapping
    (or not a regular file, too large, too deep, or too many values: read_bounded, check_shape)."""
    shown = shown or str(path)
    if path.is_dir():
        raise ConfigError(f"{shown} is a directory: give the config file itself")
    raw = read_config_bytes(path, shown)
    if b"\x00" in raw:
        raise ConfigError(f"{shown} is not a text config file (binary content)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"{shown} is not a text config file (not UTF-8)") from None
    if not text.strip():
        raise ConfigError(f"{shown} is empty")
    try:
        data = _parse(text, path, shown)
    except RecursionError:  # json and PyYAML recurse once per level
        raise ConfigError(f"{shown} nests deeper than {MAX_DEPTH} levels: not a config file") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{shown} holds {type(data).__name__ if data is not None else 'nothing'} at the top, not "
                          "a mapping of settings")
    check_shape(data, shown)
    return dict(data)


def _parse(text: str, path: Path, shown: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if path.suffix.lower() == ".json" or text.lstrip()[:1] in "{[":
            raise ConfigError(f"{shown} is not valid JSON: {error.msg} at line {error.lineno}") from None
    yaml = yaml_module()
    try:
        _yaml_budget(yaml, text, shown)
        return yaml.safe_load(text)
    except yaml.YAMLError as yaml_error:
        mark = getattr(yaml_error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(yaml_error, "problem", None) or type(yaml_error).__name__
        raise ConfigError(f"{shown} is neither JSON nor YAML: {problem}{where}") from None


def _yaml_budget(yaml, text: str, shown: str) -> None:
    """Refuse YAML nested deeper than MAX_DEPTH or with more than MAX_VALUES values before it is built: PyYAML's
    pure-Python scanner is quadratic in the nesting of [ ] / { } (100,000 brackets: seconds before its
    RecursionError) and slow on long files. The events come from libyaml when PyYAML has it (C speed, and its
    syntax errors are PyYAML's, which was written after it); a YAMLError is the caller's to word."""
    depth = count = 0
    for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{shown} nests deeper than {MAX_DEPTH} levels: not a config file")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.NodeEvent):
            count += 1
            if count > MAX_VALUES:
                raise ConfigError(f"{shown} holds more than {MAX_VALUES:,} values: not a config file")


def detect_format(data: Mapping) -> str | None:
    """The config format its keys say (FORMATS), or None. Content decides, never the file name: a torchtune recipe
    has `_component_` entries, accelerate a distributed_type / compute_environment, DeepSpeed its batch / ZeRO keys or
    bf16 / fp16 blocks, a peft LoraConfig its peft_type (memfit's peft.json a lora_config), LitGPT a checkpoint_dir with its
    LoRA flags / quantize / train block (and no key LitGPT's finetune scripts lack), LLaMA-Factory and
    axolotl their own keys (checked before TrainingArguments, whose keys they
    also carry), TrainingArguments its own field names, from_pretrained kwargs only loading keys."""
    keys = {str(k) for k in data}
    if "memfit_apply" in keys:  # memfit.emit.apply_file
        return "memfit_apply"
    if "_component_" in keys or any(isinstance(v, Mapping) and "_component_" in v for v in data.values()):
        return "torchtune"
    if "peft_type" in keys or isinstance(data.get("lora_config"), Mapping):
        return "peft"
    if "checkpoint_dir" in keys and keys <= _LITGPT and (keys & _LITGPT_OWN or isinstance(data.get("train"), Mapping)):
        return "litgpt"
    if isinstance(data.get("trainer"), Mapping) and keys <= _LIGHTNING_CLI:
        return "lightning_cli"
    if keys & _ACCELERATE:
        return "accelerate"
    if keys & _DEEPSPEED or isinstance(data.get("bf16"), Mapping) or isinstance(data.get("fp16"), Mapping):
        return "deepspeed"
    if keys & _LLAMAFACTORY:
        return "llamafactory"
    if keys & _AXOLOTL:
        return "axolotl"
    if keys & _TRAINING_ARGS:
        return "training_args"
    if keys & _FROM_PRETRAINED and keys <= _FROM_PRETRAINED_ALL:
        return "from_pretrained"
    return None


def unknown_format(shown: str, data: Mapping) -> ConfigError:
    keys = ", ".join(list(map(str, data))[:5]) or "none"
    return ConfigError(f"{shown}: unknown config format (keys: {keys}): memfit reads "
                       + ", ".join(FORMATS.values()))


def resolve_reference(value: Any, base: Path, base_shown: str, key: str) -> Path:
    """A file another config names (`deepspeed: ds.json`): next to that config first, then in the current
    directory (where the HF Trainer and accelerate resolve it, and where `memfit plan --emit` names it)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{base_shown}: {key}={show(value, 120)}: not a file path or a mapping")
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [base.parent / path, Path(path)]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise ConfigError(f"{base_shown}: {key}={show(str(value), 120)}: no such file (looked next to {base.name} and in the "
                      "current directory)")


def flatten(data: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    """[(dotted key, leaf value)]; lists and empty mappings are leaves."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out

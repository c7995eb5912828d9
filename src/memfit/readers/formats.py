"""One mapper per config format: the file's memory-relevant fields -> TrainingSetup fields, through the shared
HF / DeepSpeed / FSDP mapping (memfit.readers.hf) wherever the project hands its settings to those engines. Every
field a mapper does not read is listed as ignored with the reason from the format's table."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..optimizers import config_class_names
from ..setup import Attention, Checkpointing, Engine, Loss, Optimizer, Padding, Precision
from ._reader import NOT_RELEVANT, NOT_SIZED, OFF, Reader, _positive, _value
from .files import detect_format, display_path, flatten, load_mapping, resolve_reference
from .hf import (OPTIMIZERS, PAGED, read_deepspeed_optimizer, read_fsdp, read_fsdp_plan, read_mixed_precision,
                 read_compile, read_precision, read_sharding, read_training_args, read_zero)
from . import lightning, litgpt, lora
from .float8 import axolotl_float8, torchtune_float8
from .memfit_apply import map_memfit_apply
from ..techniques.base import FRAGMENTS

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
            from ..errors import ConfigError

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


def map_deepspeed(read: Reader, data: dict, ctx: Context) -> None:
    read.deepspeed_at = (read.file, "")
    read_precision(read, None, ctx.dtype, data)
    read_sharding(read, None, data, ctx.world)
    _finish_deepspeed(read, data, read.file, "")


# ------------------------------------------------------------------------------------------ TrainingArguments

TRAINING_ARGS_TABLE = {
    "per_device_eval_batch_size": EVAL, "eval_accumulation_steps": EVAL, "bf16_full_eval": EVAL,
    "fp16_full_eval": EVAL,
    "auto_find_batch_size": f"{NOT_SIZED} (the Trainer halves the batch after an out-of-memory error)",
    "torch_compile_backend": COMPILE, "torch_compile_mode": COMPILE,
    "neftune_noise_alpha": NOT_SIZED, "torch_empty_cache_steps": NOT_SIZED,
    "gradient_checkpointing_kwargs": f"{NOT_RELEVANT} (how checkpointing recomputes, not what it keeps)",
    "activation_checkpointing_kwargs": f"{NOT_RELEVANT} (how checkpointing recomputes, not what it keeps)",
    "optim_args": f"{NOT_RELEVANT} (optimizer hyperparameters)",
    "fsdp_config.auto_wrap_policy": WRAPPING, "fsdp_config.fsdp_auto_wrap_policy": WRAPPING,
    "fsdp_config.transformer_layer_cls_to_wrap": WRAPPING, "fsdp_config.fsdp_transformer_layer_cls_to_wrap": WRAPPING,
    "fsdp_config.min_num_params": WRAPPING, "fsdp_config.state_dict_type": SAVING,
    "fsdp_config.cpu_ram_efficient_loading": LOADING, "fsdp_config.sync_module_states": LOADING,
    "fsdp_config.forward_prefetch": NOT_SIZED, "fsdp_config.backward_prefetch": NOT_SIZED,
    "fsdp_config.limit_all_gathers": NOT_SIZED,
}


def map_training_args(read: Reader, data: dict, ctx: Context) -> None:
    ds, file, prefix = ctx.deepspeed(read, data.get("deepspeed"), "deepspeed")
    read.assumed_dtype = not ctx.dtype
    read_training_args(read, data, dtype=ctx.dtype or "fp32", ds=ds, world=ctx.world)
    finish(read, data, TRAINING_ARGS_TABLE)
    _finish_deepspeed(read, ds, file, prefix)


# ------------------------------------------------------------------------------------------------- accelerate

ACCELERATE_TABLE = {
    "deepspeed_config.zero3_init_flag": LOADING, "deepspeed_config.zero3_save_16bit_model": SAVING,
    "fsdp_config.fsdp_auto_wrap_policy": WRAPPING, "fsdp_config.fsdp_transformer_layer_cls_to_wrap": WRAPPING,
    "fsdp_config.fsdp_min_num_params": WRAPPING, "fsdp_config.fsdp_state_dict_type": SAVING,
    "fsdp_config.fsdp_cpu_ram_efficient_loading": LOADING, "fsdp_config.fsdp_sync_module_states": LOADING,
    "fsdp_config.fsdp_forward_prefetch": NOT_SIZED, "fsdp_config.fsdp_backward_prefetch": NOT_SIZED,
    "fsdp_config.fsdp_use_orig_params": NOT_RELEVANT,
    "dynamo_config.": COMPILE, "fp8_config.": NOT_SIZED, "megatron_lm_config.": NOT_SIZED,
    "parallelism_config.": NOT_SIZED,
}


def map_accelerate(read: Reader, data: dict, ctx: Context) -> None:
    kind = str(_value(data.get("distributed_type", "NO"))).upper().replace("DISTRIBUTEDTYPE.", "")
    world = ctx.world
    processes = data.get("num_processes")
    machines = data.get("num_machines", 1)
    if processes is not None:
        if _positive(processes):
            read.set("num_gpus", processes, "num_processes", processes, "total ranks over all machines")
        else:
            read.unmappable("num_gpus", "num_processes", processes, "not a positive whole number")
    if "num_machines" in data:
        if not _positive(machines) or (_positive(processes) and processes % machines):
            read.unmappable("num_gpus", "num_machines", machines, f"does not divide num_processes={processes}")
        elif machines > 1 and "num_gpus" not in read.overridden:
            read.num_nodes = machines
            read.defer("num_machines", machines, f"{processes // machines} GPU(s) per node" if _positive(processes)
                       else "nodes")
        else:
            read.consume("num_machines")
    if _value(data.get("use_cpu")) is True:
        read.unmappable("num_gpus", "use_cpu", True, "trains on the CPU: memfit sizes GPU memory")
    elif "use_cpu" in data:
        read.consume("use_cpu")
    mp = data.get("mixed_precision")
    read.assumed_dtype = not ctx.dtype
    dtype = ctx.dtype or "fp32"
    if kind in ("NO", "MULTI_GPU"):
        if mp is not None:
            read_mixed_precision(read, mp, dtype)
        if kind == "MULTI_GPU" and (world is None or world >= 2):
            read.set("engine", Engine.TORCH, "distributed_type", kind, "DDP (torch)")
        else:
            read.defer("distributed_type", kind, "no sharding")
    elif kind == "DEEPSPEED":
        _accelerate_deepspeed(read, data, ctx, mp, dtype, world)
    elif kind == "FSDP":
        fsdp = _section(read, data, "fsdp_config", "sharding")
        if mp is not None:
            read_mixed_precision(read, mp, dtype)
        read.defer("distributed_type", kind, "FSDP")
        version = fsdp.get("fsdp_version", 1)
        config = {k: v for k, v in fsdp.items() if k != "fsdp_version"}
        read_fsdp(read, True, config, world, key="distributed_type", shown=kind, offload_keys=("offload_params",),
                  trainer=False, version=("fsdp_config.fsdp_version", version) if "fsdp_version" in fsdp else None)
    else:
        read.unmappable("engine", "distributed_type", kind, "memfit sizes NO, MULTI_GPU, DEEPSPEED and FSDP (GPU "
                                                            "training)")
    dynamo = data.get("dynamo_config") or {}
    if isinstance(dynamo, Mapping) and str(dynamo.get("dynamo_backend", "NO")).upper() == "NO":
        for key, _ in flatten(dynamo, "dynamo_config."):
            read.consume(key)
    finish(read, data, ACCELERATE_TABLE)


def _accelerate_deepspeed(read: Reader, data: dict, ctx: Context, mp: Any, dtype: str, world: int | None) -> None:
    section = _section(read, data, "deepspeed_config", "sharding")
    read.defer("distributed_type", "DEEPSPEED", "DeepSpeed")
    with read.scope(read.file, "deepspeed_config."):
        ds, file, prefix = ctx.deepspeed(read, section.get("deepspeed_config_file"), "deepspeed_config_file")
    if ds is not None:
        launcher = str(_value(mp)).lower() if mp is not None else None
        read_precision(read, None, dtype, ds, launcher=launcher)
        if mp is not None:
            read.defer("mixed_precision", mp, "fills the DeepSpeed config's 'auto'")
        read_sharding(read, None, ds, world)
        _finish_deepspeed(read, ds, file, prefix)
        return
    with read.scope(read.file, "deepspeed_config."):
        read_zero(read, _value(section.get("zero_stage", 0)), section.get("offload_optimizer_device", "none"),
                  section.get("offload_param_device", "none"), world,
                  keys=("zero_stage", "offload_optimizer_device", "offload_param_device"),
                  has_stage="zero_stage" in section)
        _whole(read, "grad_accum_steps", section, "gradient_accumulation_steps")
    text = str(_value(mp if mp is not None else "no")).lower()
    if text == "bf16":
        read.set("precision", Precision.BF16_MASTER, "mixed_precision", mp, "DeepSpeed bf16: fp32 master copy")
    elif text == "fp16":
        read.set("precision", Precision.AMP_FP16, "mixed_precision", mp, "DeepSpeed fp16, sized as fp16 autocast")
    elif text == "no":
        read.set("precision", Precision.FP32, "mixed_precision", mp, "DeepSpeed in fp32")
    else:
        read.unmappable("precision", "mixed_precision", mp, "memfit sizes mixed_precision no, bf16 and fp16")


# ---------------------------------------------------------------------------------------------------- axolotl

AXOLOTL_TABLE = {
    **lora.AXOLOTL_TABLE, "lora_": ADAPTER, "peft_": ADAPTER, "relora_": ADAPTER, "relora": ADAPTER,
    "load_in_4bit": QUANTIZED, "load_in_8bit": QUANTIZED, "gptq": QUANTIZED, "bnb_4bit_": QUANTIZED,
    "torch_compile_backend": COMPILE, "liger_": NOT_SIZED, "plugins": NOT_SIZED,
    "unsloth_": NOT_SIZED,
    "s2_attention": NOT_SIZED,
    "eval_batch_size": EVAL, "eval_sample_packing": EVAL,
    "gradient_checkpointing_kwargs": f"{NOT_RELEVANT} (how checkpointing recomputes, not what it keeps)",
    "fsdp_config.auto_wrap_policy": WRAPPING, "fsdp_config.fsdp_auto_wrap_policy": WRAPPING,
    "fsdp_config.transformer_layer_cls_to_wrap": WRAPPING, "fsdp_config.fsdp_transformer_layer_cls_to_wrap": WRAPPING,
    "fsdp_config.state_dict_type": SAVING, "fsdp_config.fsdp_state_dict_type": SAVING,
    "fsdp_config.cpu_ram_efficient_loading": LOADING, "fsdp_config.fsdp_cpu_ram_efficient_loading": LOADING,
    "fsdp_config.sync_module_states": LOADING, "fsdp_config.fsdp_sync_module_states": LOADING,
}
_AXOLOTL_OPTIMIZERS = {**OPTIMIZERS, "adamw_torch_8bit": None}


def map_axolotl(read: Reader, data: dict, ctx: Context) -> None:
    if data.get("base_model"):
        read.set_model(str(data["base_model"]), "base_model")
    micro = _whole(read, "micro_batch_size", data, "micro_batch_size")
    if data.get("gradient_accumulation_steps") is not None:
        _whole(read, "grad_accum_steps", data, "gradient_accumulation_steps")
    elif _positive(data.get("batch_size")) and micro:
        read.set("grad_accum_steps", max(1, data["batch_size"] // micro), "batch_size", data["batch_size"],
                 "axolotl: gradient_accumulation_steps = batch_size // micro_batch_size")
    _whole(read, "seq_len", data, "sequence_len")
    _packing(read, data, "sample_packing", "sequence_len", padded_to_max=_truthy(data.get("pad_to_sequence_len")))
    if "pad_to_sequence_len" in data and "sample_packing" in data:
        read.defer("pad_to_sequence_len", data["pad_to_sequence_len"], "read with sample_packing")
    elif "pad_to_sequence_len" in data:
        padded = _truthy(data["pad_to_sequence_len"])
        read.set("padding", Padding.MAX_LENGTH if padded else Padding.LONGEST, "pad_to_sequence_len",
                 data["pad_to_sequence_len"], "every sequence padded to sequence_len" if padded else
                 "each batch padded to its longest sample (give --longest-sample; else sequence_len bounds it)")
    ds, file, prefix = ctx.deepspeed(read, data.get("deepspeed"), "deepspeed")
    _axolotl_precision(read, data, ds)
    if ds is not None:
        read_sharding(read, {"per_device_train_batch_size": micro}, ds, ctx.world)
    elif data.get("fsdp") or data.get("fsdp_config"):
        version = ("fsdp_version", data["fsdp_version"]) if "fsdp_version" in data else None
        read_fsdp(read, data.get("fsdp") or True, data.get("fsdp_config"), ctx.world,
                  offload_keys=("offload_params", "cpu_offload"), trainer=False, version=version)
    else:
        read_sharding(read, {}, None, ctx.world)
    _hf_optimizer(read, data, "optimizer")
    _axolotl_checkpointing(read, data)
    _axolotl_attention(read, data)
    _axolotl_loss(read, data)
    if data.get("torch_compile") is not None:  # handed to the HF Trainer's torch_compile
        read_compile(read, {"torch_compile": _truthy(data["torch_compile"])})
    axolotl_float8(read, data)
    lora.axolotl_finetune(read, data)
    finish(read, data, AXOLOTL_TABLE)
    _finish_deepspeed(read, ds, file, prefix)


def _axolotl_loss(read: Reader, data: Mapping) -> None:
    """axolotl's chunked cross-entropy (the head's output upcast chunk by chunk) and its fused-loss integrations
    (Liger's fused linear cross-entropy, Apple's cut cross-entropy: the logits never whole)."""
    for key, loss, why in (("chunked_cross_entropy", Loss.CHUNKED, "the loss upcast one chunk of logits at a time"),
                           ("liger_fused_linear_cross_entropy", Loss.FUSED, "Liger: head + loss chunk by chunk"),
                           ("cut_cross_entropy", Loss.FUSED, "Apple's cut cross-entropy: no logits kept")):
        if _truthy(data.get(key)):
            read.set("loss", loss, key, data[key], why)


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


def _axolotl_precision(read: Reader, data: Mapping, ds: dict | None) -> None:
    bf16, fp16 = data.get("bf16"), data.get("fp16")
    auto = " ('auto': bf16 where the GPU has it)" if bf16 == "auto" else ""
    on_bf16 = _truthy(bf16) or _truthy(data.get("bfloat16"))
    if ds is not None:
        args = {"bf16": on_bf16, "fp16": _truthy(fp16)}
        read_precision(read, args, "bf16" if on_bf16 else "fp32", ds)
        for key in ("bf16", "fp16", "bfloat16", "float16", "tf32"):
            if key in data:
                read.consume(key)
        return
    if on_bf16:
        key = "bf16" if _truthy(bf16) else "bfloat16"
        read.set("precision", Precision.BF16, key, data[key], "axolotl loads the weights in bf16 (torch_dtype follows "
                                                              "bf16): bf16 weights, gradients and optimizer states"
                 + auto)
    elif _truthy(fp16) or _truthy(data.get("float16")):
        key = "fp16" if _truthy(fp16) else "float16"
        read.set("precision", Precision.AMP_FP16, key, data[key], "sized as fp16 autocast over fp32 weights")
    elif "bf16" in data or "fp16" in data:
        key = "bf16" if "bf16" in data else "fp16"
        read.set("precision", Precision.FP32, key, data[key], "neither bf16 nor fp16: fp32 weights")
    for key in ("bf16", "fp16", "bfloat16", "float16"):
        if key in data:
            read.consume(key)


def _hf_optimizer(read: Reader, data: Mapping, key: str) -> None:
    name = data.get(key)
    if name is None:
        return
    text = str(name).lower()
    if read.ds_optimizer:
        read.defer(key, name, "the DeepSpeed config's optimizer block is used instead")
    elif text in OPTIMIZERS:
        read.set("optimizer", OPTIMIZERS[text], key, name, PAGED if text.startswith("paged_") else "")
    else:
        read.unmappable("optimizer", key, name, f"memfit sizes {', '.join(OPTIMIZERS)} (--optimizer picks one)")


def _axolotl_checkpointing(read: Reader, data: Mapping) -> None:
    value = data.get("gradient_checkpointing")
    if value is None:
        if "gradient_checkpointing" in data:
            read.consume("gradient_checkpointing")
    elif value is True or str(value).lower() in ("true", "unsloth"):
        read.set("checkpointing", Checkpointing.FULL, "gradient_checkpointing", value)
    elif str(value).lower() == "offload":
        read.set("checkpointing", Checkpointing.FULL, "gradient_checkpointing", value)
        read.ignore("gradient_checkpointing", value, f"{NOT_SIZED}: offloading the checkpoints to the CPU (sized as "
                                                     "kept on the GPU)")
    elif value is False or str(value).lower() == "false":
        read.set("checkpointing", Checkpointing.NONE, "gradient_checkpointing", value)
    else:
        read.unmappable("checkpointing", "gradient_checkpointing", value, "memfit sizes true, false, unsloth and "
                                                                          "offload")
    _activation_offloading(read, data, "activation_offloading", "axolotl: torchtune's OffloadActivations hooks")


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


def _axolotl_attention(read: Reader, data: Mapping) -> None:
    for key in ("flash_attention", "sdp_attention", "xformers_attention", "flex_attention"):
        if _truthy(data.get(key)):
            read.set("attention", Attention.SDPA, key, data[key], "O(T) attention kernel")
            break
    else:
        if _truthy(data.get("eager_attention")):
            read.set("attention", Attention.EAGER, "eager_attention", data["eager_attention"])
    for key in ("flash_attention", "sdp_attention", "xformers_attention", "flex_attention", "eager_attention",
                "flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_mlp"):
        if key in data and not _truthy(data[key]):
            read.consume(key)


# ------------------------------------------------------------------------------------------------ LLaMA-Factory

LLAMAFACTORY_TABLE = {
    **TRAINING_ARGS_TABLE,
    **lora.LLAMAFACTORY_TABLE, "lora_": ADAPTER, "additional_target": ADAPTER, "use_dora": ADAPTER,
    "freeze_": f"{NOT_RELEVANT} (finetuning_type freeze only)", "oft_": f"{NOT_RELEVANT} (finetuning_type oft only)",
    "quantization_": QUANTIZED, "double_quantization": QUANTIZED,
    "use_unsloth": NOT_SIZED, "use_unsloth_gc": NOT_SIZED, "enable_liger_kernel": NOT_SIZED,
    "use_badam": NOT_SIZED, "badam_": NOT_SIZED, "use_galore": NOT_SIZED, "galore_": NOT_SIZED,
    "use_apollo": NOT_SIZED, "apollo_": NOT_SIZED, "use_adam_mini": NOT_SIZED, "shift_attn": NOT_SIZED,
    "upcast_layernorm": NOT_SIZED, "upcast_lmhead_output": NOT_SIZED,
}
_LF_STAGES = {"sft": "supervised fine-tuning", "pt": "pre-training"}


def map_llamafactory(read: Reader, data: dict, ctx: Context) -> None:
    if data.get("model_name_or_path"):
        read.set_model(str(data["model_name_or_path"]), "model_name_or_path")
    stage = str(data.get("stage", "sft"))
    if stage in _LF_STAGES:
        if "stage" in data:
            read.defer("stage", stage, f"{_LF_STAGES[stage]}: one training step, what memfit sizes")
    else:
        read.ignore("stage", stage, f"{NOT_SIZED}: the {stage} stage's extra models / forward passes (sized as one "
                                    "SFT step)")
    lora.llamafactory_finetune(read, data)
    _whole(read, "seq_len", data, "cutoff_len")
    for key in ("packing", "neat_packing"):
        _packing(read, data, key, "cutoff_len")
    pure = _truthy(data.get("pure_bf16"))
    read.assumed_dtype = False  # LLaMA-Factory upcasts the trainable weights to fp32 unless pure_bf16
    ds, file, prefix = ctx.deepspeed(read, data.get("deepspeed"), "deepspeed")
    read_training_args(read, data, dtype="bf16" if pure else "fp32", ds=ds, world=ctx.world)
    if "pure_bf16" in data:
        read.defer("pure_bf16", data["pure_bf16"], "bf16 weights kept as loaded" if pure else
                   "LLaMA-Factory upcasts the trainable weights to fp32")
    if "checkpointing" not in read.fields or read.sources["checkpointing"][1] != "gradient_checkpointing":
        off = _truthy(data.get("disable_gradient_checkpointing"))
        read.set("checkpointing", Checkpointing.NONE if off else Checkpointing.FULL, "disable_gradient_checkpointing",
                 data.get("disable_gradient_checkpointing"),
                 "" if off else ("absent: " if "disable_gradient_checkpointing" not in data else "")
                 + "LLaMA-Factory turns gradient checkpointing on unless this is true")
    _lf_attention(read, data)
    finish(read, data, LLAMAFACTORY_TABLE)
    _finish_deepspeed(read, ds, file, prefix)


def _lf_attention(read: Reader, data: Mapping) -> None:
    if "flash_attn" not in data:
        return
    value = str(data["flash_attn"]).lower()
    if value in ("auto", "fa2", "sdpa", "fa3"):
        read.set("attention", Attention.SDPA, "flash_attn", data["flash_attn"],
                 "FlashAttention-2 or SDPA, both O(T)" if value == "auto" else "")
    elif value in ("disabled", "eager"):
        read.set("attention", Attention.EAGER, "flash_attn", data["flash_attn"])
    else:
        read.unmappable("attention", "flash_attn", data["flash_attn"], "memfit sizes auto, fa2, sdpa and disabled")


# ----------------------------------------------------------------------------------------------------- torchtune

TORCHTUNE_TABLE = {
    "model.lora_": ADAPTER, "model.apply_lora_": ADAPTER, "model.use_dora": ADAPTER, "model.quantize_base": QUANTIZED,
    "custom_sharded_layers": WRAPPING, "tensor_parallel_": NOT_SIZED, "data_parallel_": NOT_SIZED,
    "optimizer.": f"{NOT_RELEVANT} (optimizer hyperparameters)",
    "checkpointer.": f"{NOT_RELEVANT} (where the weights are read and saved)",
    "fsdp_cpu_offload": OFF,
}
_TORCH_ADAM = ("torch.optim.adamw", "torch.optim.adam")
_TORCHTUNE_OPTIMIZERS = {path: (Optimizer(name), PAGED if Optimizer(name).is_paged else "")
                         for path, name in config_class_names().items()}
"""torchtune `_component_` class paths (lower case) memfit sizes, from memfit.optimizers (torch AdamW apart)."""


def torchtune_model(component: str) -> str | None:
    """torchtune.models.llama3_1.lora_llama3_1_8b -> 'llama3.1-8b' (a catalog alias), or None."""
    from ..sources.catalog import find_entry

    name = component.rsplit(".", 1)[-1]
    for head in ("qlora_", "lora_", "dora_"):
        if name.startswith(head):
            name = name[len(head):]
    parts = name.split("_")
    if len(parts) < 2:
        return None
    version = [p for p in parts[1:-1] if p.isdigit()]
    candidate = ".".join([parts[0], *version]) + "-" + "-".join(p for p in parts[1:] if p not in version)
    entry = find_entry(candidate)
    return entry["name"] if entry else None


def map_torchtune(read: Reader, data: dict, ctx: Context) -> None:
    model = data.get("model") if isinstance(data.get("model"), Mapping) else {}
    component = str(model.get("_component_", ""))
    if component:
        name = torchtune_model(component)
        if name:
            read.set_model(name, "model._component_", component, "the catalog model of that architecture")
        else:
            read.ignore("model._component_", component, "not a model in memfit's catalog: give MODEL")
        lora.torchtune_finetune(read, model, component)
    _whole(read, "micro_batch_size", data, "batch_size")
    _whole(read, "grad_accum_steps", data, "gradient_accumulation_steps")
    tokenizer = data.get("tokenizer") if isinstance(data.get("tokenizer"), Mapping) else {}
    if "max_seq_len" in tokenizer:
        if tokenizer["max_seq_len"] is None:
            read.ignore("tokenizer.max_seq_len", None, "no truncation: the length is the data's, give --seq")
        else:
            _whole(read, "seq_len", {"tokenizer.max_seq_len": tokenizer["max_seq_len"]}, "tokenizer.max_seq_len")
    dataset = data.get("dataset") if isinstance(data.get("dataset"), Mapping) else {}
    if "packed" in dataset:
        _packing(read, {"dataset.packed": dataset["packed"]}, "dataset.packed", "tokenizer.max_seq_len")
    _torchtune_dtype(read, data)
    _torchtune_optimizer(read, data)
    for key in ("enable_activation_checkpointing",):
        if key in data:
            on = _truthy(data[key])
            read.set("checkpointing", Checkpointing.FULL if on else Checkpointing.NONE, key, data[key])
    _activation_offloading(read, data, "enable_activation_offloading", "torchtune OffloadActivations")
    if "optimizer_in_bwd" in data:
        read.set("optimizer_in_backward", _truthy(data["optimizer_in_bwd"]), "optimizer_in_bwd",
                 data["optimizer_in_bwd"], "each parameter steps as its gradient arrives (per-parameter hooks)")
    if "compile" in data:  # torchtune training.compile_model: each layer, and the loss
        read.set("compile", _truthy(data["compile"]), "compile", data["compile"],
                 "each layer compiled, and the loss (memfit.estimate.compiled_loss: the chunked one)"
                 if _truthy(data["compile"]) else "")
    loss = data.get("loss") if isinstance(data.get("loss"), Mapping) else {}
    if "chunked" in str(loss.get("_component_", "")).lower():
        read.set("loss", Loss.CHUNKED, "loss._component_", loss["_component_"],
                 "the head's output per sequence chunk (CEWithChunkedOutputLoss)")
    _torchtune_sharding(read, data, ctx.world)
    torchtune_float8(read, data, ctx.world)
    finish(read, data, TORCHTUNE_TABLE)


def _torchtune_dtype(read: Reader, data: Mapping) -> None:
    if "dtype" not in data:
        return
    dtype = str(data["dtype"]).lower()
    if dtype in ("bf16", "bfloat16"):
        read.set("precision", Precision.BF16, "dtype", data["dtype"], "torchtune trains the weights in bf16: "
                                                                        "gradients and optimizer states bf16 too")
    elif dtype in ("fp32", "float32"):
        read.set("precision", Precision.FP32, "dtype", data["dtype"])
    elif dtype in ("fp16", "float16"):
        read.unmappable("precision", "dtype", data["dtype"], "torchtune's recipes refuse fp16 (no gradient "
                                                             "scaling): use bf16 or fp32")
    else:
        read.unmappable("precision", "dtype", data["dtype"], "memfit sizes torchtune's bf16 and fp32")


def _torchtune_optimizer(read: Reader, data: Mapping) -> None:
    optimizer = data.get("optimizer") if isinstance(data.get("optimizer"), Mapping) else {}
    component = optimizer.get("_component_")
    if component is None:
        return
    name = str(component).lower()
    if any(read_fragment(read, optimizer) for read_fragment in FRAGMENTS["torchtune.optimizer"]):
        return  # a technique module's own component (memfit.techniques.base.FRAGMENTS)
    if name in _TORCH_ADAM:
        if _truthy(optimizer.get("fused")):
            read.set("optimizer", Optimizer.ADAMW_FUSED, "optimizer.fused", optimizer["fused"])
            read.consume("optimizer._component_")
        elif optimizer.get("foreach") is False:
            read.set("optimizer", Optimizer.ADAMW, "optimizer.foreach", False)
            read.consume("optimizer._component_")
        else:
            read.set("optimizer", Optimizer.ADAMW_FOREACH, "optimizer._component_", component,
                     "foreach by default on CUDA")
    elif name in _TORCHTUNE_OPTIMIZERS:
        value, note = _TORCHTUNE_OPTIMIZERS[name]
        read.set("optimizer", value, "optimizer._component_", component, note)
        if value is Optimizer.SGD and not optimizer.get("momentum"):
            read.ignore("optimizer.momentum", optimizer.get("momentum", 0),
                        "without momentum SGD keeps no state: sized with one momentum buffer (an upper bound)")
    else:
        read.unmappable("optimizer", "optimizer._component_", component,
                        "memfit sizes torch.optim.AdamW / Adam / SGD / Adafactor, bitsandbytes' (Paged)AdamW8bit, "
                        "PagedAdamW and Lion, torchao's AdamW8bit / AdamW4bit / AdamWFp8")


def _torchtune_sharding(read: Reader, data: Mapping, world: int | None) -> None:
    """torchtune's distributed recipes shard with FSDP2 (fully_shard, reshard_after_forward True by default)."""
    keys = [k for k in ("fsdp_reshard_after_forward", "fsdp_cpu_offload") if k in data]
    if not keys and (world is None or world < 2):
        return
    key = keys[0] if keys else "fsdp_reshard_after_forward"
    reshard = data.get("fsdp_reshard_after_forward", True)
    offload = ("fsdp_cpu_offload", data["fsdp_cpu_offload"]) if _truthy(data.get("fsdp_cpu_offload")) else None
    read_fsdp_plan(read, 3 if _truthy(reshard) else 2, key, data.get(key, True), world, offload=offload)
    for name in keys:
        read.consume(name)


# ------------------------------------------------------------------------------------------- from_pretrained kwargs

FROM_PRETRAINED_TABLE = {"use_cache": f"{NOT_RELEVANT} (training keeps no K/V cache)",
                         "quantization_config.": f"{NOT_RELEVANT} (quantization details that keep the layout)",
                         "device_map": LOADING, "low_cpu_mem_usage": LOADING}
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16", "float32": "fp32", "fp32": "fp32",
           "torch.float32": "fp32", "float16": "fp16", "fp16": "fp16", "torch.float16": "fp16"}


def load_dtype(data: Mapping) -> tuple[str, str] | None:
    """(dtype, key) of a from_pretrained kwargs file: 'bf16', 'fp32', 'fp16' or 'auto'."""
    for key in ("dtype", "torch_dtype"):
        if key in data and data[key] is not None:
            text = str(data[key]).lower()
            return _DTYPES.get(text, text), key
    return None


def map_from_pretrained(read: Reader, data: dict, ctx: Context) -> None:
    found = load_dtype(data)
    if found is not None:
        dtype, key = found
        if dtype == "bf16":
            read.set("precision", Precision.BF16, key, data[key], "bf16 weights (a training file's precision settings "
                                                                  "take precedence)", weak=True)
        elif dtype == "fp32":
            read.set("precision", Precision.FP32, key, data[key], "fp32 weights", weak=True)
        elif dtype == "auto":
            read.ignore(key, data[key], "'auto' loads the checkpoint's own dtype, which this file does not say: give "
                                        "--precision")
        else:
            read.unmappable("precision", key, data[key], "memfit sizes models loaded in bfloat16 or float32")
    attn = data.get("attn_implementation")
    if attn is not None:
        text = str(attn).lower()
        if text == "eager":
            read.set("attention", Attention.EAGER, "attn_implementation", attn)
        elif text in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
            read.set("attention", Attention.SDPA, "attn_implementation", attn)
        else:
            read.unmappable("attention", "attn_implementation", attn, "memfit sizes eager, sdpa and flash_attention_2")
    if data.get("quantization_config") is not None:
        read.base_hint = lora.quantized_base(read, data["quantization_config"], "quantization_config")
    finish(read, data, FROM_PRETRAINED_TABLE)


# ------------------------------------------------------------------------------------------- peft LoraConfig

def map_peft(read: Reader, data: dict, ctx: Context) -> None:
    """peft's adapter_config.json, or the peft.json memfit writes."""
    lora.peft_finetune(read, data)
    finish(read, data, {**lora.PEFT_TABLE, **{"lora_config." + k: v for k, v in lora.PEFT_TABLE.items()}})


def map_litgpt(read: Reader, data: dict, ctx: Context) -> None:
    """LitGPT's finetune_lora / finetune_full YAML (memfit.readers.litgpt)."""
    litgpt.map_litgpt(read, data, ctx)
    finish(read, data, litgpt.TABLE)


def map_lightning_cli(read: Reader, data: dict, ctx: Context) -> None:
    """A LightningCLI config's trainer block (memfit.readers.lightning)."""
    lightning.map_lightning_cli(read, data, ctx)
    finish(read, data, lightning.CLI_TABLE)


MAPPERS: dict[str, Callable[[Reader, dict, Context], None]] = {
    "training_args": map_training_args, "deepspeed": map_deepspeed, "accelerate": map_accelerate,
    "axolotl": map_axolotl, "llamafactory": map_llamafactory, "torchtune": map_torchtune,
    "from_pretrained": map_from_pretrained, "peft": map_peft, "memfit_apply": map_memfit_apply,
    "litgpt": map_litgpt, "lightning_cli": map_lightning_cli,
}

__all__ = ["ConfigFile", "Context", "MAPPERS", "load_dtype", "read_deepspeed_optimizer", "torchtune_model"]

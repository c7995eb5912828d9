"""axolotl's config YAML: batch, length, packing, precision, DeepSpeed / FSDP, optimizer, checkpointing, attention,
loss, float8 and the LoRA / QLoRA adapter (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping

from ..setup import Attention, Checkpointing, Loss, Padding, Precision
from . import lora
from ._mapper import (ADAPTER, COMPILE, EVAL, LOADING, QUANTIZED, SAVING, WRAPPING, Context, _activation_offloading,
                      _finish_deepspeed, _packing, _truthy, _whole, finish)
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader, _positive
from .float8 import axolotl_float8
from .hf import OPTIMIZERS, PAGED, read_compile, read_fsdp, read_precision, read_sharding

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

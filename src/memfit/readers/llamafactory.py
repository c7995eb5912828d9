"""LLaMA-Factory's training YAML: its TrainingArguments (memfit.readers.hf), stage, cutoff_len, packing,
pure_bf16, its default gradient checkpointing, flash_attn and the LoRA / QLoRA adapter (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping

from ..setup import Attention, Checkpointing
from . import lora
from ._mapper import ADAPTER, QUANTIZED, Context, _finish_deepspeed, _packing, _truthy, _whole, finish
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader
from .hf import read_training_args
from .training_args import TRAINING_ARGS_TABLE

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

"""LLaMA-Factory's training YAML: its TrainingArguments (memfit.readers.hf), stage, cutoff_len, packing,
pure_bf16, its default gradient checkpointing, flash_attn and the LoRA / QLoRA adapter (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..finetune import ALL_LINEAR, BaseWeights, Finetune, Method
from ..setup import Attention, Checkpointing
from ._mapper import ADAPTER, QUANTIZED, Context, _finish_deepspeed, _packing, _truthy, _whole, finish
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader, _positive
from .hf import read_training_args
from .lora import RSLORA_NOTE, LoraParts, _on, _run
from .training_args import TRAINING_ARGS_TABLE

LORA_TABLE = {
    "loraplus_": f"{NOT_RELEVANT} (learning rates)",
    "pissa_": f"{NOT_RELEVANT} (initialisation)", "create_new_adapter": NOT_RELEVANT,
    "adapter_name_or_path": f"{NOT_RELEVANT} (starts from a saved adapter: the same adapters)",
    "quantization_device_map": f"{NOT_RELEVANT} (model loading, not the step)",
}


LLAMAFACTORY_TABLE = {
    **TRAINING_ARGS_TABLE,
    **LORA_TABLE, "lora_": ADAPTER, "additional_target": ADAPTER, "use_dora": ADAPTER,
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
    llamafactory_finetune(read, data)
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


# --------------------------------------------------------------------------------------------- the adapter

_LF_BNB = ("bnb", "bitsandbytes")


def llamafactory_finetune(read: Reader, data: Mapping) -> Finetune | None:
    """finetuning_type / lora_* / additional_target / quantization_* / use_dora -> finetune."""
    return _run(lambda: _llamafactory(read, data, LoraParts(read)))


def _llamafactory(read: Reader, data: Mapping, parts: LoraParts) -> Finetune | None:
    kind = data.get("finetuning_type")
    text = "lora" if kind is None else str(kind).lower()
    bits = data.get("quantization_bit")
    if text == "full":
        if bits is not None:
            parts.refuse("quantization_bit", bits, "LLaMA-Factory quantizes the base only for finetuning_type lora")
        read.defer("finetuning_type", kind, "full fine-tune: every weight trained")
        return None
    if text == "freeze":
        parts.refuse("finetuning_type", kind, "freeze (partial-parameter) fine-tuning is not sized: memfit sizes "
                                              "full, lora and qlora (lora with quantization_bit)")
    if text != "lora":
        parts.refuse("finetuning_type", kind, "memfit sizes finetuning_type full and lora (qlora: lora with "
                                              "quantization_bit)")
    method = Method.LORA
    if bits is not None:
        method = _llamafactory_quantized(read, data, parts, bits)
    else:
        for key in ("quantization_method", "quantization_type", "double_quantization"):
            if key in data:
                read.defer(key, data[key], "no quantization_bit: the base is not quantized")
    rank = data.get("lora_rank")
    if rank is None:
        rank = 8
        parts.default("rank", 8, "LLaMA-Factory's default")
    else:
        parts.rank(rank, "lora_rank")
    if data.get("lora_alpha") is None:
        if _positive(rank):
            parts.default("alpha", float(rank * 2), "LLaMA-Factory's default: lora_rank * 2")
    else:
        parts.alpha(data["lora_alpha"], "lora_alpha")
    if "lora_dropout" in data:
        parts.dropout(data["lora_dropout"], "lora_dropout")
    else:
        parts.default("dropout", 0.0, "LLaMA-Factory's default")
    target = data.get("lora_target")
    if target is None:
        parts.default("targets", (ALL_LINEAR,), "LLaMA-Factory's default lora_target all")
    else:
        names = parts.names(target, "lora_target", comma=True)
        if names == ("all",):
            parts.targets((ALL_LINEAR,), "lora_target", target, "every Linear but the output head")
        else:
            parts.targets(names, "lora_target", target)
    extra = data.get("additional_target")
    if extra is not None:
        parts.add("modules_to_save", parts.names(extra, "additional_target", comma=True), "additional_target",
                  extra, "trained in full beside the adapters")
    if "use_dora" in data:
        parts.flag("dora", data["use_dora"], "use_dora")
    if "use_rslora" in data:
        parts.flag("rslora", data["use_rslora"], "use_rslora", RSLORA_NOTE)
    note = "absent: LLaMA-Factory's default is lora" if kind is None else ""
    return parts.finish(method, "finetuning_type", kind, note)


def _llamafactory_quantized(read: Reader, data: Mapping, parts: LoraParts, bits: Any) -> Method:
    how = data.get("quantization_method", "bnb")
    if str(getattr(how, "value", how)).lower() not in _LF_BNB:
        parts.refuse("quantization_method", how, "memfit sizes bitsandbytes (bnb) quantization")
    if "quantization_method" in data:
        read.defer("quantization_method", how, "bitsandbytes")
    if bits == 8 and not isinstance(bits, bool):
        parts.add("base", BaseWeights.INT8, "quantization_bit", bits, "bitsandbytes LLM.int8 base")
        for key in ("quantization_type", "double_quantization"):
            if key in data:
                read.defer(key, data[key], "a 4-bit setting: the base is 8-bit")
        _llamafactory_upcast(data, parts)
        return Method.LORA
    if bits != 4 or isinstance(bits, bool):
        parts.refuse("quantization_bit", bits, "memfit sizes bitsandbytes 4- and 8-bit bases")
    kind = data.get("quantization_type")
    if kind is None:
        parts.add("base", BaseWeights.NF4, "quantization_bit", bits, "4-bit bitsandbytes; quantization_type absent: "
                                                                     "LLaMA-Factory's default nf4")
    elif str(kind).lower() in ("nf4", "fp4"):
        read.defer("quantization_bit", bits, "4-bit bitsandbytes")
        parts.add("base", BaseWeights.parse(str(kind).lower()), "quantization_type", kind)
    else:
        parts.refuse("quantization_type", kind, "bitsandbytes 4-bit types are nf4 and fp4")
    if "double_quantization" in data:
        parts.flag("double_quant", data["double_quantization"], "double_quantization")
    else:
        parts.default("double_quant", True, "LLaMA-Factory's default double_quantization true")
    _llamafactory_upcast(data, parts)
    return Method.QLORA


def _llamafactory_upcast(data: Mapping, parts: LoraParts) -> None:
    """LLaMA-Factory never calls peft's prepare_model_for_kbit_training: its own prepare_model_for_training
    (src/llamafactory/model/model_utils/checkpointing.py) upcasts only the norm weights, and only with
    upcast_layernorm (default False, hparams/model_args.py). fp32 norm weights make every norm's output, and from
    the first block on the residual stream, fp32: closest to peft's upcast, so upcast_layernorm keeps it."""
    if _on(data.get("upcast_layernorm")):
        parts.read.defer("upcast_layernorm", data["upcast_layernorm"], "fp32 norms: an fp32 residual stream, "
                         "sized as peft's upcast (the embedding and head counted in fp32 too)")
    else:
        parts.default("kbit_prep", False, "LLaMA-Factory does not call prepare_model_for_kbit_training: the "
                                          "embeddings, norms and head stay in the compute dtype")

"""axolotl's config YAML: batch, length, packing, precision, DeepSpeed / FSDP, optimizer, checkpointing, attention,
loss, float8 and the LoRA / QLoRA adapter (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..finetune import ALL_LINEAR, BaseWeights, Finetune, Method
from ..setup import Attention, Checkpointing, Loss, Padding, Precision
from ._mapper import (ADAPTER, COMPILE, EVAL, LOADING, QUANTIZED, SAVING, WRAPPING, Context, _activation_offloading,
                      _finish_deepspeed, _packing, _truthy, _whole, finish)
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader, _positive
from .float8 import axolotl_float8
from .hf import OPTIMIZERS, PAGED, read_compile, read_fsdp, read_precision, read_sharding
from .lora import HEAD, HEAD_REFUSED, RSLORA_NOTE, LoraParts, _on, _run

LORA_TABLE = {
    "lora_model_dir": f"{NOT_RELEVANT} (starts from a saved adapter: the same adapters)",
    "lora_fan_in_fan_out": NOT_RELEVANT, "loraplus_": f"{NOT_RELEVANT} (learning rates)",
    "lora_on_cpu": f"{NOT_RELEVANT} (model loading, not the step)",
    "lora_mlp_kernel": f"{NOT_SIZED} (axolotl's fused LoRA kernels save activations; sized without them)",
    "lora_qkv_kernel": f"{NOT_SIZED} (axolotl's fused LoRA kernels save activations; sized without them)",
    "lora_o_kernel": f"{NOT_SIZED} (axolotl's fused LoRA kernels save activations; sized without them)",
    "peft_init_lora_weights": f"{NOT_RELEVANT} (initialisation)",
    "peft_layers_to_transform": f"{NOT_SIZED} (adapters sized on every layer, an upper bound)",
    "peft_layers_pattern": NOT_RELEVANT, "peft_autocast_adapter_dtype": NOT_SIZED,
    "merge_lora": NOT_RELEVANT, "merge_method": NOT_RELEVANT,
    "qlora_sharded_model_loading": f"{NOT_RELEVANT} (model loading, not the step)",
    "bnb_config_kwargs.": f"{NOT_RELEVANT} (quantization details that keep the 4-bit layout)",
    "peft.loftq_config": f"{NOT_RELEVANT} (initialisation)",
    "lora_target_parameters": f"{NOT_SIZED} (adapters on expert parameters)",
}
"""axolotl's LoRA fields memfit does not size (memfit.readers.lora's reasons)."""

AXOLOTL_TABLE = {
    **LORA_TABLE, "lora_": ADAPTER, "peft_": ADAPTER, "relora_": ADAPTER, "relora": ADAPTER,
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
    axolotl_finetune(read, data)
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


# --------------------------------------------------------------------------------------------- the adapter

_AXOLOTL_DROPOUT = "axolotl's default 0.0"


AXOLOTL_NO_UPCAST = "axolotl keeps the embeddings, norms and head of a quantized base in torch_dtype"
"""axolotl src/axolotl/loaders/model.py (ModelLoader): `_prepare_model_for_quantization` calls peft's
prepare_model_for_kbit_training unless FSDP (`fsdp` / `fsdp_config`) or ZeRO-3 is on, and
`_configure_embedding_dtypes` then casts every module named "norm" and the embedding / head modules
(loaders/utils.py get_linear_embedding_layers) back to torch_dtype for any adapter, unless the config is
qlora under FSDP (where nothing was upcast): either way the residual stream stays 16-bit (only MoE routers,
`.gate`, stay fp32, and `fp32_norms` keeps norms fp32): memfit's kbit_prep False."""


def axolotl_finetune(read: Reader, data: Mapping) -> Finetune | None:
    """adapter / lora_* / load_in_* / bnb_config_kwargs / peft_use_dora -> finetune."""
    return _run(lambda: _axolotl(read, data, LoraParts(read)))


def _axolotl(read: Reader, data: Mapping, parts: LoraParts) -> Finetune | None:
    adapter, (four, four_key), (eight, eight_key) = _axolotl_quantized(read, data, parts)
    if not adapter:
        if four or eight:
            key = four_key if four else eight_key
            parts.refuse(key, True, "a quantized base trains only through an adapter: set adapter lora / qlora "
                                    "(axolotl refuses load_in_4bit / load_in_8bit for a full fine-tune)")
        if "adapter" in data:
            read.defer("adapter", adapter, "full fine-tune: every weight trained")
        return None
    kind = str(adapter).lower()
    if kind not in ("lora", "qlora"):
        parts.refuse("adapter", adapter, "memfit sizes adapter lora and qlora (or none: a full fine-tune)")
    if _on(data.get("gptq")):
        parts.refuse("gptq", data["gptq"], "a GPTQ-quantized base is not sized: memfit sizes bitsandbytes bases")
    method = Method.QLORA if kind == "qlora" else Method.LORA
    if method is Method.QLORA:
        if eight:
            parts.refuse(eight_key, True, "adapter qlora loads the base in 4 bits: axolotl refuses load_in_8bit "
                                          "with it")
        if not four:
            parts.refuse("adapter", adapter, "adapter qlora needs load_in_4bit: true (axolotl refuses it otherwise)")
        _axolotl_bnb(data, parts, four_key)
    elif four:
        parts.refuse(four_key, True, "axolotl builds its 4-bit bitsandbytes config only for adapter: qlora")
    elif eight:
        parts.add("base", BaseWeights.INT8, eight_key, True, "bitsandbytes LLM.int8 base")
    if four or eight:
        parts.default("kbit_prep", False, AXOLOTL_NO_UPCAST)
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in data and not _on(data[key]):
            read.defer(key, data[key], "not quantized in this way")
    _axolotl_adapter(read, data, parts, adapter)
    return parts.finish(method, "adapter", adapter)


def _axolotl_quantized(read: Reader, data: Mapping, parts: LoraParts) -> tuple[Any, tuple[Any, str], tuple[Any, str]]:
    """The adapter and how the base is quantized: (adapter, (4-bit, its key), (8-bit, its key)), from load_in_4bit /
    load_in_8bit or axolotl's `peft` block (backend bnb, weight_dtype nf4 / int8; nf4 makes adapter lora qlora)."""
    adapter = data.get("adapter")
    peft = data.get("peft") if isinstance(data.get("peft"), Mapping) else {}
    four, eight = _on(data.get("load_in_4bit")), _on(data.get("load_in_8bit"))
    four_key, eight_key = "load_in_4bit", "load_in_8bit"
    backend = peft.get("backend")
    if backend is not None:
        if str(backend).lower() != "bnb":
            parts.refuse("peft.backend", backend, "memfit sizes a bitsandbytes-quantized base (load_in_4bit / "
                                                  "load_in_8bit, or peft.backend bnb)")
        dtype = str(peft.get("weight_dtype") or "").lower()
        if dtype == "nf4" and "load_in_4bit" not in data:
            four, four_key = True, "peft.weight_dtype"
            adapter = "qlora" if str(adapter).lower() == "lora" else adapter
        elif dtype == "int8" and "load_in_8bit" not in data:
            eight, eight_key = True, "peft.weight_dtype"
        elif dtype not in ("nf4", "int8"):
            parts.refuse("peft.weight_dtype", peft.get("weight_dtype"), "axolotl's bnb backend takes nf4 or int8")
        read.defer("peft.backend", backend, "bitsandbytes")
    for key, value in (("load_in_4bit", four), ("load_in_8bit", eight)):
        if value is None:
            parts.refuse(key, data[key], "not true or false")
    return adapter, (four, four_key), (eight, eight_key)


def _axolotl_adapter(read: Reader, data: Mapping, parts: LoraParts, adapter: Any) -> None:
    """The adapter's rank, alpha, dropout, targets (lora_target_modules / lora_target_linear), the modules saved in
    full, DoRA and rsLoRA."""
    for key in ("lora_r", "lora_alpha"):
        if data.get(key) is None:
            parts.refuse(key, data.get(key), f"adapter {adapter} without {key}: axolotl hands peft none")
    parts.rank(data["lora_r"], "lora_r")
    parts.alpha(data["lora_alpha"], "lora_alpha")
    if data.get("lora_dropout") is not None:
        parts.dropout(data["lora_dropout"], "lora_dropout")
    else:
        parts.default("dropout", 0.0, _AXOLOTL_DROPOUT)
    modules = parts.names(data.get("lora_target_modules"), "lora_target_modules")
    linear = _on(data.get("lora_target_linear"))
    if linear is None:
        parts.refuse("lora_target_linear", data["lora_target_linear"], "not true or false")
    if linear:
        if HEAD in modules:
            parts.refuse("lora_target_modules", data["lora_target_modules"], HEAD_REFUSED)
        parts.targets((ALL_LINEAR,), "lora_target_linear", data["lora_target_linear"],
                      "every Linear but the output head")
        if modules:
            read.defer("lora_target_modules", data["lora_target_modules"], "added to the linear layers axolotl "
                                                                           "finds: inside all-linear")
    elif modules:
        parts.targets(modules, "lora_target_modules", data["lora_target_modules"])
        if "lora_target_linear" in data:
            read.defer("lora_target_linear", data["lora_target_linear"], "the listed modules only")
    else:
        parts.refuse("adapter", adapter, "neither lora_target_modules nor lora_target_linear is set: axolotl "
                                         "gives peft no target modules")
    saved = data.get("lora_modules_to_save")
    if saved is not None:
        parts.add("modules_to_save", parts.names(saved, "lora_modules_to_save"), "lora_modules_to_save", saved,
                  "trained in full beside the adapters")
    if "peft_use_dora" in data:
        parts.flag("dora", data["peft_use_dora"], "peft_use_dora")
    if "peft_use_rslora" in data:
        parts.flag("rslora", data["peft_use_rslora"], "peft_use_rslora", RSLORA_NOTE)


def _axolotl_bnb(data: Mapping, parts: LoraParts, four_key: str) -> None:
    """axolotl's QLoRA bitsandbytes config: nf4 with double quantization, bnb_config_kwargs on top."""
    kwargs = data.get("bnb_config_kwargs") if isinstance(data.get("bnb_config_kwargs"), Mapping) else {}
    kind, kind_key = None, ""
    for key, source in (("bnb_4bit_quant_type", data), ("bnb_config_kwargs.bnb_4bit_quant_type", kwargs)):
        name = key.rsplit(".", 1)[-1]
        if name in source and source[name] is not None:
            kind, kind_key = source[name], key
    if kind is None:
        parts.add("base", BaseWeights.NF4, four_key, True, "axolotl's QLoRA config: nf4")
    elif str(kind).lower() in ("nf4", "fp4"):
        parts.read.defer(four_key, True, "4-bit bitsandbytes")
        parts.add("base", BaseWeights.parse(str(kind).lower()), kind_key, kind)
    else:
        parts.refuse(kind_key, kind, "bitsandbytes 4-bit types are nf4 and fp4")
    if "bnb_4bit_use_double_quant" in kwargs:
        parts.flag("double_quant", kwargs["bnb_4bit_use_double_quant"], "bnb_config_kwargs.bnb_4bit_use_double_quant")
    else:
        parts.default("double_quant", True, "axolotl's QLoRA config")

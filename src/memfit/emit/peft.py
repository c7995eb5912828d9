"""peft and bitsandbytes settings for a LoRA / QLoRA plan: the keyword arguments of `peft.LoraConfig` and of
`transformers.BitsAndBytesConfig`, and the model-loading keywords that go with them (peft.json)."""

from __future__ import annotations

from ..estimate.fsdp2 import fsdp2_shards  # defined with the runtime it describes (the torch side reads it too)
from ..finetune import ALL_LINEAR, TORCHTUNE_ATTENTION, TORCHTUNE_MLP, BaseWeights
from ..setup import Checkpointing, TrainingSetup
from .emitted import EmittedConfig

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def lora_config_kwargs(setup: TrainingSetup) -> dict:
    """`peft.LoraConfig(**kwargs)` for the plan (task_type is yours: CAUSAL_LM for a causal LM)."""
    ft = setup.finetune
    targets: str | list[str] | None
    if ft.targets == (ALL_LINEAR,):
        targets = ALL_LINEAR
    else:
        targets = list(ft.targets) or None  # None: peft's default for the architecture, as memfit sized it
    kwargs = {"r": ft.rank, "lora_alpha": ft.alpha, "lora_dropout": ft.dropout, "target_modules": targets,
              "bias": "none"}
    if ft.modules_to_save:
        kwargs["modules_to_save"] = list(ft.modules_to_save)
    if ft.dora:
        kwargs["use_dora"] = True
    if ft.rslora:
        kwargs["use_rslora"] = True  # alpha / sqrt(r): the scale only, sized like LoRA
    return kwargs


def bnb_config_kwargs(setup: TrainingSetup) -> dict | None:
    """`transformers.BitsAndBytesConfig(**kwargs)` for a quantized base (None when the base is not quantized);
    `bnb_4bit_compute_dtype` is a dtype name, which BitsAndBytesConfig accepts."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    if base is BaseWeights.INT8:
        return {"load_in_8bit": True}
    if not base.four_bit:
        return None
    kwargs = {"load_in_4bit": True, "bnb_4bit_quant_type": base.value,
              "bnb_4bit_use_double_quant": setup.finetune.double_quant,
              "bnb_4bit_compute_dtype": _TORCH_DTYPES[setup.precision.compute_dtype]}
    if fsdp2_shards(setup):
        # FSDP-QLoRA: a bf16-typed packed weight is a float parameter FSDP2 can shard (accelerate leaves uint8
        # Params4bit out of fully_shard, replicated); memfit sized the bf16 shards (estimate.lora_sharded)
        kwargs["bnb_4bit_quant_storage"] = "bfloat16"
    return kwargs


def base_dtype(setup: TrainingSetup) -> str | None:
    """The `dtype` to load an unquantized frozen base in (None when it is quantized)."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    return None if base.quantized else _TORCH_DTYPES[base.value]


def torchtune_model_fields(setup: TrainingSetup) -> dict:
    """The `model:` fields of a torchtune LoRA / QLoRA recipe config that give the sized adapters (the builder,
    `model._component_`, is the recipe's own lora_ / qlora_ builder of the model)."""
    from ..errors import ConfigError

    ft = setup.finetune
    targets, mlp_names = set(ft.targets), set(TORCHTUNE_MLP)
    if not targets or ALL_LINEAR in targets:
        attention, mlp = list(TORCHTUNE_ATTENTION), True
    else:
        unknown = sorted(targets - set(TORCHTUNE_ATTENTION.values()) - mlp_names)
        if unknown:
            raise ConfigError(f"torchtune's LoRA builders adapt q/k/v/output projections and the MLP, not "
                              f"{', '.join(unknown)}: use --lora-recipe peft for those targets")
        if targets & mlp_names and not mlp_names <= targets:
            raise ConfigError("torchtune's apply_lora_to_mlp adapts gate_proj, up_proj and down_proj together: "
                              "target all three or none")
        attention = [tune for tune, name in TORCHTUNE_ATTENTION.items() if name in targets]
        mlp = bool(targets & mlp_names)
    return {"lora_attn_modules": attention, "apply_lora_to_mlp": mlp, "apply_lora_to_output": False,
            "lora_rank": ft.rank, "lora_alpha": ft.alpha, "lora_dropout": ft.dropout,
            "quantize_base": ft.base_storage(setup.precision.compute_dtype).quantized}


def torchtune_file(setup: TrainingSetup, *, filename: str = "torchtune_lora.yaml") -> EmittedConfig:
    content = {"model": torchtune_model_fields(setup), "dtype": setup.precision.compute_dtype,
               "enable_activation_checkpointing": setup.checkpointing.value != "none",
               "batch_size": setup.micro_batch_size, "gradient_accumulation_steps": setup.grad_accum_steps}
    comments = {"model": "merge into your recipe's model: block (keep its _component_, a lora_ / qlora_ builder)",
                "model.quantize_base": "torchao NF4 for every block Linear, as sized"}
    notes = ("torchtune keeps the adapters, embeddings, norms and head in the recipe dtype, as sized.",)
    return EmittedConfig(filename, content, comments, notes,
                         summary="the LoRA fields of a torchtune lora_finetune_single_device / _distributed "
                                 "config, as sized.")


def prepare_line(setup: TrainingSetup) -> str:
    """peft's prepare_model_for_kbit_training call for a quantized base: it turns on full gradient checkpointing
    unless told not to (use_gradient_checkpointing defaults to True), so a plan without full checkpointing says so.
    Without the k-bit preparation (kbit_prep False) the line is what the preparation would have done but the
    upcast: checkpointing and, for a frozen embedding under it, enable_input_require_grads."""
    full = setup.checkpointing is Checkpointing.FULL
    if not setup.finetune.upcasts_unquantized():
        if full:
            return ("model.gradient_checkpointing_enable(); model.enable_input_require_grads()  # no "
                    "prepare_model_for_kbit_training: embeddings, norms, head stay in the compute dtype")
        return ("# no prepare_model_for_kbit_training: embeddings, norms, head stay in the compute dtype; "
                f"checkpointing {setup.checkpointing} as planned")
    if full:
        return "model = prepare_model_for_kbit_training(model)  # the rest -> fp32"
    return ("model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # the rest -> fp32; "
            f"checkpointing {setup.checkpointing} as planned")


def peft_file(setup: TrainingSetup, *, filename: str = "peft.json") -> EmittedConfig | None:
    """peft.json: {"lora_config": LoraConfig kwargs, "model_kwargs": from_pretrained kwargs for the base,
    "prepare_model_for_kbit_training": bool}; None for a full fine-tune. Under torchtune's recipe:
    torchtune_lora.yaml (torchtune_file)."""
    if not setup.finetune.adapters:
        return None
    if setup.finetune.torchtune:
        return torchtune_file(setup)
    bnb = bnb_config_kwargs(setup)
    model_kwargs: dict = {"quantization_config": bnb} if bnb else {"dtype": base_dtype(setup)}
    prep = bnb is not None and setup.finetune.upcasts_unquantized()
    content = {"lora_config": lora_config_kwargs(setup), "model_kwargs": model_kwargs,
               "prepare_model_for_kbit_training": prep}
    comments = {
        "lora_config": "peft.LoraConfig(task_type='CAUSAL_LM', **lora_config); target_modules null = peft's "
                       "default for the architecture, which memfit sized",
        "model_kwargs": ("BitsAndBytesConfig(**quantization_config) passed to from_pretrained: the base is stored "
                         "quantized" if bnb else "the frozen base in the compute dtype"),
        "prepare_model_for_kbit_training": _prepare_comment(setup) if prep else
        ("not called, as sized: the embeddings, norms and head stay in the compute dtype"
         + ("; call model.gradient_checkpointing_enable() and model.enable_input_require_grads() instead"
            if setup.checkpointing is Checkpointing.FULL else "")),
    }
    notes = ("get_peft_model keeps the adapters in fp32 (autocast_adapter_dtype=True, its default), as sized.",)
    return EmittedConfig(filename, content, comments, notes,
                         summary="`LoraConfig(**d['lora_config'])`, `from_pretrained(name, **d['model_kwargs'])` "
                                 "(quantization_config through BitsAndBytesConfig): the adapters and the base as "
                                 "sized.")


def _prepare_comment(setup: TrainingSetup) -> str:
    return (f"`{prepare_line(setup).split(' = ', 1)[1].split('  #')[0]}` before get_peft_model: it upcasts the "
            "unquantized parameters to fp32, as memfit sized"
            + ("" if setup.checkpointing is Checkpointing.FULL else
               "; use_gradient_checkpointing=False, else peft turns on full checkpointing, which the plan does "
               "not have"))

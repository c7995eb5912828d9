"""The HF Trainer's own files: a TrainingArguments JSON / YAML (and the DeepSpeed config it names) and a DeepSpeed
JSON given alone, through the shared HF / DeepSpeed / FSDP mapping (memfit.readers.hf)."""

from __future__ import annotations

from ._mapper import COMPILE, EVAL, LOADING, SAVING, WRAPPING, Context, _finish_deepspeed, finish
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader
from .hf import read_precision, read_sharding, read_training_args

def map_deepspeed(read: Reader, data: dict, ctx: Context) -> None:
    read.deepspeed_at = (read.file, "")
    read_precision(read, None, ctx.dtype, data)
    read_sharding(read, None, data, ctx.world)
    _finish_deepspeed(read, data, read.file, "")


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


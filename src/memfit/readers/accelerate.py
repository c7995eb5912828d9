"""accelerate's config YAML (`accelerate config`): distributed_type NO / MULTI_GPU / DEEPSPEED / FSDP, the ranks,
mixed_precision, and the DeepSpeed or FSDP block, through the shared mapping (memfit.readers.hf)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..setup import Engine, Precision
from ._mapper import COMPILE, LOADING, SAVING, WRAPPING, Context, _finish_deepspeed, _section, _whole, finish
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader, _positive, _value
from .files import flatten
from .hf import read_fsdp, read_mixed_precision, read_precision, read_sharding, read_zero

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

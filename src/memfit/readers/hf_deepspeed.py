"""DeepSpeed's side of the shared mapping (memfit.readers.hf): a DeepSpeed config (dict, JSON text or file), its
precision blocks, batch sizes, ZeRO stage and offload, optimizer block and ZeRO knobs -> TrainingSetup fields."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..setup import Engine, Offload, Optimizer, Precision, Sharding
from ..zero_knobs import DEEPSPEED_DEFAULTS, ZeroKnobs
from ._reader import Reader, _get, _positive, _value

_OFFLOAD_DEVICES = ("cpu", "nvme")


def deepspeed_config(value: Any) -> dict | None:
    """A DeepSpeed config given as a dict or a path (read relative to the current directory, as the HF Trainer
    does)."""
    if value is None or value == "" or value is False:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    from .files import check_shape, read_bounded

    path = Path(str(value)).expanduser()
    shown = f"the DeepSpeed config '{value}'"
    try:
        data = json.loads(read_bounded(path, shown))
    except OSError as error:
        raise ConfigError(f"cannot read {shown}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{shown} is not JSON: {error}") from None
    except RecursionError:
        raise ConfigError(f"{shown} nests too deeply: not a DeepSpeed config") from None
    check_shape(data, shown)
    return data


def _ds_block(ds: Mapping, name: str) -> Mapping:
    block = ds.get(name)
    if block is None and name == "bf16":
        block = ds.get("bfloat16")
    return block if isinstance(block, Mapping) else {}


def _ds_flag(ds: Mapping, name: str) -> Any:
    """bf16 / fp16 `enabled`: True, False, 'auto' or None (no block)."""
    block = _ds_block(ds, name)
    if not block:
        return None
    value = _value(block.get("enabled", False))
    return value if value in (True, False, "auto") else bool(value)


def _read_deepspeed_precision(read: Reader, ds: Mapping, want_bf16: bool, want_fp16: bool, *, filled_by: str,
                              standalone: bool) -> bool:
    """Set the precision from DeepSpeed's bf16 / fp16 blocks; False when they leave it to the other settings."""
    bf16, fp16 = _ds_flag(ds, "bf16"), _ds_flag(ds, "fp16")
    bf16_key = "bfloat16.enabled" if "bf16" not in ds and "bfloat16" in ds else "bf16.enabled"
    for key, flag in ((bf16_key, bf16), ("fp16.enabled", fp16)):
        if flag is not None:
            read.consume(key)
    if bf16 is True or (bf16 == "auto" and want_bf16):
        block = _ds_block(ds, "bf16")
        auto = f"'auto' = {filled_by}; " if bf16 == "auto" else ""
        pure = block.get("bf16_master_weights_and_grads") is True and block.get("bf16_optimizer_states") is True
        if pure:
            read.set("precision", Precision.BF16, bf16_key, bf16,
                     auto + "with bf16_master_weights_and_grads and bf16_optimizer_states: no fp32 copy")
            for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
                read.consume(f"{bf16_key.split('.')[0]}.{name}")
        else:
            read.set("precision", Precision.BF16_MASTER, bf16_key, bf16,
                     auto + "DeepSpeed bf16: bf16 weights and gradients, fp32 master copy")
        return True
    if fp16 is True or (fp16 == "auto" and want_fp16):
        read.set("precision", Precision.AMP_FP16, "fp16.enabled", fp16,
                 ("'auto' = fp16; " if fp16 == "auto" else "") + "DeepSpeed fp16: fp16 weights, fp32 master copy and "
                 "loss scaling; sized as fp16 autocast, the same bytes per parameter")
        return True
    if not standalone:
        return False
    if "auto" in (bf16, fp16):
        key, flag = (bf16_key, bf16) if bf16 == "auto" else ("fp16.enabled", fp16)
        read.defer(key, flag, "'auto': the launcher fills it; the precision comes from the other file, the "
                              "command line or memfit's default")
    elif read.strict:
        read.set("precision", Precision.FP32, bf16_key, bf16,
                 "neither bf16 nor fp16 enabled: DeepSpeed trains in fp32")
    return True


def read_deepspeed_batch(read: Reader, ds: Mapping, args: Any, world: int | None) -> None:
    """train_micro_batch_size_per_gpu and gradient_accumulation_steps (ints, or 'auto' for the launcher), and the
    GPU count train_batch_size = micro x accum x GPUs implies."""
    for key, field, hf_name in (("train_micro_batch_size_per_gpu", "micro_batch_size", "per_device_train_batch_size"),
                                ("gradient_accumulation_steps", "grad_accum_steps", "gradient_accumulation_steps")):
        if key not in ds:
            continue
        value = _value(ds[key])
        if value == "auto":
            read.defer(key, value, f"'auto' = {hf_name}" if args is not None else
                       "'auto': the launcher fills it; the value comes from the other file, the command line or "
                       "memfit's default")
        elif not _positive(value):
            read.unmappable(field, key, value, "not a positive whole number or 'auto'")
        elif field in read.fields and read.fields[field] != value and \
                read.sources[field] != (read.file, read.prefix + key):
            read.unmappable(field, key, value, f"does not match {hf_name}={read.fields[field]} (the HF Trainer "
                                               "refuses the mismatch)")
        else:
            read.set(field, value, key, value)
    total = _value(ds.get("train_batch_size"))
    if total is None or not read.strict:
        return
    if total == "auto":
        read.defer("train_batch_size", total, "'auto' = micro-batch x accumulation x GPUs, filled by the launcher")
        return
    # The files' own micro-batch and accumulation (an option overriding them does not change the world they imply)
    micro = _positive(_value(ds.get("train_micro_batch_size_per_gpu"))) or _positive(
        _get(args, "per_device_train_batch_size") if args is not None else None)
    accum = _positive(_value(ds.get("gradient_accumulation_steps"))) or _positive(
        _get(args, "gradient_accumulation_steps") if args is not None else None) or 1
    if not _positive(total):
        read.unmappable("num_gpus", "train_batch_size", total, "not a positive whole number or 'auto'")
    elif not micro:
        read.ignore("train_batch_size", total, "the GPU count follows from it only with the micro-batch known")
    elif total % (micro * accum):
        read.unmappable("num_gpus", "train_batch_size", total,
                        f"not micro-batch {micro} x accumulation {accum} x a whole number of GPUs")
    elif "num_gpus" in read.fields and total != micro * accum * read.fields["num_gpus"]:
        read.unmappable("num_gpus", "train_batch_size", total,
                        f"is not micro-batch {micro} x accumulation {accum} x {read.fields['num_gpus']} GPUs "
                        f"({read.sources['num_gpus'][1]} in {read.sources['num_gpus'][0]})")
    elif world is not None and total != micro * accum * world and "num_gpus" not in read.overridden:
        read.unmappable("num_gpus", "train_batch_size", total,
                        f"is not micro-batch {micro} x accumulation {accum} x {world} GPUs (the other settings)")
    else:
        read.set("num_gpus", total // (micro * accum), "train_batch_size", total,
                 f"= micro-batch {micro} x accumulation {accum} x GPUs")


def read_zero(read: Reader, stage: Any, opt_dev: Any, par_dev: Any, world: int | None, *,
              keys: tuple[str, str, str], has_stage: bool = True) -> None:
    """ZeRO stage and offload devices (DeepSpeed's, or accelerate's deepspeed_config keys)."""
    stage_key, opt_key, par_key = keys
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        read.unmappable("sharding", stage_key, stage, "DeepSpeed has ZeRO stages 0-3", fallback="sized as stage 0")
        stage = 0
    opt_dev, par_dev = str(_value(opt_dev)).lower(), str(_value(par_dev)).lower()
    for key, device in ((opt_key, opt_dev), (par_key, par_dev)):
        if device not in ("none", "cpu", "nvme") and read.strict:
            read.unmappable("offload", key, device, "DeepSpeed offloads to none, cpu or nvme")
    opt, par = opt_dev in _OFFLOAD_DEVICES, par_dev in _OFFLOAD_DEVICES
    # one rank: a stage shards nothing, but DeepSpeed runs it all the same (world size 1: whole partitions, its fp32
    # partition copy and buckets), with offload as ZeRO-Offload / ZeRO-Infinity; memfit sizes both
    # (TrainingSetup._one_gpu_sharding_problems, memfit.estimate.static)
    if stage:
        one = world == 1 and not (opt or par)
        read.set("sharding", Sharding(f"zero{stage}"), stage_key, stage,
                 f"one GPU: DeepSpeed runs ZeRO-{stage} at world size 1, sharding nothing but keeping its fp32 "
                 "partition copy and buckets (give --gpus N / num_gpus= for the per-rank size over N)" if one else "")
        read.set("engine", Engine.DEEPSPEED, stage_key, stage, "DeepSpeed ZeRO")
    elif has_stage and read.strict:
        read.set("sharding", Sharding.NONE, stage_key, stage)
    nvme = " (nvme: sized like cpu, the GPU holds the same)"
    if par and stage == 3:
        read.set("offload", Offload.OPTIMIZER_AND_PARAMS, par_key, par_dev, nvme.strip() if par_dev == "nvme" else "")
        read.set("engine", Engine.DEEPSPEED, par_key, par_dev, "DeepSpeed ZeRO-Infinity")
        read.consume(opt_key)
        return
    if (opt or par) and stage == 0:
        for key, device, on in ((opt_key, opt_dev, opt), (par_key, par_dev, par)):
            if on:
                read.ignore(key, device, "DeepSpeed offloads only under ZeRO (stage 1 or more): stage 0 keeps it on "
                                         "the GPU")
        return
    if opt:
        read.set("offload", Offload.OPTIMIZER, opt_key, opt_dev, nvme.strip() if opt_dev == "nvme" else "")
        read.set("engine", Engine.DEEPSPEED, opt_key, opt_dev, "DeepSpeed ZeRO-Offload")
    else:
        read.consume(opt_key)
    if par:
        read.ignore(par_key, par_dev, "parameter offload needs ZeRO-3 in memfit: sized "
                                      + ("as optimizer offload" if opt else "without offload"))
    else:
        read.consume(par_key)


def read_deepspeed_optimizer(read: Reader, ds: Mapping) -> None:
    """DeepSpeed's optimizer block, which the HF Trainer and accelerate use instead of their own optimizer."""
    block = ds.get("optimizer")
    if not isinstance(block, Mapping):
        return
    kind = str(_value(block.get("type", ""))).lower()
    params = block.get("params") or {}
    if kind not in ("adam", "adamw"):
        read.unmappable("optimizer", "optimizer.type", block.get("type"),
                        "memfit sizes DeepSpeed's Adam and AdamW (or leave the block out and size another with "
                        "--optimizer)")
        return
    if read.fields.get("offload", Offload.NONE) is not Offload.NONE:
        read.defer("optimizer.type", block.get("type"), "DeepSpeedCPUAdam steps the offloaded states on the CPU: "
                                                       "every AdamW variant is sized the same there")
        return
    if params.get("torch_adam"):
        read.consume("optimizer.params.torch_adam")
        if params.get("fused"):
            value, key = Optimizer.ADAMW_FUSED, "optimizer.params.fused"
        elif params.get("foreach") is False:
            value, key = Optimizer.ADAMW, "optimizer.params.foreach"
        else:
            value = Optimizer.ADAMW_FOREACH
            key = "optimizer.params.foreach" if "foreach" in params else "optimizer.type"
        read.set("optimizer", value, key, params.get(key.rsplit(".", 1)[-1], block.get("type")),
                 "torch.optim.AdamW built by DeepSpeed")
        read.consume("optimizer.type")
    else:
        read.set("optimizer", Optimizer.ADAMW_FUSED, "optimizer.type", block.get("type"),
                 "DeepSpeed's FusedAdam: multi-tensor kernel, no parameter-sized temporaries")
    read.ds_optimizer = "optimizer" in read.fields


_KNOBS = {
    "reduce_bucket_size": ("reduce_bucket_size", (1, 2, 3)),
    "stage3_param_persistence_threshold": ("param_persistence_threshold", (3,)),
    "stage3_max_reuse_distance": ("max_reuse_distance", (3,)),
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", (3,)),
    "stage3_max_live_parameters": ("max_live_parameters", (3,)),
    "sub_group_size": ("sub_group_size", (3,)),
    "overlap_comm": ("overlap_comm", (1, 2)),
    "contiguous_gradients": ("contiguous_gradients", (1, 2, 3)),
    "allgather_bucket_size": ("allgather_bucket_size", ()),
    "round_robin_gradients": ("round_robin_gradients", ()),
    "stage3_gather_16bit_weights_on_model_save": ("gather_16bit_weights_on_model_save", ()),
}
"""DeepSpeed keys -> (memfit.zero_knobs.ZeroKnobs field, the ZeRO stages at which it changes a rank's GPU bytes)."""
_AUTO_FILLED = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
"""The knobs the HF Trainer / accelerate fill from the model's hidden size (hidden^2, 0.9 x hidden^2, 10 x hidden)."""
_NO_GPU_BYTES = {
    "allgather_bucket_size": "no GPU bytes: ZeRO-1/2 gathers the updated partitions with all_gather_into_tensor "
                             "straight into the flat 16-bit group, no bucket (DeepSpeed runtime/utils.py "
                             "all_gather_dp_groups); kept in the emitted config",
    "round_robin_gradients": "no GPU bytes: it reorders which rank owns which gradients, same sizes; kept in the "
                             "emitted config",
    "stage3_gather_16bit_weights_on_model_save": "save time only, not the step: each module's 16-bit parameters "
                                                 "gathered in turn on the GPU, the whole 16-bit model in rank 0's "
                                                 "host RAM (DeepSpeed engine.py _zero3_consolidated_16bit_state_dict)",
    "overlap_comm": "no GPU bytes at ZeRO-3: one ipg bucket either way (the switch picks the reduction stream); at "
                    "ZeRO-1/2 it doubles the reduce bucket",
    "stage3_": "a ZeRO-3 knob: nothing below stage 3",
    "sub_group_size": "no GPU bytes below ZeRO-3: ZeRO-1/2 steps each parameter group's partition whole",
    "pin_memory": "host RAM only: page-locked (the OS cannot swap it out), the same bytes either way, nothing on the "
                  "GPU",
}


def _knob_value(read: Reader, key: str, name: str, value: Any) -> tuple[bool, Any]:
    """(usable, value) of one knob: a whole number of elements or a switch, as its ZeroKnobs field takes."""
    switch = isinstance(getattr(ZeroKnobs(), _KNOBS[name][0]), bool) or name == "overlap_comm"
    if switch:
        if isinstance(value, bool):
            return True, value
        read.unmappable("zero_knobs", key, value, "not true or false")
        return False, None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and value == int(value):
        return True, int(value)
    read.unmappable("zero_knobs", key, value, "not a whole number of elements" + (
        "" if value != "auto" else " ('auto' is filled only for reduce_bucket_size, stage3_prefetch_bucket_size and "
                                   "stage3_param_persistence_threshold)"))
    return False, None


def read_zero_knobs(read: Reader, zero: Mapping) -> None:
    """DeepSpeed's ZeRO knobs (memfit.zero_knobs): a number or switch as given, "auto" as the HF Trainer fills it,
    a key left out as DeepSpeed's own default (5e8-element reduce bucket, 1e5 persistence, 1e9 reuse, 5e7
    prefetch...). A knob that changes no GPU bytes at the config's stage is recorded (and written back by memfit's
    emitted config) but listed as ignored with the reason."""
    knobs: dict[str, Any] = {}
    stage = _value(zero.get("stage", 0))
    stage3 = stage == 3
    for name, (attr, stages) in _KNOBS.items():
        key = f"zero_optimization.{name}"
        if name not in zero:  # a stage-3 knob means nothing below stage 3: left at memfit's default there
            knobs[attr] = getattr(DEEPSPEED_DEFAULTS if stage3 or not name.startswith("stage3_") else ZeroKnobs(),
                                  attr)
            continue
        value = zero[name]
        if value == "auto" and name in _AUTO_FILLED:
            knobs[attr] = getattr(ZeroKnobs(), attr)
            read.defer(key, value, "'auto': the HF Trainer / accelerate fill it from the model (hidden^2, 0.9 x "
                                   "hidden^2, 10 x hidden), as memfit sizes it")
            continue
        usable, number = _knob_value(read, key, name, value)
        if not usable:
            continue
        knobs[attr] = number
        if stage in stages:
            read.set_part("zero_knobs", attr, number, key, value)
        else:
            why = _NO_GPU_BYTES.get(name) or (_NO_GPU_BYTES["stage3_"] if name.startswith("stage3_") else
                                                _NO_GPU_BYTES.get(name, f"no GPU bytes at ZeRO-{stage}"))
            if name == "contiguous_gradients" or (name == "reduce_bucket_size" and not stage):
                why = f"no GPU bytes at ZeRO-{stage}: DeepSpeed keeps no reduce bucket without ZeRO"
            read.ignore(key, value, why)
    for block in ("offload_optimizer", "offload_param"):
        section = zero.get(block)
        if isinstance(section, Mapping) and "pin_memory" in section:
            pinned = section["pin_memory"]
            if isinstance(pinned, bool):
                knobs["offload_pin_memory"] = knobs.get("offload_pin_memory", True) and pinned
                read.ignore(f"zero_optimization.{block}.pin_memory", pinned, _NO_GPU_BYTES["pin_memory"])
            else:
                read.unmappable("zero_knobs", f"zero_optimization.{block}.pin_memory", pinned, "not true or false")
    found = ZeroKnobs(**knobs)
    if not found.is_auto:
        absent = [name for name in _KNOBS if name not in zero and (stage3 or not name.startswith("stage3_"))
                  and getattr(DEEPSPEED_DEFAULTS, _KNOBS[name][0]) != getattr(ZeroKnobs(), _KNOBS[name][0])]
        read.set("zero_knobs", found, "zero_optimization", {name: zero.get(name, "left out") for name in _KNOBS
                                                            if name in zero or name in absent},
                 note=f"{', '.join(absent)} left out: DeepSpeed's default" if absent else "")

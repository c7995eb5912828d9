"""The one mapping from HF TrainingArguments (with its DeepSpeed config and FSDP options), DeepSpeed's ZeRO and
accelerate's mixed precision to TrainingSetup fields. memfit.check reads the live objects with it
(memfit.callbacks); memfit.readers reads the same settings from files with it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..optimizers import hf_optim_names
from ..setup import Checkpointing, Engine, FsdpVersion, Loss, Offload, Optimizer, Padding, Precision, Sharding
from ..zero_knobs import DEEPSPEED_DEFAULTS, ZeroKnobs
from ._reader import NOT_SIZED, OFF, Reader, _get, _positive, _value

OPTIMIZERS = {name: Optimizer(value) for name, value in hf_optim_names().items()}
"""HF `optim` names memfit sizes. adamw_torch is foreach on CUDA (torch's default there)."""

PAGED = ("paged: the states of tensors >= 1e5 elements in CUDA unified memory, outside torch's caching allocator "
         "(sized as device memory outside the allocator)")

NOT_MODELLED = ("gradient_checkpointing_kwargs", "optim_args",
                "neftune_noise_alpha", "torch_empty_cache_steps")
"""TrainingArguments that change memory in ways the estimate does not follow, listed when set."""

_DS_READ = ("zero_optimization", "bf16", "fp16", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "train_batch_size")

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


def read_training_args(read: Reader, args: Any, *, dtype: str = "", ds: dict | None = None,
                       world: int | None = 1) -> None:
    """The TrainingSetup fields TrainingArguments (an object or its keyword arguments) set, with `ds` its DeepSpeed
    config and `dtype` ('bf16', 'fp32', 'fp16' or '') the dtype the model's weights are loaded in. `world`: the
    data-parallel size, or None when it is not known yet (sharding is then read as over several GPUs)."""
    if args is not None:
        read_batch(read, args)
    read_precision(read, args, dtype, ds)
    read_sharding(read, args, ds, world)
    if args is not None:
        read_optimizer(read, args)
        read_checkpointing(read, args)
        read_compile(read, args)
        read_liger(read, args)
        read_group_by_length(read, args)
        for name in NOT_MODELLED if not read.strict else ():  # files: every field left over is listed
            value = _get(args, name)
            if value:
                read.ignore(name, value, NOT_SIZED)


def read_liger(read: Reader, args: Any) -> None:
    """use_liger_kernel: the Trainer patches the model with Liger's kernels, whose fused linear cross-entropy
    (on by default in liger_kernel.transformers apply_liger_kernel_to_*) computes the head and the loss chunk by
    chunk: memfit's loss fused, which the emitter writes this way."""
    value = _get(args, "use_liger_kernel")
    if value:
        read.set("loss", Loss.FUSED, "use_liger_kernel", value, "Liger's fused linear cross-entropy: no B x T x V "
                                                                "logits")
    elif value is not None and read.strict:
        read.ignore("use_liger_kernel", value, OFF)


def read_group_by_length(read: Reader, args: Any) -> None:
    """group_by_length batches samples of similar length, each batch padded to its longest (the Trainer's
    LengthGroupedSampler; it only pays with dynamic padding): memfit's padding longest."""
    if _get(args, "group_by_length"):
        read.set("padding", Padding.LONGEST, "group_by_length", True, "each batch padded to its longest sample: the "
                 "peak is the longest sample's batch (give --longest-sample; else --seq bounds it)")


COMPILE_NOTE = ("the Trainer compiles the whole model; memfit sizes each block compiled and the head and loss "
                "eager (memfit.estimate.compiled)")


def read_compile(read: Reader, args: Any) -> None:
    value = _get(args, "torch_compile")
    if value:
        read.set("compile", True, "torch_compile", value, COMPILE_NOTE)
    elif value is not None and read.strict:
        read.set("compile", False, "torch_compile", value)


def read_batch(read: Reader, args: Any) -> None:
    for name, field in (("per_device_train_batch_size", "micro_batch_size"),
                        ("gradient_accumulation_steps", "grad_accum_steps")):
        value = _get(args, name)
        if _positive(value):
            read.set(field, value, name, value)
        elif value is not None and read.strict:
            read.unmappable(field, name, value, "not a positive whole number")


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


def read_precision(read: Reader, args: Any, dtype: str, ds: dict | None, *, launcher: str | None = None) -> None:
    """Precision from TrainingArguments' bf16 / fp16, the DeepSpeed config's bf16 / fp16 blocks (DeepSpeed keeps an
    fp32 master copy of bf16 weights) and the weights' dtype. `launcher`: accelerate's mixed_precision, which fills
    DeepSpeed's 'auto' when there are no TrainingArguments."""
    bf16 = bool(_get(args, "bf16")) if args is not None else False
    fp16 = bool(_get(args, "fp16")) if args is not None else False
    if ds is not None:
        file, prefix = read.deepspeed_at
        with read.scope(file or read.file, prefix):
            decided = _read_deepspeed_precision(read, ds, bf16 or launcher == "bf16", fp16 or launcher == "fp16",
                                                filled_by="bf16" if args is not None else "mixed_precision",
                                                standalone=args is None and launcher is None)
        if decided and args is not None:
            for name in ("bf16", "fp16"):
                if _get(args, name) is not None:
                    read.defer(name, _get(args, name), "the DeepSpeed config's precision decides")
        if decided or args is None:
            return
    assumed = "; the file does not say the model's load dtype: fp32 assumed" if read.assumed_dtype else ""
    if bf16:
        pure = dtype == "bf16"
        read.set("precision", Precision.BF16 if pure else Precision.AMP_BF16, "bf16", True,
                 "on bf16 weights" if pure else "autocast over fp32 weights" + assumed,
                 text="bf16=True on bf16 weights" if pure else "bf16=True on fp32 weights (autocast)")
    elif fp16:
        read.set("precision", Precision.AMP_FP16, "fp16", True, "autocast + GradScaler",
                 text="fp16=True (autocast + GradScaler)")
        if dtype == "fp16":
            read.ignore("dtype", "fp16", "fp16 weights: sized as fp16 autocast over fp32 weights")
    elif dtype == "bf16":
        given = args is not None and _get(args, "bf16") is not None
        read.set("precision", Precision.BF16, "bf16" if given else "model dtype", _get(args, "bf16") if given
                 else "bf16", "bf16 weights", text="bf16 weights")
    elif dtype == "fp32" and args is not None:
        read.set("precision", Precision.FP32, "bf16", bool(_get(args, "bf16")),
                 "fp32 weights, neither bf16 nor fp16 set" + assumed, text="fp32 weights, neither bf16 nor fp16 set")
        if _get(args, "fp16") is not None:
            read.consume("fp16")


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


def read_optimizer(read: Reader, args: Any) -> None:
    optim = _get(args, "optim")
    if optim is None:
        return
    name = str(_value(optim)).lower()
    if read.ds_optimizer:
        read.defer("optim", name, "the DeepSpeed config's optimizer block is used instead (the HF Trainer builds "
                                  "DeepSpeed's)")
        return
    if name in OPTIMIZERS:
        read.set("optimizer", OPTIMIZERS[name], "optim", name)
    else:
        read.unmappable("optimizer", "optim", name, f"memfit sizes {', '.join(OPTIMIZERS)} (--optimizer picks one)",
                        fallback="sized as the default optimizer")


def read_checkpointing(read: Reader, args: Any) -> None:
    names = ("activation_checkpointing", "gradient_checkpointing")
    for name in names:
        value = _get(args, name)
        if value:
            read.set("checkpointing", Checkpointing.FULL, name, value)
            return
    if read.strict:
        for name in names:
            if _get(args, name) is not None:
                read.set("checkpointing", Checkpointing.NONE, name, _get(args, name))


def _offload_device(read: Reader, zero: Mapping, key: str) -> Any:
    """zero_optimization.<key>.device ('none' when absent); a block that is not a mapping is unmappable."""
    block = zero.get(key) or {}
    if not isinstance(block, Mapping):
        read.unmappable("offload", f"zero_optimization.{key}", block, "not a mapping of offload settings")
        return "none"
    return block.get("device", "none")


def read_sharding(read: Reader, args: Any, ds: dict | None, world: int | None) -> None:
    """ZeRO stage, offload and optimizer from a DeepSpeed config, or FSDP from `fsdp` / `fsdp_config`."""
    if ds is not None:
        file, prefix = read.deepspeed_at
        with read.scope(file or read.file, prefix):
            read_deepspeed_batch(read, ds, args, world)
            zero = ds.get("zero_optimization") or {}
            if not isinstance(zero, Mapping):
                read.unmappable("sharding", "zero_optimization", zero, "not a mapping of ZeRO settings")
                zero = {}
            opt_dev = _offload_device(read, zero, "offload_optimizer")
            par_dev = _offload_device(read, zero, "offload_param")
            read_zero(read, _value(zero.get("stage", 0)), opt_dev, par_dev, world,
                      keys=("zero_optimization.stage", "zero_optimization.offload_optimizer.device",
                            "zero_optimization.offload_param.device"), has_stage="stage" in zero)
            read_zero_knobs(read, zero)
            read_deepspeed_optimizer(read, ds)
            if not read.strict:
                for key in ds:
                    if key not in _DS_READ:
                        read.ignore(key, ds[key], "not read", text=f"DeepSpeed '{key}': not read")
        return
    fsdp = _get(args, "fsdp") if args is not None else None
    if fsdp:
        read_fsdp(read, fsdp, _get(args, "fsdp_config"), world)
    elif read.strict and world is not None and world >= 2:
        read.set("engine", Engine.TORCH, "deepspeed", None,
                 f"neither deepspeed nor fsdp: DDP over {world} GPUs (torch)")


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


def read_fsdp(read: Reader, fsdp: Any, config: Any, world: int | None, *, key: str = "fsdp", shown: Any = None,
              offload_keys: tuple[str, ...] = ("cpu_offload",), trainer: bool = True,
              version: tuple[str, Any] | None = None) -> None:
    """FSDP from TrainingArguments' fsdp (True, or the legacy 'full_shard auto_wrap' string / list) and fsdp_config
    (keys with or without the fsdp_ prefix). `offload_keys`: the fsdp_config keys that turn CPU offload on for this
    reader (the HF Trainer reads cpu_offload; accelerate and axolotl offload_params)."""
    items = [] if fsdp is True else (fsdp.split() if isinstance(fsdp, str) else [str(_value(i)) for i in fsdp])
    items = [item.lower() for item in items]
    if shown is None:
        shown = fsdp if fsdp is True or isinstance(fsdp, str) else " ".join(items)
    cfg: dict[str, tuple[str, Any]] = {}
    if isinstance(config, Mapping):
        cfg = {(k[5:] if k.startswith("fsdp_") else k): (f"fsdp_config.{k}", v) for k, v in config.items()}
    elif config and read.strict:
        read.ignore("fsdp_config", config, f"an fsdp_config file is not read: {NOT_SIZED}")
    read.consume(key)
    base_key = key
    stage, raw = None, shown
    if "full_shard" in items or "hybrid_shard" in items:
        stage = 3
    elif "shard_grad_op" in items or "hybrid_shard_zero2" in items:
        stage = 2
    elif "no_shard" in items:
        stage = 0
    for name in ("reshard_after_forward", "sharding_strategy"):
        if name in cfg:
            key, raw = cfg[name]
            stage = _fsdp_stage(read, key, raw)
            break
    else:
        if stage is None and items:
            read.unmappable("sharding", key, shown, "no sharding strategy memfit sizes (full_shard, "
                                                    "shard_grad_op)")
            return
    if stage is None:
        if key != base_key:
            return
        stage = 3  # FSDP2 reshards after forward unless told otherwise
    offload = (base_key, shown) if "offload" in items else None
    for name in offload_keys:
        if name in cfg and _value(cfg[name][1]) in (True, "true", "True"):
            offload = cfg[name]
        elif name in cfg:
            read.consume(cfg[name][0])
    if trainer and "offload_params" in cfg:
        read.ignore(*cfg["offload_params"], "TrainingArguments reads fsdp_config cpu_offload, not offload_params: "
                                            "the Trainer does not offload with it")
    read_fsdp_plan(read, stage, key, raw, world, offload=offload, checkpointing=cfg.get("activation_checkpointing"),
                   version=version or cfg.get("version"), default_version=2 if trainer else 1)


def _fsdp_stage(read: Reader, key: str, raw: Any) -> int | None:
    value = _value(raw)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if isinstance(value, bool):
        return 3 if value else 2
    text = str(value).lower().replace("shardingstrategy.", "")
    stage = {"full_shard": 3, "hybrid_shard": 3, "1": 3, "4": 3, "shard_grad_op": 2, "hybrid_shard_zero2": 2,
             "2": 2, "5": 2, "no_shard": 0, "3": 0}.get(text)
    if stage is None:
        read.unmappable("sharding", key, raw, "memfit sizes FULL_SHARD / SHARD_GRAD_OP / NO_SHARD (or true / "
                                              "false for FSDP2)")
    return stage


def read_fsdp_plan(read: Reader, stage: int, key: str, raw: Any, world: int | None, *,
                   offload: tuple[str, Any] | None = None, checkpointing: tuple[str, Any] | None = None,
                   version: tuple[str, Any] | None = None, default_version: int = 2) -> None:
    """FSDP as memfit's torch engine: full shard -> zero3, shard_grad_op / no reshard -> zero2, as FSDP1 (flat
    parameters, memfit.estimate.fsdp1) or FSDP2. `default_version`: the FSDP the framework runs when the config
    names none (transformers 5's Trainer: 2; accelerate's FSDP plugin and axolotl: 1)."""
    fsdp1 = str(_value(version[1]) if version is not None else default_version) == "1"
    sharded = world is None or world >= 2
    if fsdp1 and stage >= 2 and sharded:
        where = version or (key, raw)
        read.set("fsdp_version", FsdpVersion.V1, where[0], where[1],
                 "FSDP1 (FullyShardedDataParallel): one flat parameter per transformer block, padded to the ranks"
                 + ("" if version is not None else "; no fsdp_version given: the framework's default"))
    elif version is not None:
        read.consume(version[0])
    if stage == 0:
        if sharded:
            read.set("engine", Engine.TORCH, key, raw, "NO_SHARD: whole parameters on every GPU, as DDP")
        else:
            read.consume(key)
    elif not sharded:
        read.ignore(key, raw, f"FSDP over {world} GPU shards nothing: sized unsharded (give the GPU count, "
                              "--gpus N / num_gpus=)", text=f"fsdp={raw!r}: over {world} GPU it shards nothing")
    else:
        read.set("sharding", Sharding(f"zero{stage}"), key, raw)
        read.set("engine", Engine.TORCH, key, raw, "FSDP1" if fsdp1 else "FSDP2")
    if offload is not None:
        if stage == 3 and sharded:
            read.set("offload", Offload.OPTIMIZER_AND_PARAMS, offload[0], offload[1], (
                "FSDP1 CPUOffload(offload_params=True): flat shards, their gradients and the step on the host"
                if fsdp1 else "FSDP2 CPUOffloadPolicy: shards, gradients and the step on the host"))
        else:
            read.ignore(offload[0], offload[1], f"FSDP CPU offload without full sharding over 2+ GPUs: {NOT_SIZED}")
    if checkpointing is not None:
        if _value(checkpointing[1]) in (True, "true", "True"):
            read.set("checkpointing", Checkpointing.FULL, checkpointing[0], checkpointing[1], "FSDP's checkpointing")
        elif read.strict:
            read.consume(checkpointing[0])


def read_mixed_precision(read: Reader, mp: Any, dtype: str, *, key: str = "mixed_precision") -> None:
    """accelerate's mixed_precision over weights of `dtype` ('' when unknown)."""
    mp = str(_value(mp)).lower()
    assumed = "; fp32 weights assumed" if read.assumed_dtype else ""
    if mp == "bf16":
        read.set("precision", Precision.BF16 if dtype == "bf16" else Precision.AMP_BF16, key, mp,
                 "on bf16 weights" if dtype == "bf16" else "autocast over fp32 weights" + assumed)
    elif mp == "fp16":
        read.set("precision", Precision.AMP_FP16, key, mp, "autocast + GradScaler")
    elif mp == "no":
        if dtype in ("bf16", "fp32"):
            read.set("precision", Precision.BF16 if dtype == "bf16" else Precision.FP32, key, mp,
                     f"on {dtype} weights" + (assumed if dtype == "fp32" else ""))
    else:
        read.unmappable("precision", key, mp, "memfit sizes mixed_precision no, bf16 and fp16",
                        fallback=NOT_SIZED)


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

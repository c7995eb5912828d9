"""The one mapping from HF TrainingArguments (with its DeepSpeed config and FSDP options), DeepSpeed's ZeRO and
accelerate's mixed precision to TrainingSetup fields. memfit.check reads the live objects with it
(memfit.callbacks); memfit.readers reads the same settings from files with it. DeepSpeed's side lives in
memfit.readers.hf_deepspeed, FSDP's in memfit.readers.hf_fsdp; this module names them all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..optimizers import hf_optim_names
from ..setup import Checkpointing, Engine, Loss, Optimizer, Padding, Precision
from ._reader import NOT_SIZED, OFF, Reader, _get, _positive, _value
from .hf_deepspeed import (_read_deepspeed_precision, deepspeed_config, read_deepspeed_batch, read_deepspeed_optimizer,
                           read_zero, read_zero_knobs)
from .hf_fsdp import read_fsdp, read_fsdp_plan

OPTIMIZERS = {name: Optimizer(value) for name, value in hf_optim_names().items()}
"""HF `optim` names memfit sizes. adamw_torch is foreach on CUDA (torch's default there)."""

PAGED = ("paged: the states of tensors >= 1e5 elements in CUDA unified memory, outside torch's caching allocator "
         "(sized as device memory outside the allocator)")

NOT_MODELLED = ("gradient_checkpointing_kwargs", "optim_args",
                "neftune_noise_alpha", "torch_empty_cache_steps")
"""TrainingArguments that change memory in ways the estimate does not follow, listed when set."""

_DS_READ = ("zero_optimization", "bf16", "fp16", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "train_batch_size")


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


__all__ = ["NOT_MODELLED", "OPTIMIZERS", "PAGED", "deepspeed_config", "read_batch", "read_checkpointing",
           "read_compile", "read_deepspeed_batch", "read_deepspeed_optimizer", "read_fsdp", "read_fsdp_plan",
           "read_group_by_length", "read_liger", "read_mixed_precision", "read_optimizer", "read_precision",
           "read_sharding", "read_training_args", "read_zero", "read_zero_knobs"]

"""Check inside training: `memfit.check(model, args)` predicts the step's peak from what the training script already
holds (a live model, HF TrainingArguments, an accelerate Accelerator), and `MemfitCallback` does it for the HF
Trainer at `on_train_begin`, then logs the measured peak next to the prediction.

Importing this module imports neither torch nor transformers: torch is read only when a CUDA device is looked up,
and `MemfitCallback` subclasses transformers' TrainerCallback when it is first used (`from memfit.callbacks import
MemfitCallback`). There is no Lightning callback: lightning is not a dependency of memfit.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from .errors import ConfigError, MemfitError
from .estimate.result import MemoryEstimate
from .hardware import GPU, Hardware, get_gpu, make_hardware
from .model_spec import ModelSpec
from .plan import Plan, PlanStep
from .setup import (Attention, Checkpointing, Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup,
                    FIELD_LABELS)
from .units import format_bytes

logger = logging.getLogger("memfit")

__all__ = ["CheckResult", "OutOfMemoryRisk", "OutOfMemoryRiskWarning", "check", "check_accelerator", "cuda_gpu",
           "setup_from_training_args"]


class OutOfMemoryRisk(MemfitError):
    """Raised by MemfitCallback(raise_on_oom_risk=True) before the first step when the prediction does not fit."""


class OutOfMemoryRiskWarning(UserWarning):
    """Warned by MemfitCallback when the prediction does not fit."""


# ---------------------------------------------------------------------------------------- reading the script's setup


@dataclass(frozen=True)
class ReadSetup:
    """TrainingSetup fields read from the training script's objects, and what was read and what was not."""

    fields: dict[str, Any]
    mapped: tuple[str, ...]
    """'per_device_train_batch_size=4 -> micro-batch 4', one per field read."""
    ignored: tuple[str, ...]
    """Settings that were seen but are not part of the estimate, and why."""


_OPTIMIZERS = {"adamw_torch": Optimizer.ADAMW_FOREACH, "adamw_torch_fused": Optimizer.ADAMW_FUSED,
               "adamw_bnb_8bit": Optimizer.ADAMW_8BIT, "adamw_8bit": Optimizer.ADAMW_8BIT,
               "paged_adamw_8bit": Optimizer.ADAMW_8BIT, "adafactor": Optimizer.ADAFACTOR, "sgd": Optimizer.SGD}
"""HF `optim` names memfit sizes. adamw_torch is foreach on CUDA (torch's default there)."""

_NOT_MODELLED = ("torch_compile", "use_liger_kernel", "gradient_checkpointing_kwargs", "optim_args",
                 "neftune_noise_alpha", "torch_empty_cache_steps")
"""TrainingArguments that change memory in ways the estimate does not follow, listed when set."""


def _get(args: Any, name: str, default: Any = None) -> Any:
    if isinstance(args, Mapping):
        return args.get(name, default)
    return getattr(args, name, default)


def _value(obj: Any) -> Any:
    return getattr(obj, "value", obj)


def _param_dtype(model: Any) -> str:
    """'bf16', 'fp16', 'fp32' or '' for the model's first floating parameter (no torch import)."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return ""
    for param in params():
        name = str(getattr(param, "dtype", "")).replace("torch.", "")
        if name in ("bfloat16", "float16", "float32"):
            return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[name]
    return ""


def _deepspeed_config(value: Any) -> dict | None:
    if value is None or value == "" or value is False:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    path = Path(str(value)).expanduser()
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read the DeepSpeed config '{value}': {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"the DeepSpeed config '{value}' is not JSON: {error}") from None


def _fsdp_options(value: Any) -> list[str]:
    if not value:
        return []
    items = value.split() if isinstance(value, str) else list(value)
    return [str(_value(item)).lower() for item in items]


class _Reader:
    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.mapped: list[str] = []
        self.ignored: list[str] = []

    def set(self, field: str, value: Any, source: str) -> None:
        self.fields[field] = value
        self.mapped.append(f"{source} -> {FIELD_LABELS[field]} {_value(value)}")

    def result(self) -> ReadSetup:
        return ReadSetup(dict(self.fields), tuple(self.mapped), tuple(self.ignored))


def setup_from_training_args(args: Any, model: Any = None, *, num_gpus: int | None = None) -> ReadSetup:
    """The TrainingSetup fields an HF `TrainingArguments` (or a dict of its keyword arguments) sets, with the
    model's own dtype, attention kernel and checkpointing switch. What cannot be mapped is listed in `ignored`."""
    read = _Reader()
    if args is not None:
        _read_batch(read, args)
    world = num_gpus or (_positive(_get(args, "world_size")) if args is not None else 0) or 1
    ds = _deepspeed_config(_get(args, "deepspeed")) if args is not None else None
    _read_precision(read, args, model, ds)
    if args is not None:
        _read_optimizer(read, args)
        _read_checkpointing(read, args)
        _read_sharding(read, args, ds, world)
        for name in _NOT_MODELLED:
            value = _get(args, name)
            if value:
                read.ignored.append(f"{name}={value!r}: not modelled")
    if "checkpointing" not in read.fields:
        _read_model_checkpointing(read, model)
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn:
        read.set("attention", Attention.EAGER if attn == "eager" else Attention.SDPA,
                 f"model.config._attn_implementation={attn!r}")
    if world > 1:
        read.set("num_gpus", world, f"world_size={world}")
    return read.result()


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _read_batch(read: _Reader, args: Any) -> None:
    for name, field in (("per_device_train_batch_size", "micro_batch_size"),
                        ("gradient_accumulation_steps", "grad_accum_steps")):
        value = _get(args, name)
        if _positive(value):
            read.set(field, value, f"{name}={value}")


def _read_precision(read: _Reader, args: Any, model: Any, ds: dict | None) -> None:
    dtype = _param_dtype(model)
    bf16 = bool(_get(args, "bf16")) if args is not None else False
    fp16 = bool(_get(args, "fp16")) if args is not None else False
    ds_bf16 = bool(ds and _value((ds.get("bf16") or {}).get("enabled")) in (True, "auto") and bf16)
    if ds_bf16 and dtype != "bf16":
        read.set("precision", Precision.BF16_MASTER, "bf16=True with DeepSpeed (fp32 master weights)")
    elif bf16:
        pure = dtype == "bf16"
        read.set("precision", Precision.BF16 if pure else Precision.AMP_BF16,
                 "bf16=True on bf16 weights" if pure else "bf16=True on fp32 weights (autocast)")
    elif fp16:
        read.set("precision", Precision.AMP_FP16, "fp16=True (autocast + GradScaler)")
        if dtype == "fp16":
            read.ignored.append("fp16 weights: sized as fp16 autocast over fp32 weights")
    elif dtype == "bf16":
        read.set("precision", Precision.BF16, "bf16 weights")
    elif dtype == "fp32" and args is not None:
        read.set("precision", Precision.FP32, "fp32 weights, neither bf16 nor fp16 set")


def _read_optimizer(read: _Reader, args: Any) -> None:
    optim = _get(args, "optim")
    if optim is None:
        return
    name = str(_value(optim)).lower()
    if name in _OPTIMIZERS:
        read.set("optimizer", _OPTIMIZERS[name], f"optim={name!r}")
    else:
        read.ignored.append(f"optim={name!r}: not sized by memfit; sized as the default optimizer")


def _read_checkpointing(read: _Reader, args: Any) -> None:
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if _get(args, name):
            read.set("checkpointing", Checkpointing.FULL, f"{name}=True")
            return


def _read_sharding(read: _Reader, args: Any, ds: dict | None, world: int) -> None:
    if ds is not None:
        zero = ds.get("zero_optimization") or {}
        stage = _value(zero.get("stage", 0))
        if not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            read.ignored.append(f"DeepSpeed zero_optimization.stage={stage!r}: not a stage 0-3")
            stage = 0
        opt_dev = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
        par_dev = str((zero.get("offload_param") or {}).get("device", "none")).lower()
        if stage and world < 2:
            read.ignored.append(f"DeepSpeed ZeRO stage {stage} over {world} GPU shards nothing: sized unsharded "
                                "(pass num_gpus= for the per-rank size of a multi-GPU run)")
        elif stage:
            read.set("sharding", Sharding(f"zero{stage}"), f"DeepSpeed zero_optimization.stage={stage}")
            read.set("engine", Engine.DEEPSPEED, "deepspeed config")
        if par_dev in ("cpu", "nvme") and stage == 3 and world >= 2:
            read.set("offload", Offload.OPTIMIZER_AND_PARAMS, f"DeepSpeed offload_param.device={par_dev!r}")
        elif opt_dev in ("cpu", "nvme"):
            read.set("offload", Offload.OPTIMIZER, f"DeepSpeed offload_optimizer.device={opt_dev!r}")
            read.fields.setdefault("engine", Engine.DEEPSPEED)
        read.ignored += [f"DeepSpeed '{key}': not read" for key in ds
                         if key not in ("zero_optimization", "bf16", "fp16", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps", "train_batch_size")]
        return
    fsdp = _fsdp_options(_get(args, "fsdp"))
    if not fsdp:
        return
    stage = 3 if "full_shard" in fsdp or "hybrid_shard" in fsdp else 2 if "shard_grad_op" in fsdp else 0
    if not stage or world < 2:
        read.ignored.append(f"fsdp={' '.join(fsdp)!r}: " + ("no sharding strategy memfit sizes" if not stage else
                                                            f"over {world} GPU it shards nothing"))
        return
    read.set("sharding", Sharding(f"zero{stage}"), f"fsdp={' '.join(fsdp)!r}")
    read.set("engine", Engine.TORCH, "fsdp (FSDP2)")
    if "offload" in fsdp and stage == 3:
        read.set("offload", Offload.OPTIMIZER_AND_PARAMS, "fsdp offload")


def setup_from_accelerator(accelerator: Any, model: Any = None) -> ReadSetup:
    """The TrainingSetup fields an accelerate `Accelerator` sets: mixed precision, accumulation, processes,
    DeepSpeed ZeRO stage and offload, FSDP sharding."""
    read = _Reader()
    world = _positive(getattr(accelerator, "num_processes", 1)) or 1
    mp = str(_value(getattr(accelerator, "mixed_precision", "no"))).lower()
    dtype = _param_dtype(model)
    if mp == "bf16":
        read.set("precision", Precision.BF16 if dtype == "bf16" else Precision.AMP_BF16, "mixed_precision='bf16'")
    elif mp == "fp16":
        read.set("precision", Precision.AMP_FP16, "mixed_precision='fp16'")
    elif mp == "no":
        if dtype in ("bf16", "fp32"):
            read.set("precision", Precision.BF16 if dtype == "bf16" else Precision.FP32,
                     f"mixed_precision='no' on {dtype} weights")
    else:
        read.ignored.append(f"mixed_precision={mp!r}: not sized by memfit")
    accum = _positive(getattr(accelerator, "gradient_accumulation_steps", 1))
    if accum:
        read.set("grad_accum_steps", accum, f"gradient_accumulation_steps={accum}")
    state = getattr(accelerator, "state", None)
    ds_plugin = getattr(state, "deepspeed_plugin", None) if state is not None else None
    fsdp_plugin = getattr(state, "fsdp_plugin", None) if state is not None else None
    if ds_plugin is not None:
        config = dict(getattr(ds_plugin, "deepspeed_config", None) or {})
        config.setdefault("zero_optimization", {"stage": getattr(ds_plugin, "zero_stage", 0)})
        _read_sharding(read, None, config, world)
    elif fsdp_plugin is not None:
        strategy = str(_value(getattr(fsdp_plugin, "sharding_strategy", "")) or "").lower()
        reshard = getattr(fsdp_plugin, "reshard_after_forward", None)
        if isinstance(reshard, bool):
            strategy = "full_shard" if reshard else "shard_grad_op"
        _read_sharding(read, {"fsdp": strategy.replace("shardingstrategy.", "")}, None, world)
    if world > 1:
        read.set("num_gpus", world, f"num_processes={world}")
    if "attention" not in read.fields:
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attn:
            read.set("attention", Attention.EAGER if attn == "eager" else Attention.SDPA,
                     f"model.config._attn_implementation={attn!r}")
    _read_model_checkpointing(read, model)
    return read.result()


def _read_model_checkpointing(read: _Reader, model: Any) -> None:
    """HF models say whether checkpointing is on (transformers 5.x: is_activation_checkpointing, whose older name
    warns when read)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            if getattr(model, name):
                read.set("checkpointing", Checkpointing.FULL, f"model.{name}")
            return


# ------------------------------------------------------------------------------------------------------- the device


def cuda_gpu(device: Any = None) -> GPU | None:
    """The CUDA device torch sees (its name and the memory it reports; bf16 and speeds from the catalog entry of
    the same name), or None without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    if device is not None and getattr(device, "type", "cuda") != "cuda":
        return None
    index = getattr(device, "index", None)
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    try:
        known = get_gpu(props.name)
    except MemfitError:
        return GPU(name=props.name, memory_bytes=int(props.total_memory), bf16=bool(torch.cuda.is_bf16_supported()),
                   source="torch.cuda.get_device_properties")
    return GPU(name=known.name, memory_bytes=int(props.total_memory), nominal=known.nominal, bf16=known.bf16,
               peak_tflops_bf16=known.peak_tflops_bf16, host_link_gb_per_s=known.host_link_gb_per_s,
               source=f"torch.cuda.get_device_properties ({props.name})", aliases=known.aliases)


def _hardware(gpu: Any, num_gpus: int, device: Any = None) -> Hardware:
    if isinstance(gpu, Hardware):
        return gpu
    if gpu is None:
        found = cuda_gpu(device)
        if found is None:
            raise ConfigError("no CUDA device here: pass gpu= (a catalog name such as 'A100-80GB', or a size such "
                              "as '24GiB') to predict for one")
        gpu = found
    per_node, nodes = (num_gpus, 1) if num_gpus <= 8 or num_gpus % 8 else (8, num_gpus // 8)
    return make_hardware(gpu, gpus_per_node=per_node, num_nodes=nodes)


# ---------------------------------------------------------------------------------------------------------- check


@dataclass(frozen=True)
class CheckResult:
    """The prediction for the run the script is about to start, and the plan that makes it fit."""

    spec: ModelSpec
    setup: TrainingSetup
    hardware: Hardware
    estimate: MemoryEstimate
    diagnosis: Diagnosis
    plan: Plan
    """memfit's plan from this setup; plan.steps[0] is the first change to make."""
    mapped: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.diagnosis.fits

    @property
    def first_change(self) -> PlanStep | None:
        return self.plan.steps[0] if self.plan.steps else None

    def headline(self) -> str:
        gpu = self.hardware.gpu.name
        count = f"{self.hardware.world_size} x " if self.hardware.world_size > 1 else ""
        return f"memfit: {self.spec.name} on {count}{gpu}: {self.diagnosis.summary()}"

    def advice(self) -> str:
        """The plan's first change, for a warning or an error ('' when the step fits)."""
        if self.fits:
            return ""
        step = self.first_change
        if step is None:
            return "nothing on memfit's ladder makes it fit: " + "; ".join(self.plan.suggestions[:2])
        tail = (f"; the plan fits after {len(self.plan.steps)} change(s): "
                + ", ".join(s.title for s in self.plan.steps) if self.plan.fits
                else "; even the whole ladder does not make it fit")
        return f"first change: {step.title}: {step.change}{tail}"

    def summary(self) -> str:
        est = self.estimate
        cats = ", ".join(f"{c.value} {format_bytes(b)}" for c, b in est.by_category().items() if b)
        lines = [self.headline(), f"  peak in {est.peak_phase}: {cats}",
                 f"  setup: micro-batch {self.setup.micro_batch_size} x seq {self.setup.seq_len}, accum "
                 f"{self.setup.grad_accum_steps}, {self.setup.precision}, {self.setup.optimizer}, checkpointing "
                 f"{self.setup.checkpointing}, {self.setup.attention}, sharding {self.setup.sharding}"]
        if not self.fits:
            lines.append("  " + self.advice())
        if self.mapped:
            lines.append("  read: " + "; ".join(self.mapped))
        if self.ignored:
            lines.append("  ignored: " + "; ".join(self.ignored))
        lines += [f"  note: {note}" for note in self.setup.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.spec.name, "gpu": self.hardware.gpu.name,
                "gpu_memory_bytes": self.hardware.gpu.memory_bytes, "world_size": self.hardware.world_size,
                "fits": self.fits, "setup": self.setup.to_dict(), "estimate": self.estimate.to_dict(),
                "diagnosis": self.diagnosis.to_dict(), "plan": self.plan.to_dict(),
                "first_change": self.first_change.to_dict() if self.first_change else None,
                "mapped": list(self.mapped), "ignored": list(self.ignored)}


_SETUP_FIELDS = frozenset(f.name for f in fields(TrainingSetup)) - {"notes"}


def check(model: Any, args: Any = None, *, gpu: str | GPU | Hardware | None = None, seq_len: int | None = None,
          batch_size: int | None = None, num_gpus: int | None = None, margin: float = DEFAULT_MARGIN,
          estimator: Any = None, accelerator: Any = None, **setup: Any) -> CheckResult:
    """Will this run fit? `model`: a live nn.Module / PreTrainedModel (or anything memfit.as_spec takes);
    `args`: HF TrainingArguments (or a dict of them); `accelerator`: an accelerate Accelerator, read instead of
    `args`. `gpu`: the device to predict for (default: the CUDA device torch sees). `seq_len` and `batch_size` (and
    any TrainingSetup field as a keyword) override what the objects say; what nobody says is a typical fine-tune's
    default, stated in `setup.notes`. The plan starts from this setup, so `result.plan.steps[0]` is the first
    change to make."""
    from .api import as_spec, typical_setup
    from .estimate.analytic import estimate
    from .plan import plan as make_plan

    unknown = sorted(set(setup) - _SETUP_FIELDS)
    if unknown:
        raise ConfigError(f"unknown setup field(s) {', '.join(unknown)}: "
                          f"choose from {', '.join(sorted(_SETUP_FIELDS))}")
    read = (setup_from_accelerator(accelerator, model) if accelerator is not None
            else setup_from_training_args(args, model, num_gpus=num_gpus))
    given = dict(read.fields)
    world = num_gpus or given.get("num_gpus", 1)
    given.update({k: v for k, v in (("seq_len", seq_len), ("micro_batch_size", batch_size)) if v is not None})
    given.update({k: v for k, v in setup.items() if v is not None})
    device = _get(args, "device") if args is not None and not isinstance(args, Mapping) else None
    hardware = _hardware(gpu, world, device)
    given.pop("num_gpus", None)
    spec = as_spec(model)
    training = typical_setup(spec, hardware, **given)
    estimator = estimator or estimate
    est = estimator(spec, training, hardware)
    diagnosis = diagnose(est, hardware, margin=margin)
    result = make_plan(spec, training, hardware, margin=margin, estimator=estimator,
                       explicit=frozenset(given) | ({"num_gpus"} if world > 1 else set()))
    return CheckResult(spec, training, hardware, est, diagnosis, result, read.mapped, read.ignored)


def check_accelerator(model: Any, accelerator: Any, **kwargs: Any) -> CheckResult:
    """`check` for an accelerate script: mixed precision, accumulation, processes and the DeepSpeed / FSDP plugin
    come from the Accelerator; give `batch_size` and `seq_len` (the dataloader's)."""
    return check(model, accelerator=accelerator, **kwargs)


# ------------------------------------------------------------------------------------------- the HF Trainer callback


_CALLBACK_CLASS: type | None = None


def _callback_class() -> type:
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is not None:
        return _CALLBACK_CLASS
    try:
        from transformers import TrainerCallback
    except ImportError:
        from .errors import MissingDependencyError

        raise MissingDependencyError("MemfitCallback needs transformers: pip install transformers") from None

    class MemfitCallback(TrainerCallback):
        """Predicts the step's peak when training begins, for the CUDA device the Trainer runs on (or `gpu=`, which
        a CPU run needs for a prediction), and warns, or raises OutOfMemoryRisk (`raise_on_oom_risk=True`), when it
        will not fit, naming the plan's first change. After `measure_at_step` steps it logs the measured CUDA peak
        next to the prediction. Both go into `state.log_history` (keys 'memfit/...') and the 'memfit' logger."""

        def __init__(self, raise_on_oom_risk: bool = False, gpu: str | GPU | Hardware | None = None, *,
                     seq_len: int | None = None, margin: float = DEFAULT_MARGIN, measure_at_step: int = 1,
                     **setup: Any) -> None:
            self.raise_on_oom_risk, self.gpu, self.seq_len, self.margin = raise_on_oom_risk, gpu, seq_len, margin
            self.measure_at_step, self.setup = measure_at_step, setup
            self.result: CheckResult | None = None
            self.measured: dict[str, Any] | None = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            device = getattr(args, "device", None)
            gpu = self.gpu if self.gpu is not None else cuda_gpu(device)
            if gpu is None:
                note = "no CUDA device and no gpu= given: prediction skipped (MemfitCallback(gpu='A100-80GB'))"
                logger.info("memfit: %s", note)
                state.log_history.append({"memfit/prediction": "skipped", "memfit/note": note,
                                          "step": state.global_step})
                return control
            result = check(model, args, gpu=gpu, seq_len=self.seq_len, margin=self.margin, **self.setup)
            self.result = result
            state.log_history.append({
                "memfit/predicted_peak_bytes": result.estimate.total_bytes,
                "memfit/predicted_tensor_bytes": result.estimate.tensor_bytes,
                "memfit/budget_bytes": result.diagnosis.budget_bytes, "memfit/fits": result.fits,
                "memfit/gpu": result.hardware.gpu.name, "step": state.global_step})
            if result.fits:
                logger.info("%s", result.headline())
                return control
            message = f"{result.headline()}; {result.advice()}"
            if self.raise_on_oom_risk:
                raise OutOfMemoryRisk(message)
            logger.warning("%s", message)
            warnings.warn(message, OutOfMemoryRiskWarning, stacklevel=2)
            return control

        def on_step_end(self, args, state, control, **kwargs):
            if self.measured is not None or state.global_step < self.measure_at_step:
                return control
            entry: dict[str, Any] = {"step": state.global_step}
            if self.result is not None:
                entry["memfit/predicted_peak_bytes"] = self.result.estimate.total_bytes
                entry["memfit/predicted_tensor_bytes"] = self.result.estimate.tensor_bytes
            device = getattr(args, "device", None)
            if cuda_gpu(device) is not None:
                import torch

                entry["memfit/measured_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
                entry["memfit/measured_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
                if self.result is not None:
                    entry["memfit/allocated_vs_predicted_tensor"] = (
                        entry["memfit/measured_allocated_bytes"] / max(1, self.result.estimate.tensor_bytes))
                logger.info("memfit: measured peak after %d steps: %s allocated, %s reserved (predicted %s)",
                            state.global_step, format_bytes(entry["memfit/measured_allocated_bytes"]),
                            format_bytes(entry["memfit/measured_reserved_bytes"]),
                            format_bytes(self.result.estimate.total_bytes) if self.result else "none")
            else:
                entry["memfit/measured"] = "skipped"
                entry["memfit/note"] = ("no CUDA device: the measured peak is skipped (memfit.measure sizes a CPU "
                                        "step from the profiler)")
                logger.info("memfit: %s", entry["memfit/note"])
            self.measured = entry
            state.log_history.append(entry)
            return control

    _CALLBACK_CLASS = MemfitCallback
    return MemfitCallback


def __getattr__(name: str) -> Any:
    if name == "MemfitCallback":
        return _callback_class()
    raise AttributeError(f"module 'memfit.callbacks' has no attribute {name!r}")

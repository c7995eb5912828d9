"""Check inside training: `memfit.check(model, args)` predicts the step's peak from what the training script already
holds (a live model, HF TrainingArguments, an accelerate Accelerator), and `MemfitCallback` does it for the HF
Trainer at `on_train_begin`, then logs the measured peak next to the prediction.

Importing this module imports neither torch nor transformers: torch is read only when a CUDA device is looked up,
and `MemfitCallback` subclasses transformers' TrainerCallback when it is first used (`from memfit.callbacks import
MemfitCallback`); `MemfitLightningCallback` subclasses lightning's Callback the same way (lightning is not a
dependency of memfit: `pip install lightning` to use it).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from .errors import ConfigError, MemfitError
from .estimate.result import MemoryEstimate
from .hardware import GPU, Hardware, get_gpu, make_hardware
from .model_spec import ModelSpec
from .plan import Plan, PlanStep
from .readers._reader import ReadSetup, Reader as _Reader, _get, _positive, _value
from .readers.hf import deepspeed_config as _deepspeed_config
from .readers.hf import read_mixed_precision, read_sharding as _read_sharding, read_training_args
from .readers.lightning import read_lightning_precision
from .setup import Attention, Checkpointing, FsdpVersion, TrainingSetup, field_names
from .units import format_bytes

logger = logging.getLogger("memfit")

__all__ = ["CheckResult", "OutOfMemoryRisk", "OutOfMemoryRiskWarning", "check", "check_accelerator", "cuda_gpu",
           "setup_from_lightning", "setup_from_training_args"]


class OutOfMemoryRisk(MemfitError):
    """Raised by MemfitCallback(raise_on_oom_risk=True) before the first step when the prediction does not fit."""


class OutOfMemoryRiskWarning(UserWarning):
    """Warned by MemfitCallback when the prediction does not fit."""


# ---------------------------------------------------------------------------------------- reading the script's setup


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


def setup_from_training_args(args: Any, model: Any = None, *, num_gpus: int | None = None) -> ReadSetup:
    """The TrainingSetup fields an HF `TrainingArguments` (or a dict of its keyword arguments) sets, with the
    model's own dtype, attention kernel and checkpointing switch. What cannot be mapped is listed in `ignored`.
    The mapping is memfit.readers' (the same one reads TrainingArguments files)."""
    read = _Reader()
    world = num_gpus or (_positive(_get(args, "world_size")) if args is not None else 0) or 1
    ds = _deepspeed_config(_get(args, "deepspeed")) if args is not None else None
    read_training_args(read, args, dtype=_param_dtype(model), ds=ds, world=world)
    if "checkpointing" not in read.fields:
        _read_model_checkpointing(read, model)
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn:
        read.set("attention", Attention.EAGER if attn == "eager" else Attention.SDPA,
                 f"model.config._attn_implementation={attn!r}")
    if world > 1:
        read.set("num_gpus", world, f"world_size={world}")
    return read.result()


def setup_from_accelerator(accelerator: Any, model: Any = None) -> ReadSetup:
    """The TrainingSetup fields an accelerate `Accelerator` sets: mixed precision, accumulation, processes,
    DeepSpeed ZeRO stage and offload, FSDP sharding."""
    read = _Reader()
    world = _positive(getattr(accelerator, "num_processes", 1)) or 1
    read_mixed_precision(read, getattr(accelerator, "mixed_precision", "no"), _param_dtype(model))
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
        version = getattr(fsdp_plugin, "fsdp_version", 1)  # accelerate's plugin: FSDP1 unless it says 2
        _read_sharding(read, {"fsdp": strategy.replace("shardingstrategy.", ""), "fsdp_config": {"version": version}},
                       None, world)
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

    known = set(field_names()) - {"notes"}  # the technique sections' fields too
    unknown = sorted(set(setup) - known)
    if unknown:
        raise ConfigError(f"unknown setup field(s) {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
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


def measured_entry(step: int, result: CheckResult | None, device: Any) -> dict[str, Any]:
    """What a callback logs after a few steps: the prediction and, on a CUDA device, the measured peaks."""
    entry: dict[str, Any] = {"step": step}
    if result is not None:
        entry["memfit/predicted_peak_bytes"] = result.estimate.total_bytes
        entry["memfit/predicted_tensor_bytes"] = result.estimate.tensor_bytes
    if cuda_gpu(device) is not None:
        import torch

        entry["memfit/measured_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        entry["memfit/measured_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return entry


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
            device = getattr(args, "device", None)
            entry = measured_entry(state.global_step, self.result, device)
            if "memfit/measured_allocated_bytes" in entry:
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


# ---------------------------------------------------------------------------------------- the Lightning callback

def setup_from_lightning(trainer: Any, model: Any = None) -> ReadSetup:
    """The TrainingSetup fields a lightning Trainer sets: precision, accumulation, devices x nodes, the DeepSpeed /
    FSDP strategy."""
    read = _Reader()
    # memfit.readers.lightning: the plugin's effect on the module (bf16-true: module.to(bf16), AdamW states bf16)
    read_lightning_precision(read, getattr(trainer, "precision", "32-true"), "Trainer.precision", _param_dtype(model))
    accum = _positive(getattr(trainer, "accumulate_grad_batches", 1))
    if accum:
        read.set("grad_accum_steps", accum, f"accumulate_grad_batches={accum}")
    world = (_positive(getattr(trainer, "num_devices", 1)) or 1) * (_positive(getattr(trainer, "num_nodes", 1)) or 1)
    strategy = type(getattr(trainer, "strategy", None)).__name__
    if strategy == "DeepSpeedStrategy":
        config = dict(getattr(trainer.strategy, "config", None) or {})
        _read_sharding(read, None, config, world)
    elif strategy in ("FSDPStrategy", "ModelParallelStrategy"):
        fsdp1 = strategy == "FSDPStrategy"  # FullyShardedDataParallel; ModelParallelStrategy runs fully_shard
        _read_sharding(read, {"fsdp": "full_shard", "fsdp_config": {"version": 1 if fsdp1 else 2}}, None, world)
        if read.fields.get("fsdp_version") is FsdpVersion.V1:  # the blocks are its units, use_orig_params=True
            read.set("fsdp_version", FsdpVersion.V1_BLOCKS, "strategy", strategy,
                     "Lightning's FSDPStrategy: FSDP1 with use_orig_params=True (memfit.estimate.fsdp1)")
    if world > 1:
        read.set("num_gpus", world, f"num_devices x num_nodes = {world}")
    _read_model_checkpointing(read, model)
    return read.result()


def _inner_model(pl_module: Any) -> Any:
    """The model a LightningModule trains: its `model` attribute when that is a module (the common wrapper of an
    HF model), else the LightningModule itself."""
    inner = getattr(pl_module, "model", None)
    return inner if callable(getattr(inner, "named_parameters", None)) else pl_module


def _batch_shape(batch: Any) -> tuple[int, int] | None:
    """(micro-batch, sequence) of a token batch: a dict with input_ids, or a tensor / tuple whose first is [B, T]."""
    tensor = batch.get("input_ids") if isinstance(batch, Mapping) else (
        batch[0] if isinstance(batch, (list, tuple)) and batch else batch)
    shape = getattr(tensor, "shape", None)
    if shape is not None and len(shape) >= 2:
        return int(shape[0]), int(shape[1])
    return None


_LIGHTNING_CLASS: type | None = None


def _lightning_class() -> type:
    global _LIGHTNING_CLASS
    if _LIGHTNING_CLASS is not None:
        return _LIGHTNING_CLASS
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            from .errors import MissingDependencyError

            raise MissingDependencyError("MemfitLightningCallback needs lightning: pip install lightning") from None

    class MemfitLightningCallback(Callback):
        """Before the first optimizer step, predicts the step's peak from the LightningModule's model, the
        Trainer (precision, accumulation, devices, strategy) and the first batch's shape, for the CUDA device the
        Trainer runs on (or `gpu=`, which a CPU run needs); warns, or raises OutOfMemoryRisk
        (`raise_on_oom_risk=True`), naming the plan's first change. After `measure_at_step` steps it logs the
        measured CUDA peak next to the prediction. Results: `self.result` (a CheckResult), `self.measured`, and
        the values logged through `pl_module.log` (keys 'memfit/...')."""

        def __init__(self, raise_on_oom_risk: bool = False, gpu: str | GPU | Hardware | None = None, *,
                     seq_len: int | None = None, batch_size: int | None = None, margin: float = DEFAULT_MARGIN,
                     measure_at_step: int = 1, **setup: Any) -> None:
            super().__init__()
            self.raise_on_oom_risk, self.gpu, self.margin, self.setup = raise_on_oom_risk, gpu, margin, setup
            self.seq_len, self.batch_size, self.measure_at_step = seq_len, batch_size, measure_at_step
            self.result: CheckResult | None = None
            self.measured: dict[str, Any] | None = None
            self._predicted = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self._predicted:
                return
            self._predicted = True
            device = getattr(pl_module, "device", None)
            gpu = self.gpu if self.gpu is not None else cuda_gpu(device)
            if gpu is None:
                logger.info("memfit: no CUDA device and no gpu= given: prediction skipped "
                            "(MemfitLightningCallback(gpu='A100-80GB'))")
                return
            model = _inner_model(pl_module)
            shape = _batch_shape(batch) or (None, None)
            batch_size, seq_len = self.batch_size or shape[0], self.seq_len or shape[1]
            read = setup_from_lightning(trainer, model)
            given = {**read.fields, **{k: v for k, v in self.setup.items() if v is not None}}
            world = given.pop("num_gpus", 1)
            result = check(model, None, gpu=gpu, seq_len=seq_len, batch_size=batch_size, margin=self.margin,
                           num_gpus=world if world > 1 else None, **given)
            self.result = result
            if result.fits:
                logger.info("%s", result.headline())
                return
            message = f"{result.headline()}; {result.advice()}"
            if self.raise_on_oom_risk:
                raise OutOfMemoryRisk(message)
            logger.warning("%s", message)
            warnings.warn(message, OutOfMemoryRiskWarning, stacklevel=2)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.measured is not None or trainer.global_step < self.measure_at_step:
                return
            entry = measured_entry(trainer.global_step, self.result, getattr(pl_module, "device", None))
            if "memfit/measured_allocated_bytes" not in entry:
                entry["memfit/measured"] = "skipped: no CUDA device (memfit.measure sizes a CPU step)"
            self.measured = entry
            for key, value in entry.items():
                if key.startswith("memfit/") and isinstance(value, (int, float)):
                    pl_module.log(key, float(value), on_step=True, logger=True)
            logger.info("memfit: %s", entry)

    _LIGHTNING_CLASS = MemfitLightningCallback
    return MemfitLightningCallback


def __getattr__(name: str) -> Any:
    if name == "MemfitCallback":
        return _callback_class()
    if name == "MemfitLightningCallback":
        return _lightning_class()
    raise AttributeError(f"module 'memfit.callbacks' has no attribute {name!r}")

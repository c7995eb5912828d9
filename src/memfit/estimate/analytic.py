"""The analytic estimator: formulas, microseconds, no torch.

A training step has a few moments where live memory can peak (memfit.estimate.moments). Each is built as a list of
named terms (memfit.estimate.terms) on the step's model (memfit.estimate.step_model); the largest total is the step's
peak and its terms are the breakdown:

- loss backward: everything forward saved + the logits the output keeps + log-softmax + its two gradients
  (memfit.estimate.loss_moments);
- first layer backward (or, with checkpointing, the recomputed layer): activations + one layer's backward temporaries;
- end of backward: all gradients allocated (memfit.estimate.backward_moments);
- optimizer step: parameters + gradients + states + the step's temporaries.

What float8, ring attention and DeepSpeed ZeRO-3 add to these moments are typed changes (StepChange), applied in one
place (`_apply_techniques`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any
from collections import OrderedDict

from ..errors import ConfigError
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Checkpointing, Engine, Loss, Precision, Sharding, TrainingSetup, fsdp2_mixed_precision
from . import activations as act
from . import (bnb_cpu, compiled, context_parallel, deepspeed_zero3, dora, fits, float8, heads, lora, moe,
               padding, pipeline, tensor_parallel)
from .backward_moments import (embedding_gradient, end_of_backward, first_block_backward, flat_gradient,
                               in_backward_moments, root_reduce, second_block_backward)
from .device import runtime_overhead_terms
from .forward_terms import CPU_RNG_STATE_BYTES, activation_terms, linear_weight_parts
from .loss_moments import final_norm_backward, loss_backward, loss_forward
from .moments import MomentKey, StepMoments
from .notes import rule_of_thumb_notes
from .result import MemoryEstimate, Phase, Term
from .static import ShardedStatic, full_static, shard
from .step_model import StepModel


def estimate(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *,
             layout: Engine | None = None) -> MemoryEstimate:
    """Per-device peak memory of one training step of `spec` under `setup` on `hardware`.

    `layout` sizes static memory as another engine lays it out (default: `setup.engine`). memfit.verify uses it
    to compare a trace, which always runs torch's FSDP2, with the formulas on the same layout."""
    step = _kept_step(spec, setup, hardware.world_size, hardware.is_cpu, layout)
    if step is None:  # one estimate per pipeline rank's stages; the highest is the job's (memfit.estimate.pipeline)
        spec, asked, setup, sized, run_notes = _prepared(spec, setup, hardware.world_size, layout)
        pipeline.check(spec, setup)
        return pipeline.estimate(spec, asked, sized, hardware, run_notes + context_parallel.notes(asked))
    terms = list(step.terms)
    terms += runtime_overhead_terms(sum(t.num_bytes for t in step.in_allocator), step.setup, hardware,
                                    spec=step.spec, terms=step.in_allocator, offload=step.offloaded)
    return MemoryEstimate(
        terms=tuple(terms), peak_phase=step.phase, method="analytic", setup=setup, phase_peaks=dict(step.phase_peaks),
        cpu_bytes=step.cpu_bytes, notes=step.notes, model_name=step.spec.name, device_name=hardware.gpu.name,
        moe=copy.deepcopy(step.moe))


def _prepared(spec: ModelSpec, setup: TrainingSetup, world_size: int, layout: Engine | None
              ) -> tuple[ModelSpec, TrainingSetup, TrainingSetup, TrainingSetup, tuple[str, ...]]:
    """The checks, then (the spec as one rank sizes it, the setup asked, the step that sets the peak, that step as
    the engine runs it, the notes on how it runs)."""
    _check(spec, setup)
    spec = lora.adapted_spec(spec, setup)
    moe.check(spec, setup)
    for section in setup.techniques:  # what a technique cannot size on this model (one-line ConfigError)
        section.check_model(spec, setup)
    # MoE: formulas, not the derived model, where they size the precision the engine runs (amp-* under DeepSpeed or
    # FSDP2 runs with 16-bit parameters: _as_run); experts / ep
    spec = moe.ep_local_spec(moe.as_recipe(spec, _as_run(setup, layout or setup.engine)[0]), setup)
    spec = tensor_parallel.rank_spec(spec, setup)  # one tensor-parallel rank's shards (itself when tp is 1)
    # the step that sets the run's peak (padded batches: the longest sample's), then one context-parallel rank's
    asked, setup = setup, context_parallel.rank_setup(padding.peak_setup(setup))
    if setup.num_gpus != world_size and setup.sharding is not Sharding.NONE:
        setup = setup.replace(num_gpus=world_size)
    sized, run_notes = _as_run(setup, layout or setup.engine)
    return spec, asked, setup, sized, run_notes


@dataclasses.dataclass(frozen=True)
class _Step:
    """What estimate() computes before the runtime's own memory (memfit.estimate.device): the peak moment's tensors,
    which depend on the hardware only through its world size and whether it is a CPU."""

    spec: ModelSpec
    setup: TrainingSetup
    phase: Phase
    terms: tuple[Term, ...]
    in_allocator: tuple[Term, ...]
    offloaded: Any
    """What a technique moves off the device (TechniqueSection.host_activations), or None."""
    phase_peaks: dict
    cpu_bytes: int
    notes: tuple[str, ...]
    moe: dict | None


def _step(spec: ModelSpec, setup: TrainingSetup, world_size: int, on_cpu: bool, layout: Engine | None
          ) -> _Step | None:
    """The step's peak tensors; None for a pipelined setup (its ranks' estimates need the whole hardware)."""
    spec, asked, setup, sized, run_notes = _prepared(spec, setup, world_size, layout)
    if setup.pp > 1:
        return None
    full = full_static(spec, sized)
    static = shard(spec, sized, full, layout=layout or setup.engine)
    stacks_estimate = fits.stacked()  # encoder-decoder / vision models: their own stacks' moments (memfit.derive)

    step_temp = full.step_temp_bytes + (bnb_cpu.step_scratch_bytes(spec, sized) if on_cpu else 0)
    if stacks_estimate.is_stacked(spec, sized):
        moments = StepMoments.of(stacks_estimate.moments(spec, sized, static, step_temp, on_cpu))
    else:
        moments = step_moments(spec, sized, static, step_temp, on_cpu)
    moments = _apply_techniques(moments, spec, asked, sized, on_cpu)
    phase, terms = moments.peak()
    terms = tuple(t for t in terms if t.num_bytes > 0)
    offloaded, host_notes = _activation_host(spec, sized, on_cpu)
    notes = (tuple(rule_of_thumb_notes(spec, sized)) + static.notes + run_notes + host_notes
             + _derived_notes(spec) + moe.notes(spec, sized, on_cpu) + context_parallel.notes(asked)
             + compiled.notes(spec, sized) + padding.notes(asked) + float8.notes(spec, sized))
    return _Step(spec, setup, phase, terms, tuple(t for t in terms if t.device_figure == "allocated"), offloaded,
                 moments.phase_peaks(), static.cpu_bytes + (offloaded.host_bytes if offloaded else 0), notes,
                 moe.routing_range(spec, sized, on_cpu))


_STEPS_KEPT = 512  # ~15 KB each (its terms and the spec held)
_steps: OrderedDict[tuple, tuple[ModelSpec, _Step | None]] = OrderedDict()
_steps_lock = threading.Lock()


def _kept_step(spec: ModelSpec, setup: TrainingSetup, world_size: int, on_cpu: bool, layout: Engine | None
               ) -> _Step | None:
    """_step, remembered for the last _STEPS_KEPT arguments: a function of them only, all frozen values, and the
    same setup is sized again on other GPUs of the same count (the plan's larger-GPU walk, the page's user trying
    the GPUs), where only the runtime's figures differ (memfit.estimate.device, computed afresh each time). The
    spec is keyed by identity and held with its answer, so the id names it (its graph is no part of its equality);
    the setup's notes are in the key because they compare equal. A refusal (ConfigError) is not remembered."""
    key = (id(spec), setup, setup.notes, world_size, on_cpu, layout)
    with _steps_lock:
        kept = _steps.get(key)
        if kept is not None:
            _steps.move_to_end(key)
    if kept is None or kept[0] is not spec:
        kept = (spec, _step(spec, setup, world_size, on_cpu, layout))
        with _steps_lock:
            _steps[key] = kept
            while len(_steps) > _STEPS_KEPT:
                _steps.popitem(last=False)
    return kept[1]


def _check(spec: ModelSpec, setup: TrainingSetup) -> None:
    if not spec.is_transformer:
        raise ConfigError(f"'{spec.name}' has no transformer shape memfit can size analytically: "
                          "use `memfit trace` (memfit.trace.trace) for arbitrary nn.Modules")
    heads.check(spec, setup)  # a sequence classifier: the plain step only
    if setup.loss is not Loss.STANDARD and (not spec.is_decoder or spec.logit_softcap):
        raise ConfigError(f"a {setup.loss} loss is sized for causal LMs without final logit softcapping; "
                          f"'{spec.name}' needs loss standard")


def _apply_techniques(moments: StepMoments, spec: ModelSpec, asked: TrainingSetup, sized: TrainingSetup,
                      on_cpu: bool) -> StepMoments:
    """What techniques add to the step's moments, each a typed change: ring attention's buffers beside every
    block's backward (memfit.estimate.context_parallel, sized on the user's setup), float8's backward
    (memfit.estimate.float8), DeepSpeed ZeRO-3's frozen head input and recompute release
    (memfit.estimate.deepspeed_zero3)."""
    compute_bytes = act.dtypes(spec, sized, on_cpu).compute
    return moments.apply(context_parallel.step_changes(spec, asked, compute_bytes)
                         + float8.step_changes(spec, sized, on_cpu)
                         + deepspeed_zero3.step_changes(spec, sized, compute_bytes))


def _activation_host(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool) -> tuple[Any, tuple[str, ...]]:
    """What a technique moves off the device per micro-step and its notes (TechniqueSection.host_activations; the
    activation terms handed to it are those alive at the end of forward without it), or (None, ())."""
    for section in setup.techniques:
        host = section.host_activations(spec, setup, lambda: forward_activation_terms(spec, setup, on_cpu), on_cpu)
        if host is not None:
            return host, section.host_notes(host)
    return None, ()


def forward_activation_terms(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> list[Term]:
    """The activation terms alive at the end of forward (before any offloading)."""
    per_layer = act.layer_saved_bytes(spec, setup, setup.tokens_per_micro_step, setup.seq_len, on_cpu)
    return activation_terms(spec, setup, per_layer, act.dtypes(spec, setup, on_cpu))


def _derived_notes(spec: ModelSpec) -> tuple[str, ...]:
    if spec.derived is None:
        return ()
    from . import derived as derive
    why = act.saved_problem(spec.graph) if spec.graph is not None else None
    return ((f"no activation formula for its model graph ({why}): derived instead",) if why else ()) + derive.notes(spec)


def _as_run(setup: TrainingSetup, layout: Engine) -> tuple[TrainingSetup, tuple[str, ...]]:
    """The setup whose bytes the engine really has: amp-* under torch's FSDP2 runs as a MixedPrecisionPolicy
    (memfit.setup.fsdp2_mixed_precision), which is bf16-master's layout, not autocast's."""
    if not setup.precision.is_autocast:
        return setup, ()
    deepspeed = layout is Engine.DEEPSPEED and (setup.sharding is not Sharding.NONE or setup.offload.value != "none")
    if deepspeed:  # adapters too: memfit.setup.deepspeed_casts_module
        return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
            f"{setup.precision} under DeepSpeed runs as its {setup.precision.compute_dtype} mode (the config memfit "
            f"emits: {setup.precision.compute_dtype}.enabled): the engine casts the model to "
            f"{setup.precision.compute_dtype} and keeps fp32 master weights in the optimizer, with no autocast "
            "cache; sized like bf16-master",)
    if not fsdp2_mixed_precision(setup, layout):
        return setup, ()
    if setup.fsdp_version.is_fsdp1:
        return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
            f"{setup.precision} under FSDP1 runs as MixedPrecision(param_dtype=reduce_dtype="
            f"{setup.precision.compute_dtype}) "
            "under autocast, as accelerate and Lightning run it: fp32 trainable flat shards (accelerate's upcast), "
            "low-precision unsharded flat parameters and gradients; sized like bf16-master",)
    shards = ("the adapters' fp32 shards (the frozen base keeps its storage dtype)" if setup.finetune.adapters
              else "fp32 shards")
    return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
        f"{setup.precision} under FSDP2 runs as MixedPrecisionPolicy(param_dtype={setup.precision.compute_dtype}, "
        f"reduce_dtype=fp32), as memfit's torch engine shards it: {shards}, low-precision compute, no autocast "
        "cache; sized like bf16-master",)


def step_moments(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, step_temp: int,
                 on_cpu: bool) -> StepMoments:
    """The moments of one step of a one-stack model (`setup`: as the engine runs it)."""
    step = StepModel.build(spec, setup, static, on_cpu)
    # gradients live through forward when accumulation keeps them, when the engine pre-allocates the partition, or
    # when zero_grad(set_to_none=False) only zeroes them (setup.keep_zeroed_grads)
    early_grads = static.grads_bytes if (setup.grad_accum_steps > 1 or static.grads_preallocated
                                         or setup.keep_zeroed_grads) else 0
    if setup.optimizer_in_backward:
        early_grads = 0
    forward = step.static_terms(early_grads) + step.acts
    moments = StepMoments()
    moments.set(MomentKey.FORWARD_END, forward)
    moments.set(MomentKey.LOSS_FORWARD, loss_forward(step, forward))
    moments.set(MomentKey.LOSS_BACKWARD, loss_backward(step, forward))
    moments.set(MomentKey.FIRST_BLOCK_BACKWARD, first_block_backward(step, early_grads))
    moments.set(MomentKey.SECOND_BLOCK_BACKWARD, second_block_backward(step, early_grads))
    if hasattr(static.fsdp, "flat_gradient_terms"):  # FSDP1 (memfit.estimate.fsdp1)
        moments.set(MomentKey.FLAT_GRADIENT, flat_gradient(step, early_grads))
    moments.set(MomentKey.END_OF_BACKWARD, end_of_backward(step))
    moments.set(MomentKey.EMBEDDING_GRADIENT, embedding_gradient(step))
    moments.set(MomentKey.ROOT_REDUCE, root_reduce(step))
    moments.set(MomentKey.OPTIMIZER_STEP, step.optimizer_step(step_temp))
    if setup.loss is Loss.FUSED or getattr(heads.classifier(spec), "pool", "") == "last":
        # no B x T x V logits gradient before it (fused loss, a classifier's B x num_labels): the final norm's
        # backward chain can be the peak
        moments.set(MomentKey.FINAL_NORM_BACKWARD, final_norm_backward(step, early_grads))
    if setup.optimizer_in_backward:
        for key, terms in in_backward_moments(step).items():
            moments.set(key, terms)
    if spec.frozen and setup.checkpointing is Checkpointing.FULL and static.fsdp is None:
        moments.update(lora.checkpointed_moments(step, moments))
    if spec.frozen and setup.finetune.dora:
        moments.set(MomentKey.DORA_WEIGHT_NORM, dora.forward_moment(step, forward))
    for section in setup.techniques:  # a technique's change to every moment (activation offloading's)
        moments = section.step_moments(moments, spec, setup, step.acts, on_cpu)
    return moments


# what other modules and tests read from here (memfit.estimate.lora_checkpoint: CPU_RNG_STATE_BYTES)
__all__ = ["CPU_RNG_STATE_BYTES", "StepModel", "Term", "estimate", "forward_activation_terms", "linear_weight_parts",
           "runtime_overhead_terms", "step_moments"]

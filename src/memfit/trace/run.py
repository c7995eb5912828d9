"""trace(): run the real training step on fake tensors and return its exact tensor-level peak as a MemoryEstimate."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import ConfigError
from ..estimate.padding import peak_setup
from ..estimate.result import Category, MemoryEstimate, Phase, Term, TimelinePoint
from ..setup import Optimizer, TrainingSetup
from . import distributed, hf
from .kernels import Kernels, cpu_rng_states, device_kernels, hidden_scratch, kernel_note
from .session import (BuiltDtypes, LossFn, StepSession, build_hf_session, build_module_session,  # noqa: F401
                      repeated_blocks, routed_experts)
from .timeline import TraceProgress
from .tracker import KIND_TERMS, StepTracker, _Kind

ModelRef = str | dict | Callable[[], nn.Module]
SOURCE = "traced: the training step run on fake tensors (FakeTensorMode), every allocation and free counted"
COMPILE_REFUSAL = (
    "a trace cannot size --compile: it counts every allocation through a torch dispatch mode, and dynamo runs every "
    "frame eager while one is active (torch/_dynamo/convert_frame.py: 'non-infra torch dispatch mode present'), so "
    "the step would be eager's; `memfit estimate --compile` sizes the compiled blocks (AOTAutograd's min-cut "
    "partition of each block, traced on its own), or drop --compile")
"""Why `trace` refuses --compile. (Partitioning each block with AOTAutograd outside the tracer and replaying its
graphs inside would size it; memfit.estimate.compiled does the first half for the estimate.)"""
_ALWAYS_SHOWN = (_Kind.PARAMETERS, _Kind.GRADIENTS, _Kind.OPTIMIZER, _Kind.ACTIVATIONS, _Kind.TEMPORARIES)


def trace(model_ref: ModelRef, setup: TrainingSetup | None = None, *,
          input_builder: Callable[[TrainingSetup], Any] | None = None, loss_fn: LossFn | None = None,
          steps: int = 2, progress: Callable[[TraceProgress], None] | None = None,
          kernels: Kernels = "cuda") -> MemoryEstimate:
    """The exact per-device tensor peak of `steps` training steps (forward, loss, backward, optimizer step).

    `model_ref`: a catalog name or hub id, an HF config dict, or a zero-argument factory returning an nn.Module
    (then `input_builder(setup)` returns one micro-batch). `loss_fn(model, batch)` returns the loss; by default the
    model's output `.loss`, or for plain modules the mean of the output. `setup` may also be a Plan (its final
    setup). `progress(TraceProgress)` is called as the trace advances. Nothing real is allocated: the model is
    built on fake tensors, and the result is per rank (one device), method "traced".
    """
    setup = getattr(setup, "final_setup", setup) or TrainingSetup()
    if not isinstance(setup, TrainingSetup):
        raise ConfigError(f"trace needs a TrainingSetup (or a Plan), got {type(setup).__name__}")
    if setup.compile:
        raise ConfigError(COMPILE_REFUSAL)
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive whole number, got {steps!r}")

    setup = peak_setup(setup)  # batches padded to their longest sample: the step of the longest one
    build, name = _builder(model_ref, input_builder, loss_fn)
    host, optimizer_on_host = distributed.host_kinds(setup)
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(distributed.fake_process_group(setup.num_gpus)) if setup.sharding.stage else None
        fake_mode = FakeTensorMode(allow_non_fake_inputs=setup.optimizer.library == "bitsandbytes")
        with fake_mode:
            session = build(setup, mesh)
        tracker = StepTracker(host_kinds=host, optimizer_on_host=optimizer_on_host, num_steps=steps,
                              progress=progress, hidden_scratch=hidden_scratch(kernels))
        rng_states = cpu_rng_states(tracker.see) if kernels == "cpu" else contextlib.nullcontext()
        with device_kernels(kernels), routed_experts(), rng_states:
            run_traced(session, tracker, fake_mode, steps)
    session.notes.append(kernel_note(kernels))
    return to_estimate(tracker, session, setup, name or session.name)


def run_traced(session: StepSession, tracker: StepTracker, fake_mode: FakeTensorMode | None, steps: int) -> None:
    """Run `steps` optimizer steps of `session` under `tracker` (inside `fake_mode` when given)."""
    tracker.watch_module(session.model)
    tracker.register_tree(session.batch, _Kind.INPUTS)
    tracker.classify_optimizer_state(session.optimizer)  # e.g. fp32 master weights made at construction
    undo = distributed.instrument(session.model, tracker)

    def phase_callback(phase: str) -> None:
        if phase == "optimizer":
            tracker.classify_gradients(session.params)
        elif phase == "forward":
            tracker.classify_optimizer_state(session.optimizer)
        tracker.mark(phase)

    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), tracker:
            for _ in range(steps):
                session.run(phase_callback)
            tracker.classify_optimizer_state(session.optimizer)
        tracker.finish_progress()
    finally:
        undo()


def _builder(model_ref: ModelRef, input_builder, loss_fn):
    """(build(setup, mesh) -> StepSession, display name)."""
    if isinstance(model_ref, (str, dict)):
        if input_builder is not None:
            raise ConfigError("input_builder is for nn.Module factories; HF models get token batches of the setup")
        config, name = hf.resolve_config(model_ref)

        def build_hf(setup: TrainingSetup, mesh) -> StepSession:
            shard = distributed.sharder(setup, mesh, hf.block_finder) if mesh is not None else None
            return build_hf_session(config, setup, loss_fn=loss_fn, shard=shard)

        return build_hf, name
    if isinstance(model_ref, nn.Module):
        raise ConfigError("pass a factory (e.g. `lambda: MyModel()`), not a built module: the trace builds it on "
                          "fake tensors so that nothing real is allocated")
    if not callable(model_ref):
        raise ConfigError(f"cannot trace a {type(model_ref).__name__}: pass a model name, an HF config dict or an "
                          "nn.Module factory")
    if input_builder is None:
        raise ConfigError("tracing an nn.Module factory needs input_builder=(setup) -> one micro-batch")

    def build_module(setup: TrainingSetup, mesh) -> StepSession:
        shard = distributed.sharder(setup, mesh, repeated_blocks) if mesh is not None else None
        return build_module_session(model_ref, setup, input_builder=input_builder, loss_fn=loss_fn, shard=shard)

    return build_module, ""


# ---- the result ------------------------------------------------------------------------------------------------

def to_estimate(tracker: StepTracker, session: StepSession, setup: TrainingSetup, name: str) -> MemoryEstimate:
    peak = tracker.peak_by_kind
    terms = tuple(Term(name=KIND_TERMS[kind][0], category=KIND_TERMS[kind][1], num_bytes=num_bytes, source=SOURCE)
                  for kind, num_bytes in peak.items() if num_bytes or kind in _ALWAYS_SHOWN)
    host = tracker.host_live()
    cpu_bytes = sum(num_bytes for kind, num_bytes in host.items() if kind is not _Kind.HOST_TEMPORARIES)
    notes = [f"traced {tracker.events} allocations and frees over {tracker.num_steps} steps; peak in step "
             f"{tracker.peak_step} {(tracker.peak_phase or Phase.FORWARD).value}", *session.notes]
    if tracker.values_assumed:
        notes.append(f"the optimizer step read {tracker.values_assumed} tensor values (.item()), which fake tensors do "
                     "not have; the trace took 0 (finite gradients, the step taken)")
    notes += [note for section in setup.techniques if (note := section.trace_note())]
    if host:
        notes.append("CPU offload: optimizer states (and the step's scratch) live in host memory, outside the "
                     "device peak; cpu_bytes is what stays on the host")
    return MemoryEstimate(
        terms=terms, peak_phase=tracker.peak_phase or Phase.FORWARD, method="traced", setup=setup,
        phase_peaks=dict(tracker.phase_peaks), cpu_bytes=cpu_bytes, notes=tuple(notes),
        timeline=_timeline(tracker), top_modules=tuple(tracker.top_modules()), model_name=name)


def _timeline(tracker: StepTracker) -> tuple[TimelinePoint, ...]:
    device_kinds = list(tracker.peak_by_kind)
    points = []
    for sample in tracker.samples():
        by_category = {category: 0 for category in Category if category is not Category.OVERHEAD}
        for kind in device_kinds:
            by_category[KIND_TERMS[kind][1]] += sample.live[kind]
        points.append(TimelinePoint(index=sample.event, phase=sample.phase or Phase.FORWARD,
                                    by_category=by_category, label=sample.label))
    return tuple(points)


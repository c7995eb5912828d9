"""A trace as the planner's estimator: plans for models the analytic model cannot size (plain nn.Modules, custom
architectures), with the same ladder. Each distinct setup is traced once."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..estimate.analytic import runtime_overhead_terms
from ..estimate.result import MemoryEstimate
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import TrainingSetup


def traced_estimator(model_ref: Any, *, input_builder: Callable | None = None, loss_fn: Callable | None = None,
                     steps: int = 2, progress: Callable | None = None
                     ) -> Callable[[ModelSpec, TrainingSetup, Hardware], MemoryEstimate]:
    """An `estimator(spec, setup, hardware)` for `memfit.plan.plan(..., estimator=...)` that traces `model_ref`
    (anything `memfit.trace.trace` takes) under each setup, with the device's kernel choices (CPU or CUDA), and adds
    the device's runtime overhead."""
    from .run import trace

    traced: dict[tuple[TrainingSetup, str], MemoryEstimate] = {}

    def estimator(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> MemoryEstimate:
        kernels = "cpu" if hardware.is_cpu else "cuda"  # the device's kernel choices, as the analytic model takes
        if (setup, kernels) not in traced:
            traced[setup, kernels] = trace(model_ref, setup, input_builder=input_builder, loss_fn=loss_fn,
                                           steps=steps, progress=progress, kernels=kernels)
        result = traced[setup, kernels]
        overhead = runtime_overhead_terms(result.tensor_bytes, setup, hardware)
        return dataclasses.replace(result, terms=result.terms + tuple(overhead), device_name=hardware.gpu.name)

    return estimator

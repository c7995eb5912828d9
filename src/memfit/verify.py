"""One truth: a trace and the formulas side by side on the same semantics, and which figure memfit trusts.

memfit sizes a step three ways. The formulas (`memfit.estimate.analytic`) are microseconds and cover every engine
layout; the trace (`memfit.trace`) runs the model's real code on fake tensors with the setup's techniques applied,
exact to the byte for what it runs; a measurement (`memfit.measure`) is the real step on a real device. A trace
always runs torch (FSDP2 over a fake process group for ZeRO, no DDP, no DeepSpeed) with the target device's kernel
choices, so the formulas are compared with it on that same layout (`estimate(..., layout=Engine.TORCH)`), and the
difference the engine makes is shown on its own, from the formulas, which were checked against real 2-rank
DeepSpeed, FSDP2 and DDP runs (tests/engines/test_launch.py).

Which figure memfit trusts:
- like for like within TOLERANCE: both; the formulas are what plans use (the same number, a million times faster);
- beyond it: the trace, which runs the real code, and the output names the category the formulas miss;
- engine terms the trace cannot run (DeepSpeed's buffers, DDP's buckets): the formulas, measured on real runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .diagnose import DEFAULT_MARGIN, diagnose
from .estimate.analytic import estimate
from .estimate.result import Category, MemoryEstimate
from .hardware import Hardware
from .model_spec import ModelSpec
from .setup import Engine, Offload, Sharding, TrainingSetup
from .units import format_bytes

TOLERANCE = 0.03
"""Like-for-like agreement the cross-check asks of formulas and trace (tests/trace/test_crosscheck.py, bench/crosscheck.py)."""


@dataclass(frozen=True)
class TracedAs:
    """What a trace of `asked` really runs: the setup, sized on torch's layout, and each way it differs."""

    setup: TrainingSetup
    differences: tuple[str, ...]

    @property
    def engine_differs(self) -> bool:
        return bool(self.differences)


def traced_as(asked: TrainingSetup) -> TracedAs:
    """The setup a trace of `asked` runs (memfit.trace: FSDP2 for every ZeRO stage, one process, no DDP)."""
    setup, differences = asked, []
    if asked.sharding is Sharding.NONE and asked.num_gpus > 1:
        setup = setup.replace(num_gpus=1)
        buckets = ("DDP's gradient buckets (one more gradient-sized buffer)" if asked.engine is Engine.TORCH
                   else "DeepSpeed's reduce bucket")
        differences.append(f"data parallelism without sharding is traced as one GPU: {buckets} come from the formulas")
    if asked.sharding is Sharding.ZERO1:
        setup = setup.replace(sharding=Sharding.ZERO2)
        differences.append("FSDP2 has no ZeRO-1: the trace shards gradients too (ZeRO-2); ZeRO-1's full gradients "
                           "come from the formulas")
    if asked.offload is Offload.OPTIMIZER and asked.precision.master_weights:
        differences.append("FSDP2 cannot offload the optimizer alone: the trace keeps the fp32 master shards and "
                           "their fp32 gradients on the device, which ZeRO-Offload keeps on the host")
    if asked.engine is Engine.DEEPSPEED and (asked.sharding is not Sharding.NONE or asked.offload is not Offload.NONE):
        differences.append("the trace runs torch's FSDP2, not DeepSpeed: DeepSpeed's own buffers (fp32 partition "
                           "copy, pre-allocated gradient partition, reduce bucket) come from the formulas")
    return TracedAs(setup, tuple(differences))


@dataclass(frozen=True)
class CrossCheck:
    """A traced estimate next to the formulas: like for like, and for the setup (and engine) asked for."""

    traced: MemoryEstimate
    like_for_like: MemoryEstimate
    """The formulas on what the trace ran (same layout, same kernels)."""
    asked: MemoryEstimate
    """The formulas on the setup asked for, on its engine's own layout."""
    traced_as: TracedAs
    margin: float = DEFAULT_MARGIN
    hardware: Hardware | None = None

    @property
    def error(self) -> float:
        """(formulas - trace) / trace, like for like, on tensor bytes."""
        return (self.like_for_like.tensor_bytes - self.traced.tensor_bytes) / max(self.traced.tensor_bytes, 1)

    @property
    def agrees(self) -> bool:
        return abs(self.error) <= TOLERANCE

    @property
    def engine_delta_bytes(self) -> int:
        """What the asked engine's layout adds to (or saves from) what the trace ran, per the formulas."""
        return self.asked.total_bytes - self.like_for_like.total_bytes

    @property
    def trusted(self) -> str:
        """'analytic' or 'traced': the figure memfit stands by for the setup asked for."""
        return "analytic" if self.agrees else "traced"

    @property
    def trusted_total_bytes(self) -> int:
        """The device total memfit stands by: the formulas' when they agree; else the trace plus the engine terms
        that only the formulas have."""
        if self.agrees:
            return self.asked.total_bytes
        return self.traced.total_bytes + self.engine_delta_bytes

    def biggest_gap(self) -> tuple[Category, int]:
        """The category where the formulas differ most from the trace (like for like)."""
        mine, theirs = self.like_for_like.by_category(), self.traced.by_category()
        tensors = [c for c in Category if c is not Category.OVERHEAD]  # the error is on tensor bytes
        category = max(tensors, key=lambda c: abs(mine.get(c, 0) - theirs.get(c, 0)))
        return category, mine.get(category, 0) - theirs.get(category, 0)

    def verdict(self) -> list[str]:
        """What memfit concludes, in lines the CLI prints as they are."""
        lines = []
        pct = f"{self.error:+.1%}"
        if self.agrees:
            lines.append(f"the formulas and the trace agree within {TOLERANCE:.0%} on the same layout ({pct}); "
                         "memfit trusts both, and plans with the formulas")
        else:
            category, gap = self.biggest_gap()
            lines.append(f"the formulas are {pct} off the trace on the same layout, most in {category.value} "
                         f"({format_bytes(abs(gap))} {'over' if gap > 0 else 'under'}); memfit trusts the trace: it "
                         "runs the model's real code with the setup's techniques on the target's kernel choices")
        for difference in self.traced_as.differences:
            lines.append(difference)
        if self.traced_as.engine_differs:
            sign = "+" if self.engine_delta_bytes >= 0 else "-"
            lines.append(f"the setup's own engine layout: {sign}{format_bytes(abs(self.engine_delta_bytes))} "
                         "(formulas, checked against real 2-rank runs); figure for the setup asked for: "
                         f"{format_bytes(self.trusted_total_bytes)}")
        if self.hardware is not None and not self.agrees:
            fits = self.trusted_total_bytes <= int(self.hardware.gpu.memory_bytes * (1 - self.margin))
            planned = diagnose(self.asked, self.hardware, margin=self.margin).fits
            if fits != planned:
                lines.append(f"with the trusted figure the setup {'fits' if fits else 'does NOT fit'}, unlike the "
                             "plan's formulas said")
        return lines

    def to_dict(self) -> dict:
        return {"traced": self.traced.to_dict(), "analytic_like_for_like": self.like_for_like.to_dict(),
                "analytic": self.asked.to_dict(), "traced_as": self.traced_as.setup.to_dict(),
                "differences": list(self.traced_as.differences), "error": self.error, "agrees": self.agrees,
                "tolerance": TOLERANCE, "trusted": self.trusted, "trusted_total_bytes": self.trusted_total_bytes,
                "engine_delta_bytes": self.engine_delta_bytes, "verdict": self.verdict(),
                "analytic_tensor_bytes": self.like_for_like.tensor_bytes,
                "traced_tensor_bytes": self.traced.tensor_bytes}


def cross_check(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, traced: MemoryEstimate, *,
                margin: float = DEFAULT_MARGIN) -> CrossCheck:
    """Put `traced` (a trace of `setup` on `hardware`'s kernels) next to the formulas."""
    runs = traced_as(setup)
    like = estimate(spec, runs.setup, hardware, layout=Engine.TORCH)
    asked = estimate(spec, setup, hardware)
    return CrossCheck(traced=traced, like_for_like=like, asked=asked, traced_as=runs,
                      margin=margin, hardware=hardware)

"""Walk the seed's ladder from the cheapest change, re-estimating after each step, until the step fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .diagnose import DEFAULT_MARGIN, Bottleneck, Diagnosis, diagnose
from .estimate.analytic import estimate
from .estimate.result import MemoryEstimate
from .hardware import Hardware, gpu_catalog
from .model_spec import ModelSpec
from .setup import TrainingSetup
from .techniques import LADDERS, REGISTRY, Context, Proposal, Skip
from .techniques.base import EstimateFn
from .techniques.zero import zero3_gpus_needed
from .throughput import relative_step_time
from .units import format_bytes


@dataclass(frozen=True)
class PlanStep:
    technique: str
    title: str
    setup: TrainingSetup
    estimate: MemoryEstimate
    diagnosis: Diagnosis
    change: str
    cost: str
    why: str

    def to_dict(self) -> dict:
        return {"technique": self.technique, "title": self.title, "change": self.change, "cost": self.cost,
                "why": self.why, "total_bytes": self.estimate.total_bytes,
                "bottleneck_after": self.diagnosis.bottleneck.value, "fits": self.diagnosis.fits,
                "setup": self.setup.to_dict(), "estimate": self.estimate.to_dict()}


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    hardware: Hardware
    initial_setup: TrainingSetup
    initial_estimate: MemoryEstimate
    initial_diagnosis: Diagnosis
    steps: tuple[PlanStep, ...]
    skipped: tuple[tuple[str, str], ...]
    """(technique title, why it was not used) for rungs of the ladder that were passed over."""
    suggestions: tuple[str, ...] = ()
    """When nothing fits: what would (more GPUs, a larger GPU, LoRA)."""
    margin: float = DEFAULT_MARGIN

    @property
    def final_setup(self) -> TrainingSetup:
        return self.steps[-1].setup if self.steps else self.initial_setup

    @property
    def final_estimate(self) -> MemoryEstimate:
        return self.steps[-1].estimate if self.steps else self.initial_estimate

    @property
    def final_diagnosis(self) -> Diagnosis:
        return self.steps[-1].diagnosis if self.steps else self.initial_diagnosis

    @property
    def fits(self) -> bool:
        return self.final_diagnosis.fits

    def to_dict(self) -> dict:
        return {"model": self.spec.name, "num_params": self.spec.num_params, "gpu": self.hardware.gpu.name,
                "gpu_memory_bytes": self.hardware.gpu.memory_bytes, "world_size": self.hardware.world_size,
                "margin": self.margin, "fits": self.fits, "initial_setup": self.initial_setup.to_dict(),
                "initial_estimate": self.initial_estimate.to_dict(),
                "initial_diagnosis": self.initial_diagnosis.to_dict(), "steps": [s.to_dict() for s in self.steps],
                "skipped": [{"technique": t, "reason": r} for t, r in self.skipped],
                "final_setup": self.final_setup.to_dict(), "final_diagnosis": self.final_diagnosis.to_dict(),
                "suggestions": list(self.suggestions)}


def plan(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
         estimator: EstimateFn = estimate) -> Plan:
    """The seed's decision framework: diagnose, take the next untried rung of the ladder for the current bottleneck
    (falling back to the combined ladder when that one is spent), re-estimate, and stop at the first fit.

    `estimator(spec, setup, hardware)` sizes each setup: the analytic model by default; a trace
    (`memfit.trace.traced_estimator`) plans models that have no transformer shape, such as plain nn.Modules."""
    current = setup
    est = estimator(spec, current, hardware)
    diag = diagnose(est, hardware, margin=margin)
    initial = (est, diag)
    steps: list[PlanStep] = []
    skipped: dict[str, str] = {}
    tried: set[str] = set()
    while not diag.fits:
        proposal = _next_proposal(Context(spec, hardware, current, est, diag, margin, estimator), tried, skipped)
        if proposal is None:
            break
        key, prop = proposal
        current = prop.setup
        est = estimator(spec, current, hardware)
        diag = diagnose(est, hardware, margin=margin)
        steps.append(PlanStep(key, REGISTRY[key].title, current, est, diag, prop.change, prop.cost, prop.why))
    suggestions = () if diag.fits else tuple(_suggestions(Context(spec, hardware, current, est, diag, margin,
                                                                  estimator)))
    return Plan(spec, hardware, setup, initial[0], initial[1], tuple(steps),
                tuple((REGISTRY[k].title, r) for k, r in skipped.items()), suggestions, margin)


def _next_proposal(ctx: Context, tried: set[str], skipped: dict[str, str]) -> tuple[str, Proposal] | None:
    own = LADDERS[ctx.diagnosis.bottleneck]
    ladder = own + tuple(k for k in LADDERS[Bottleneck.BOTH] if k not in own)
    for key in ladder:
        if key in tried:
            continue
        result = REGISTRY[key].propose(ctx)
        if isinstance(result, Skip):
            skipped.setdefault(key, result.reason)
            continue
        tried.add(key)
        skipped.pop(key, None)
        return key, result
    return None


def _suggestions(ctx: Context) -> list[str]:
    spec, setup, hardware, margin, estimator = ctx.spec, ctx.setup, ctx.hardware, ctx.margin, ctx.estimator
    out = []
    n = zero3_gpus_needed(ctx)
    if n is not None:
        out.append(f"more GPUs: with ZeRO-3 this setup fits on {n} x {hardware.gpu.name}")
    for gpu in sorted(gpu_catalog().values(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= hardware.gpu.memory_bytes:
            continue
        hw = dataclasses.replace(hardware, gpu=gpu)
        if diagnose(estimator(spec, setup, hw), hw, margin=margin).fits:
            out.append(f"a larger GPU: it fits on {gpu.name} ({format_bytes(gpu.memory_bytes)})")
            break
    frozen = 2 * spec.num_params
    out.append(f"LoRA: frozen bf16 weights ({format_bytes(frozen)}) with no gradients or optimizer states for them; "
               "memfit does not size LoRA adapters yet")
    return out


@dataclass(frozen=True)
class OptimizedChoice:
    setup: TrainingSetup
    estimate: MemoryEstimate
    relative_step_time: float
    """Modelled time per sample relative to the ladder's final setup (lower is faster)."""
    differences: tuple[str, ...]


def optimize(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
             reference: TrainingSetup | None = None) -> OptimizedChoice | None:
    """Search every combination of the techniques; return the fitting setup with the best modelled throughput."""
    from .search import candidate_setups

    best = None
    for cand in candidate_setups(setup, hardware):
        est = estimate(spec, cand, hardware)
        if not diagnose(est, hardware, margin=margin).fits:
            continue
        t = relative_step_time(spec, cand, hardware)
        if best is None or t < best[0]:
            best = (t, cand, est)
    if best is None:
        return None
    ref = reference or setup
    ref_time = relative_step_time(spec, ref, hardware)
    diffs = tuple(f"{f.name}: {getattr(ref, f.name)} -> {getattr(best[1], f.name)}"
                  for f in dataclasses.fields(TrainingSetup)
                  if f.name != "notes" and getattr(ref, f.name) != getattr(best[1], f.name))
    return OptimizedChoice(best[1], best[2], best[0] / ref_time, diffs)

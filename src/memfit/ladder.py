"""One walk up the seed's ladder: from a setup, take the next rung the current bottleneck calls for, re-estimate, and
stop at the first fit or when no rung is left. memfit.plan wraps it with the suggestions; the GPU-count answer for a
setup whose static memory does not fit walks it again on more GPUs.

While static memory alone is over the budget, the rungs that cut only activations are passed over, and a rung's
saving is measured on static memory (the seed's framework: static rungs first; techniques.base.static_over_budget)."""

from __future__ import annotations

from dataclasses import dataclass

from .diagnose import Bottleneck, Diagnosis, diagnose, static_floor_bytes
from .errors import ConfigError
from .estimate.result import MemoryEstimate
from .frameworks import speak
from .hardware import Hardware
from .model_spec import ModelSpec
from .setup import TrainingSetup, setup_changes
from .techniques import LADDERS, REGISTRY, Context, Proposal, Skip
from .techniques.base import STATIC_OVER, EstimateFn, pin_reason, static_over_budget
from .techniques.costs import Cost
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
    """What the rung costs, as printed: `typed_cost.text`."""
    why: str
    typed_cost: Cost = Cost()
    """The rung's typed Cost (memfit.techniques.costs): its numbers, packages, what it rules out, caveats."""

    def to_dict(self) -> dict:
        return {"technique": self.technique, "title": self.title, "change": self.change, "cost": self.cost,
                "why": self.why, "total_bytes": self.estimate.total_bytes,
                "bottleneck_after": self.diagnosis.bottleneck.value, "fits": self.diagnosis.fits,
                "setup": self.setup.to_dict(), "estimate": self.estimate.to_dict()}


@dataclass(frozen=True)
class Walked:
    """Where a walk ended: its steps, the rungs passed over (key -> why), and the last setup with its estimate."""

    steps: tuple[PlanStep, ...]
    skipped: dict[str, str]
    setup: TrainingSetup
    estimate: MemoryEstimate
    diagnosis: Diagnosis


def walk(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, start: tuple[MemoryEstimate, Diagnosis], *,
         margin: float, estimator: EstimateFn, explicit: frozenset[str], keep: frozenset[str]) -> Walked:
    """Take rungs from `setup` (sized as `start`) until the step fits or no rung is left."""
    current, (est, diag) = setup, start
    steps: list[PlanStep] = []
    skipped: dict[str, str] = {}
    tried: set[str] = set()
    no_gain: set[str] = set()  # rungs that saved nothing at this point: asked again once another step is taken
    while not diag.fits:
        ctx = Context(spec, hardware, current, est, diag, margin, estimator, explicit, keep)
        proposal = _next_proposal(ctx, tried | no_gain, skipped)
        if proposal is None:
            break
        key, prop = proposal
        tried.discard(key)
        after = estimator(spec, prop.setup, hardware)
        after_diag = diagnose(after, hardware, margin=margin)
        saved, measured = _saving((est, diag), (after, after_diag))
        if saved <= 0:  # a rung that saves nothing here is no step
            skipped[key] = f"saves nothing here: {measured}"
            no_gain.add(key)
            continue
        tried.add(key)
        no_gain.clear()
        why = explain(current, prop.setup, prop.why, explicit)
        current, est, diag = prop.setup, after, after_diag
        steps.append(PlanStep(key, REGISTRY[key].title, current, est, diag, prop.change, prop.cost.text, why,
                              prop.cost))
    return Walked(tuple(steps), skipped, current, est, diag)


def _saving(before: tuple[MemoryEstimate, Diagnosis], after: tuple[MemoryEstimate, Diagnosis]) -> tuple[int, str]:
    """What a rung saved, and the figures it is measured on: static memory while that alone is over the budget (no
    activation saving counts until it fits, so a static rung that grows activations, QLoRA's fp32 residual stream,
    is still progress), else the step's whole requirement."""
    if static_over_budget(*before):
        old, new = static_floor_bytes(before[0]), static_floor_bytes(after[0])
        return old - new, f"static memory {format_bytes(old)} -> {format_bytes(new)}"
    old, new = before[1].required_bytes, after[1].required_bytes
    return old - new, f"{format_bytes(old)} -> {format_bytes(new)}"


def explain(before: TrainingSetup, after: TrainingSetup, why: str, explicit: frozenset[str]) -> str:
    """A step's `why`: the rung's reason, led by "you asked for X; this rung changes it to Y because" when it changes
    a field the user set, and followed by every field it changes (from the setup diff, so none goes unsaid)."""
    changes = setup_changes(before, after)
    asked = [c for c in changes if c.field in explicit]
    if asked:
        why = (f"you asked for {_join(f'{c.label} {c.old}' for c in asked)}; this rung changes "
               f"{'it' if len(asked) == 1 else 'them'} to {_join(str(c.new) for c in asked)} because {why}")
    return f"{why} (changes {_join(c.text for c in changes)})" if changes else why


def _join(parts) -> str:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _next_proposal(ctx: Context, tried: set[str], skipped: dict[str, str]) -> tuple[str, Proposal] | None:
    """The first rung of the ladder that proposes a change no pin forbids; one that changes a field the user set is
    kept back while a rung that leaves them alone is left, and one beyond the seed (LoRA, QLoRA: another method)
    until no seed rung is left. While static memory alone is over the budget, rungs that cut only activations are
    passed over with that reason (the seed's framework: static rungs first)."""
    own = LADDERS[ctx.diagnosis.bottleneck]
    ladder = own + tuple(k for k in LADDERS[Bottleneck.BOTH] if k not in own)
    deferred: tuple[str, Proposal] | None = None
    beyond: tuple[str, Proposal] | None = None
    static_over = static_over_budget(ctx.estimate, ctx.diagnosis)
    for key in ladder:
        if key in tried:
            continue
        if not REGISTRY[key].cuts_static and static_over:  # the seed: static rungs first (techniques.base)
            skipped[key] = static_over
            continue
        if skipped.get(key, "").startswith(STATIC_OVER):  # static memory fits now: ask the rung afresh
            del skipped[key]
        try:
            result = speak(ctx, REGISTRY[key].propose(ctx))
        except ConfigError as error:  # the rung's change does not combine with the setup as it now is
            result = Skip(rung_reason(str(error)))
        if isinstance(result, Proposal) and ctx.pinned_changes(result.setup):
            result = Skip(pin_reason(ctx.pinned_changes(result.setup)))
        if isinstance(result, Skip):
            skipped.setdefault(key, result.reason)
            continue
        if ctx.explicit_changes(result.setup):
            deferred = deferred or (key, result)
            continue
        if REGISTRY[key].beyond_seed:
            beyond = beyond or (key, result)
            continue
        tried.add(key)
        skipped.pop(key, None)
        return key, result
    chosen = deferred or beyond
    if chosen is not None:
        tried.add(chosen[0])
        skipped.pop(chosen[0], None)
    return chosen




def rung_reason(message: str) -> str:
    """A setup's refusal as the reason a rung was passed over: the advice to drop an option ("...: drop
    --compile") is for a user who gave it, and the rung's change is what set it here, so it goes."""
    for lead in (": drop --", "; drop --", ", or drop --"):
        if lead in message:
            return message[:message.index(lead)]
    return message

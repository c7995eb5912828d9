"""A technique is a small class that proposes a new TrainingSetup; it never edits numbers. The estimator re-sizes the
proposal, so each technique's memory effect is modelled (and tested) once, in the estimator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

from ..diagnose import Bottleneck, Diagnosis, diagnose
from ..estimate.analytic import estimate
from ..estimate.result import MemoryEstimate
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..errors import ConfigError
from ..setup import Checkpointing, Engine, FieldChange, TrainingSetup, keep_name, setup_changes
from ..units import format_bytes
from .costs import Cost


@dataclass(frozen=True)
class Context:
    """What a technique may look at: the model, the hardware, the current setup and its estimate."""

    spec: ModelSpec
    hardware: Hardware
    setup: TrainingSetup
    estimate: MemoryEstimate
    diagnosis: Diagnosis
    margin: float
    estimator: "EstimateFn" = estimate
    """How setups are sized: the analytic model by default, a trace for models without a transformer shape."""
    explicit: frozenset[str] = frozenset()
    """TrainingSetup fields the user set: a rung may change one only as a last resort, and says so in `why`."""
    keep: frozenset[str] = frozenset()
    """TrainingSetup fields pinned with --keep: no rung changes them."""

    def size(self, setup: TrainingSetup, hardware: Hardware | None = None) -> MemoryEstimate:
        """The estimate of another setup, with this plan's estimator."""
        return self.estimator(self.spec, setup, hardware or self.hardware)

    def fits(self, setup: TrainingSetup) -> bool:
        return self.fits_on(setup, self.hardware)

    def fits_on(self, setup: TrainingSetup, hardware: Hardware) -> bool:
        return diagnose(self.size(setup, hardware), hardware, margin=self.margin).fits

    def first_fitting(self, candidates: list[TrainingSetup]) -> TrainingSetup | None:
        return next((c for c in candidates if self.fits(c)), None)

    def pinned_changes(self, setup: TrainingSetup) -> tuple[FieldChange, ...]:
        """The changes from the current setup that --keep forbids."""
        return tuple(c for c in setup_changes(self.setup, setup) if c.field in self.keep)

    def explicit_changes(self, setup: TrainingSetup) -> tuple[FieldChange, ...]:
        """The changes from the current setup to fields the user set."""
        return tuple(c for c in setup_changes(self.setup, setup) if c.field in self.explicit)

    def pick(self, candidates: list[TrainingSetup]) -> TrainingSetup | Skip:
        """Of a rung's candidates (least change first): drop those that change a pinned field, prefer those that
        leave the user's explicit choices alone, and take the first that fits, else the last (the most saving).
        While static memory alone is over the budget (`static_over_budget`) a candidate fits when it would with the
        activations at their least (`least_activations`): the activation rungs after it do the rest."""
        allowed = [c for c in candidates if not self.pinned_changes(c)]
        if not allowed:
            return Skip(pin_reason(self.pinned_changes(candidates[-1])))
        group = [c for c in allowed if not self.explicit_changes(c)] or allowed
        if static_over_budget(self.estimate, self.diagnosis):  # static rungs first: judged with activations least
            return next((c for c in group if self.fits(self.least_activations(c))), group[-1])
        return self.first_fitting(group) or group[-1]

    def least_activations(self, setup: TrainingSetup) -> TrainingSetup:
        """`setup` as the activation rungs after a static one would leave it at most: full checkpointing and
        micro-batch 1 (the same effective batch), where --keep does not pin them."""
        changes = {}
        if "checkpointing" not in self.keep:
            changes["checkpointing"] = Checkpointing.FULL
        if not {"micro_batch_size", "grad_accum_steps"} & self.keep:
            changes.update(micro_batch_size=1, grad_accum_steps=setup.grad_accum_steps * setup.micro_batch_size)
        try:
            return setup.replace(**changes)
        except ConfigError:
            return setup


@dataclass(frozen=True)
class Proposal:
    setup: TrainingSetup
    change: str
    """The one-line change to make (code or config)."""
    cost: Cost
    """What it costs: compute, communication, traffic, convergence caveats (the ladder prints its text)."""
    why: str


@dataclass(frozen=True)
class Skip:
    reason: str


def pin_reason(changes: tuple[FieldChange, ...]) -> str:
    """Why a rung is skipped when it would change pinned fields."""
    what = ", ".join(c.text for c in changes)
    pins = ",".join(dict.fromkeys(keep_name(c.field) for c in changes))
    return f"it would change {what}, which --keep {pins} pins"


class Technique:
    key: ClassVar[str]
    title: ClassVar[str]
    beyond_seed: ClassVar[bool] = False
    """A change of method rather than of how the same training runs (LoRA, QLoRA): proposed only when no rung of
    the seed's ladder is left."""
    cuts_static: ClassVar[bool] = True
    """Whether the rung can shrink static memory (parameters, gradients, optimizer states). A rung that only cuts
    activations is passed over while static memory alone is over the budget (`static_over_budget`)."""
    rung_after: ClassVar[Mapping[Bottleneck, str]] = {}
    """Where a technique module puts its own rung: {ladder: the rung it follows}; `register` inserts its key into
    LADDERS there (a technique named in LADDERS itself leaves it empty)."""

    def propose(self, ctx: Context) -> Proposal | Skip:  # pragma: no cover - interface
        raise NotImplementedError

    def step_cost(self, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost | None:
        """What the setup's use of this technique costs a step, for memfit.throughput (None: not modelled)."""
        return None

    def search_values(self, setup: TrainingSetup, hardware: Hardware) -> dict[str, list]:
        """The values of the setup fields this technique owns that `plan --optimize` combines (memfit.search):
        {field: values}. Only the techniques in SEARCH are searched."""
        return {}


def with_engine_that_can(setup: TrainingSetup, *, keep: frozenset[str] = frozenset(), **changes) -> TrainingSetup:
    """`setup` with `changes` on its own engine when that engine can express the result, else on the first other
    engine that can: DeepSpeed for optimizer-only offload or 8-bit Adam on shards, torch's FSDP2 for a packed 4-bit
    base under ZeRO-3. The step's `why` then names the engine. When none can (or --keep pins the engine), the
    ConfigError of DeepSpeed's attempt, else of the setup's own engine."""
    errors: dict[Engine, ConfigError] = {}
    others = () if "engine" in keep or "engine" in changes else tuple(e for e in Engine if e is not setup.engine)
    for engine in (setup.engine, *others):
        try:
            return setup.replace(**changes) if engine is setup.engine else setup.replace(**changes, engine=engine)
        except ConfigError as error:
            errors[engine] = error
    raise errors.get(Engine.DEEPSPEED, errors[setup.engine])


def static_over_budget(estimate: MemoryEstimate, diagnosis: Diagnosis) -> str | None:
    """Why no activation rung can help, or None: static memory alone is at or over the budget, so the seed's static
    rungs (mixed precision, 8-bit Adam, ZeRO, offload) must come first. The one place this rule lives:
    memfit.ladder asks it for every rung whose `cuts_static` is False, and measures a rung's saving on
    static memory while it holds; Context.pick judges a static rung's candidates by it."""
    floor = diagnosis.static_bytes  # memfit.diagnose.static_floor_bytes
    if floor < diagnosis.budget_bytes:
        return None
    return (f"{STATIC_OVER} ({format_bytes(floor)} of {format_bytes(diagnosis.budget_bytes)} usable): no activation "
            "saving could make the step fit")


STATIC_OVER = "passed over while static memory alone was over the budget"

REGISTRY: dict[str, Technique] = {}


def register(cls: type[Technique]) -> type[Technique]:
    """Register a technique's rung (and cost); with `rung_after`, its place in the ladders too."""
    REGISTRY[cls.key] = cls()
    for bottleneck, before in cls.rung_after.items():
        ladder = LADDERS[bottleneck]
        if cls.key not in ladder:
            at = ladder.index(before) + 1
            LADDERS[bottleneck] = (*ladder[:at], cls.key, *ladder[at:])
    return cls


FRAGMENT_SLOTS = ("hf_trainer", "hf_trainer.memory", "torchtune.optimizer")
"""Where a technique module plugs text into an emitter or a reader, besides what those name themselves:
hf_trainer: `fragment(setup, **_) -> (TrainingArguments kwargs, their comments, notes)`, run by
memfit.emit.hf_trainer after the precision part (before the optimizer's); hf_trainer.memory: the same, run after the
checkpointing and loss parts (before torch.compile's), also given `apply_line` (the line that applies
memfit_apply.json, or None); torchtune.optimizer:
`fragment(read, optimizer) -> bool`, run by memfit.readers.torchtune on a torchtune recipe's `optimizer` mapping
before its own components; True: the fragment read it."""

FRAGMENTS: dict[str, list[Callable]] = {slot: [] for slot in FRAGMENT_SLOTS}


def fragment(slot: str) -> Callable[[Callable], Callable]:
    """Register a technique module's emitter or reader fragment for `slot` (one of FRAGMENT_SLOTS)."""
    if slot not in FRAGMENTS:
        raise ValueError(f"{slot} is not in memfit.techniques.base.FRAGMENT_SLOTS")

    def add(function: Callable) -> Callable:
        FRAGMENTS[slot].append(function)
        return function

    return add


# The seed's ladders, cheapest change first (shared/seed: "A Decision Framework").
LADDERS: dict[Bottleneck, tuple[str, ...]] = {
    Bottleneck.STATIC: ("mixed_precision", "adam_8bit", "optimizer_in_backward", "zero"),
    Bottleneck.ACTIVATIONS: ("checkpointing", "micro_batch", "flash_attention", "fused_loss", "compile"),
    Bottleneck.BOTH: ("mixed_precision", "checkpointing", "adam_8bit", "micro_batch", "flash_attention", "fused_loss",
                      "optimizer_in_backward", "zero", "cpu_offload", "compile", "lora", "qlora"),
}
"""The chunked / fused loss follows FlashAttention (free, everywhere) since it costs compute or a package; the
optimizer step in backward follows 8-bit AdamW and precedes ZeRO: one GPU, no communication, but no accumulation
or clipping. A technique module may insert its own rung (Technique.rung_after: activation offloading follows the loss
rungs). LoRA and QLoRA come after every seed
rung (the combined ladder ends with them): they change what is trained, not only how (memfit.techniques.lora).
While static memory alone is over the budget, every rung whose `cuts_static` is False waits (static_over_budget)."""

SEARCH: tuple[str, ...] = ("mixed_precision", "adam_8bit", "checkpointing", "micro_batch", "zero", "cpu_offload",
                           "flash_attention")
"""The techniques `plan --optimize` combines (memfit.search.candidate_setups), in the order their fields vary in the
search (the last fastest), which is also how ties between equally fast setups break. fused_loss,
compile and the rungs technique modules insert (Technique.rung_after) yield values too but are not searched: adding them moves --optimize answers
(memfit.search; see its docstring)."""

EstimateFn = Callable[[ModelSpec, TrainingSetup, Hardware], MemoryEstimate]

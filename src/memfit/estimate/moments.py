"""The moments of a training step, typed: where live memory can peak, each a phase and the terms alive then.

A step's estimate is its moments' largest total (memfit.estimate.analytic). `StepMoments` keeps them in the order
they are built (the first of equal totals is the peak, as before), keyed by `MomentKey`; a pipeline rank's or a
stacked model's moments, named after its stages or stacks, are keyed by their label (a plain string).

Techniques that add to existing moments (float8's backward, ring attention, DeepSpeed ZeRO-3's frozen-head input and
recompute release) return `StepChange`s that `StepMoments.apply` applies in one place, rather than rewriting the
moments themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import NamedTuple

from .result import Phase, Term
from .terms import TermKey


class MomentKey(StrEnum):
    """The named moments of one step (a StrEnum: `moments["loss backward"]` finds MomentKey.LOSS_BACKWARD)."""

    FORWARD_END = "forward end"
    LOSS_FORWARD = "loss forward"
    DORA_WEIGHT_NORM = "DoRA weight norm"
    LOSS_BACKWARD = "loss backward"
    FINAL_NORM_BACKWARD = "final norm backward"
    FIRST_BLOCK_BACKWARD = "first block backward"
    SECOND_BLOCK_BACKWARD = "second block backward"
    FLAT_GRADIENT = "flat gradient"
    """FSDP1: the first block's weight gradients concatenated into its flat gradient (memfit.estimate.fsdp1)."""
    END_OF_BACKWARD = "end of backward"
    EMBEDDING_GRADIENT = "embedding gradient"
    ROOT_REDUCE = "root reduce-scatter"
    HEAD_STEP = "head step"
    """Optimizer in backward: the LM head's own step, right after its matmul backward."""
    EMBEDDING_STEP = "embedding step"
    OPTIMIZER_STEP = "optimizer step"
    # checkpointed LoRA steps (memfit.estimate.lora_checkpoint): a block's recompute and its frozen MLP's backward
    FIRST_BLOCK_RECOMPUTE_DEQUANTIZING = "first block recompute, dequantizing"
    FIRST_BLOCK_MLP_INPUT_GRADIENT = "first block MLP input gradient"
    BLOCK0_MLP_INPUT_GRADIENT = "block 0 MLP input gradient"
    FIRST_BLOCK_MLP_BACKWARD = "first block MLP backward"
    BLOCK0_MLP_BACKWARD = "block 0 MLP backward"
    FIRST_BLOCK_ATTENTION_RECOMPUTE = "first block attention recompute"
    BLOCK0_ATTENTION_RECOMPUTE = "block 0 attention recompute"

    @property
    def phase(self) -> Phase:
        if self in (MomentKey.FORWARD_END, MomentKey.LOSS_FORWARD, MomentKey.DORA_WEIGHT_NORM):
            return Phase.FORWARD
        return Phase.OPTIMIZER if self is MomentKey.OPTIMIZER_STEP else Phase.BACKWARD


class Moment(NamedTuple):
    """One moment: its phase and the terms alive (a pair, so `phase, terms = moment`)."""

    phase: Phase
    terms: list[Term]

    @property
    def total(self) -> int:
        return sum(t.num_bytes for t in self.terms)

    def holds(self, key: TermKey) -> bool:
        return any(t.name == key for t in self.terms)


def _key(name: str) -> MomentKey | str:
    return MomentKey(name) if name in MomentKey._value2member_map_ else name


@dataclass(frozen=True)
class AddBeside:
    """Add `term` to every moment that holds a `beside` term (float8's backward, ring attention beside a block's
    backward; ZeRO-3's frozen-head input beside the head's saved tensors)."""

    term: Term
    beside: TermKey

    def __call__(self, moment: Moment) -> Moment:
        return Moment(moment.phase, moment.terms + [self.term]) if moment.holds(self.beside) else moment


@dataclass(frozen=True)
class ShrinkBeside:
    """Shrink every `target` term by `num_bytes` (not below zero), `note` added to its formula, in the moments that
    hold a `beside` term (ZeRO-3 releases a recomputed block's frozen parameters)."""

    target: TermKey
    beside: TermKey
    num_bytes: int
    note: str

    def __call__(self, moment: Moment) -> Moment:
        if not moment.holds(self.beside):
            return moment
        return Moment(moment.phase, [replace(t, num_bytes=max(t.num_bytes - self.num_bytes, 0),
                                             formula=t.formula + self.note) if t.name == self.target else t
                                     for t in moment.terms])


StepChange = AddBeside | ShrinkBeside


@dataclass
class StepMoments:
    """The step's moments, in the order they were built."""

    moments: dict[MomentKey | str, Moment] = field(default_factory=dict)

    @classmethod
    def of(cls, pairs: Mapping[str, tuple[Phase, list[Term]]]) -> StepMoments:
        out = cls()
        out.update(pairs)
        return out

    def set(self, key: MomentKey, terms: list[Term]) -> None:
        self.moments[key] = Moment(key.phase, list(terms))

    def put(self, label: str, phase: Phase, terms: list[Term]) -> None:
        """A moment named by its label (a pipeline rank's '<backward>, <what>', a stacked model's stack): the
        escape for moments that are no MomentKey."""
        self.moments[_key(label)] = Moment(phase, list(terms))

    def update(self, pairs: Mapping[str, tuple[Phase, list[Term]]]) -> None:
        """Add or replace moments given as name -> (phase, terms) (memfit.estimate.lora_checkpoint's, a stacked
        model's); a replaced moment keeps its place."""
        for name, (phase, terms) in pairs.items():
            self.moments[_key(name)] = Moment(phase, list(terms))

    def __getitem__(self, key: str) -> Moment:
        return self.moments[key]

    def __contains__(self, key: str) -> bool:
        return key in self.moments

    def __iter__(self) -> Iterator[MomentKey | str]:
        return iter(self.moments)

    def items(self):
        return self.moments.items()

    def map(self, fn: Callable[[Moment], Moment]) -> StepMoments:
        return StepMoments({k: fn(m) for k, m in self.moments.items()})

    def apply(self, changes: Iterable[StepChange]) -> StepMoments:
        """Every technique's typed change, in the order given."""
        out = self
        for change in changes:
            out = out.map(change)
        return out

    def phase_peaks(self) -> dict[Phase, int]:
        """The largest moment total of each phase that has a moment."""
        return {phase: max(m.total for m in self.moments.values() if m.phase is phase)
                for phase in Phase if any(m.phase is phase for m in self.moments.values())}

    def peak_key(self) -> MomentKey | str:
        """The key of the moment with the largest total (the first of equal ones)."""
        return max(self.moments, key=lambda k: self.moments[k].total)

    def peak(self) -> Moment:
        return self.moments[self.peak_key()]


__all__ = ["AddBeside", "Moment", "MomentKey", "ShrinkBeside", "StepChange", "StepMoments"]

"""What only a trace can tell the estimator, handed down to it: where a derived model's fits, a compiled block's
fits and a stacked model's moments come from.

The estimator sizes a family without formulas from fitted lines (memfit.derive.model.DerivedModel) and a compiled
block from the partitioner's fit (memfit.estimate.compiled); reading them from the shipped data or the disk cache,
or tracing them on a miss, is the model layer's work (memfit.derive: the cache, the tracer; memfit.sources: the HF
config). So the estimator imports nothing above it: the model layer registers its sources here, and memfit.derive
does it when it is imported. A package's __init__ runs before any module in it, so it has run before a DerivedModel
or memfit.estimate.compiled (which imports memfit.derive.model) exists.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import MemfitError


class DerivedFits(Protocol):
    def __call__(self, config: dict[str, Any], kind: str, *, label: str = "") -> tuple[Any, str]:
        """(the KindFit of `kind` for the HF `config`, where it was found): shipped, cached or traced now."""


class CompiledFits(Protocol):
    """memfit.derive.compiled: the HF config of a spec, and a compiled block's fitted lines by group."""

    def model_config(self, spec: Any) -> dict[str, Any]: ...

    def fit_ready(self, config: dict[str, Any], kind: str) -> bool: ...

    def block_fit(self, config: dict[str, Any], kind: str) -> dict[str, Any]: ...


class StackedMoments(Protocol):
    """memfit.derive.stacks_estimate: the moments of a model of several stacks (encoder-decoder, vision tower)."""

    def is_stacked(self, spec: Any, setup: Any) -> bool: ...

    def moments(self, spec: Any, setup: Any, static: Any, step_temp: int, on_cpu: bool) -> Any: ...


_PROVIDED: dict[str, Any] = {}


def provide(*, derived: DerivedFits, compiled: CompiledFits, stacked: StackedMoments) -> None:
    """Register where fits come from (memfit.derive's __init__ does, with its cache and tracer)."""
    _PROVIDED.update(derived=derived, compiled=compiled, stacked=stacked)


def _provided(name: str) -> Any:
    if name not in _PROVIDED:  # only a process that never imported memfit.derive: a bug, not a user's input
        raise MemfitError(f"no source of {name} fits registered: import memfit.derive first")
    return _PROVIDED[name]


def derived(config: dict[str, Any], kind: str, *, label: str = "") -> tuple[Any, str]:
    return _provided("derived")(config, kind, label=label)


def compiled() -> CompiledFits:
    return _provided("compiled")


def stacked() -> StackedMoments:
    return _provided("stacked")

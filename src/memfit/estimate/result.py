"""The one result type shared by the analytic estimate, the fake-tensor trace and a measured step."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..setup import TrainingSetup


class Category(str, Enum):
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    OVERHEAD = "overhead"

    def __str__(self) -> str:
        return self.value

    @property
    def is_static(self) -> bool:
        """The seed's 'static memory': parameters + gradients + optimizer states."""
        return self in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER)


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Term:
    """One named piece of the per-device peak, e.g. 'activations/attention'."""

    name: str
    category: Category
    num_bytes: int
    formula: str = ""
    source: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "category": self.category.value, "bytes": self.num_bytes,
                "formula": self.formula, "source": self.source}


@dataclass(frozen=True)
class TimelinePoint:
    """Live bytes by category at one moment of a traced or measured step."""

    index: int
    phase: Phase
    by_category: dict[Category, int]
    label: str = ""

    @property
    def total(self) -> int:
        return sum(self.by_category.values())


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory at the peak of one training step, as named terms that add up to the total."""

    terms: tuple[Term, ...]
    peak_phase: Phase
    method: str
    """'analytic', 'traced' or 'measured'."""
    setup: TrainingSetup | None = None
    phase_peaks: dict[Phase, int] = field(default_factory=dict)
    """Tensor bytes at the peak of each phase (without runtime overhead)."""
    cpu_bytes: int = 0
    """Host memory the step needs (offloaded optimizer states / parameters)."""
    notes: tuple[str, ...] = ()
    """Where the modelled reality differs from the rule of thumb, limits of the model, assumptions."""
    timeline: tuple[TimelinePoint, ...] = ()
    top_modules: tuple[tuple[str, int], ...] = ()
    """(module name, activation bytes it saved for backward), largest first; from traces."""
    model_name: str = ""
    device_name: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(t.num_bytes for t in self.terms)

    @property
    def tensor_bytes(self) -> int:
        """Everything but the runtime overhead: what torch.cuda.max_memory_allocated would report."""
        return sum(t.num_bytes for t in self.terms if t.category is not Category.OVERHEAD)

    def by_category(self) -> dict[Category, int]:
        totals = {c: 0 for c in Category}
        for term in self.terms:
            totals[term.category] += term.num_bytes
        return totals

    @property
    def static_bytes(self) -> int:
        return sum(v for c, v in self.by_category().items() if c.is_static)

    @property
    def activation_bytes(self) -> int:
        cats = self.by_category()
        return cats[Category.ACTIVATIONS] + cats[Category.TEMPORARIES]

    def term(self, name: str) -> Term:
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "model": self.model_name,
            "device": self.device_name,
            "total_bytes": self.total_bytes,
            "tensor_bytes": self.tensor_bytes,
            "peak_phase": self.peak_phase.value,
            "by_category": {c.value: v for c, v in self.by_category().items()},
            "terms": [t.to_dict() for t in self.terms],
            "phase_peaks": {p.value: v for p, v in self.phase_peaks.items()},
            "cpu_bytes": self.cpu_bytes,
            "notes": list(self.notes),
            "setup": self.setup.to_dict() if self.setup else None,
            "top_modules": [{"module": m, "bytes": b} for m, b in self.top_modules],
            "timeline": [{"index": p.index, "phase": p.phase.value, "label": p.label,
                          "by_category": {c.value: v for c, v in p.by_category.items()}} for p in self.timeline],
        }

"""The one result type shared by the analytic estimate, the fake-tensor trace and a measured step."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from ..setup import TrainingSetup
from .terms import Category, TermKey


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Term:
    """One named piece of the per-device peak, e.g. 'activations/attention' (TermKey.ATTENTION)."""

    name: TermKey | str
    """A TermKey; a plain string only for a stacked model's per-stack term (memfit.estimate.terms.stack_blocks)."""
    category: Category
    num_bytes: int
    formula: str = ""
    source: str = ""
    figure: str = ""
    """Which device figure the term first counts in: 'allocated' (tensors, the allocator's rounding, kernel
    workspaces), 'reserved' (segments cached beyond the allocated peak) or 'outside' (the allocator: CUDA context,
    NCCL, a paged optimizer's unified-memory states). Empty: 'allocated' for tensor categories, by name for overhead terms (see `device_figure`)."""
    at_limit: int | Callable[[], int] | None = field(default=None, compare=False)
    """The allocator reserve only: the least of it the step runs with when the device is full (the allocator frees
    its cached segments and retries before it raises OOM; memfit.estimate.allocator.least_capacity). None: not
    known, `num_bytes` is taken. A callable computes it on first use (the capacity search replays the step a dozen
    times, and only a verdict near the limit needs it): read it with `at_limit_bytes`. Not serialized: a figure for
    the fits verdict (memfit.diagnose), not a term."""

    def __post_init__(self) -> None:
        # a name given as its text (a measured step's keys, code not yet on TermKey) becomes its member, so an
        # unknown name is the only plain string left (tests/estimate/test_term_keys.py)
        if type(self.name) is str and self.name in _KEYS:
            object.__setattr__(self, "name", _KEYS[self.name])

    def at_limit_bytes(self) -> int | None:
        """`at_limit`, computed if it is still a callable (memfit.estimate.device caches the search)."""
        return self.at_limit() if callable(self.at_limit) else self.at_limit

    @property
    def device_figure(self) -> str:
        if self.figure:
            return self.figure
        if self.category is not Category.OVERHEAD:
            return "allocated"
        return _OVERHEAD_FIGURES.get(self.name, "outside")

    def to_dict(self) -> dict:
        return {"name": self.name, "category": self.category.value, "bytes": self.num_bytes,
                "formula": self.formula, "source": self.source, "figure": self.device_figure}


_KEYS: dict[str, TermKey] = {k.value: k for k in TermKey}
_OVERHEAD_FIGURES = {TermKey.ALLOCATOR_RESERVE: "reserved", TermKey.ALLOCATOR_ROUNDING: "allocated",
                     TermKey.CUBLAS_WORKSPACE: "allocated", TermKey.ONEDNN_SCRATCH: "allocated"}
"""Overhead terms without an explicit figure (a measured step's reserve: max_memory_reserved - allocated)."""

DEVICE_FIGURES = ("allocated", "reserved", "device_used")
FIGURE_METRICS = {
    "allocated": "torch.cuda.max_memory_allocated: tensors + allocator rounding + kernel workspaces",
    "reserved": "torch.cuda.max_memory_reserved: allocated + segments the caching allocator holds unused",
    "device_used": "nvidia-smi / NVML used: reserved + CUDA context + NCCL buffers (outside the allocator)",
}


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
    moe: dict | None = None
    """MoE models: the routing assumption and the named best / worst figures (memfit.estimate.moe.routing_range)."""

    @property
    def total_bytes(self) -> int:
        return sum(t.num_bytes for t in self.terms)

    @property
    def tensor_bytes(self) -> int:
        """Everything but the runtime overhead: what torch.cuda.max_memory_allocated would report (tensors outside
        the allocator, a paged optimizer's unified-memory states, are not in it)."""
        return sum(t.num_bytes for t in self.terms if t.category is not Category.OVERHEAD
                   and t.device_figure == "allocated")

    def _figure_bytes(self, figure: str) -> int:
        return sum(t.num_bytes for t in self.terms if t.device_figure == figure)

    @property
    def allocated_bytes(self) -> int:
        """Predicted torch.cuda.max_memory_allocated: tensor bytes + the allocator's rounding + workspaces."""
        return self._figure_bytes("allocated")

    @property
    def reserved_bytes(self) -> int:
        """Predicted torch.cuda.max_memory_reserved: allocated + what the caching allocator holds beyond it."""
        return self.allocated_bytes + self._figure_bytes("reserved")

    @property
    def outside_allocator_bytes(self) -> int:
        """CUDA context, NCCL buffers, paged optimizer states: device memory PyTorch's allocator statistics never
        see."""
        return self._figure_bytes("outside")

    @property
    def device_used_bytes(self) -> int:
        """Predicted nvidia-smi / NVML 'used' for this process: reserved + outside the allocator (= total_bytes).
        What a CUDA OOM is decided on: reserved segments and the runtime's own memory share the device."""
        return self.reserved_bytes + self.outside_allocator_bytes

    def device_figures(self) -> dict[str, int]:
        """The three labelled figures: allocated <= reserved <= device_used."""
        return {"allocated": self.allocated_bytes, "reserved": self.reserved_bytes,
                "device_used": self.device_used_bytes}

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

    def term(self, name: TermKey | str) -> Term:
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
            "device_memory": {**self.device_figures(), "outside_allocator": self.outside_allocator_bytes,
                       "metrics": dict(FIGURE_METRICS)},
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
            **({"moe": self.moe} if self.moe is not None else {}),
        }

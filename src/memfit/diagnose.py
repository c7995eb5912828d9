"""Diagnose an estimate in the seed's terms: static memory, activation memory, both, or it fits."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .estimate.result import Category, MemoryEstimate
from .estimate.terms import TermKey
from .hardware import Hardware
from .units import format_bytes

DEFAULT_MARGIN = 0.05
"""Fraction of the device memory kept free: kernels' workspaces, allocator spikes, the unmodelled."""


class Bottleneck(str, Enum):
    FITS = "fits"
    STATIC = "static"
    ACTIVATIONS = "activations"
    BOTH = "both"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Diagnosis:
    bottleneck: Bottleneck
    capacity_bytes: int
    budget_bytes: int
    """capacity x (1 - margin): what the plan must stay under."""
    required_bytes: int
    static_bytes: int
    """Parameters + gradients + optimizer states + the runtime's fixed overhead (static_floor_bytes)."""
    activation_bytes: int
    """Activations + temporaries at the peak."""
    margin: float
    cache_bytes: int = 0
    """The caching allocator's reserve and rounding: they follow the whole step's allocations, activations
    included, so they are neither static nor activation memory."""
    allocated_bytes: int = 0
    """Predicted torch.cuda.max_memory_allocated."""
    reserved_bytes: int = 0
    """Predicted torch.cuda.max_memory_reserved: what the caching allocator holds."""
    outside_allocator_bytes: int = 0
    """CUDA context and NCCL buffers (and paged optimizer states). `required_bytes` = reserved + this, less what
    the driver can evict: the figure a CUDA OOM is decided on."""
    evictable_bytes: int = 0
    """Paged optimizer states (CUDA unified memory): on the device while resident, but evicted to host RAM when a
    device allocation needs the room (bitsandbytes paged optimizers; QLoRA, Dettmers et al. 2023 sec. 3), so
    they slow a step down instead of making it OOM. Not in `required_bytes`."""
    at_limit_bytes: int = 0
    """The least the step runs with when the device is full: the allocator's least reserve at the limit + outside,
    less evictable (the verdict's figure; shown in `to_dict` only when it decides). Searched only when the verdict
    hangs on it; elsewhere the required figure."""
    with_room_bytes: int = 0
    """Set only when the step fits because the allocator frees its cache before it raises OOM: what it would hold
    with room to spare (reserved + outside, less evictable), over the budget; `required_bytes` is then the figure
    at the limit."""

    @property
    def fits_by_retry(self) -> bool:
        """The step fits only because a failed cudaMalloc makes the caching allocator free its cached segments and
        retry: near the limit it runs with less reserved than it holds with room to spare."""
        return self.with_room_bytes > 0

    @property
    def headroom_bytes(self) -> int:
        """Budget left (negative: over by this much)."""
        return self.budget_bytes - self.required_bytes

    @property
    def fits(self) -> bool:
        return self.bottleneck is Bottleneck.FITS

    def summary(self) -> str:
        need, budget = format_bytes(self.required_bytes), format_bytes(self.budget_bytes)
        paged = (f"; {format_bytes(self.evictable_bytes)} of paged optimizer states come on top while they fit and "
                 "are paged to host RAM when they do not") if self.evictable_bytes else ""
        if self.fits:
            retry = (f"; it reserves {format_bytes(self.with_room_bytes)} when there is room, and near the limit the "
                     "caching allocator frees its cached segments and retries before an out-of-memory error"
                     ) if self.fits_by_retry else ""
            return (f"fits: needs {need} of {budget} usable ({format_bytes(self.headroom_bytes)} headroom)"
                    + retry + paged)
        over = format_bytes(-self.headroom_bytes)
        what = {Bottleneck.STATIC: "static memory (parameters + gradients + optimizer states)",
                Bottleneck.ACTIVATIONS: "activation memory",
                Bottleneck.BOTH: "both static and activation memory"}[self.bottleneck]
        return (f"does not fit: needs {need} of {budget} usable (over by {over}); the bottleneck is {what}; "
                f"{self.what_to_cut()}" + paged)

    def what_to_cut(self) -> str:
        """What a change must cut for the step to fit, in the seed's two components: static memory first while it
        alone is over the budget (no activation saving can help then), else whichever of the two can close the gap
        alone (the activations, or static memory, by the amount over)."""
        over = -self.headroom_bytes
        if over <= 0:
            return ""
        static, activ = format_bytes(self.static_bytes), format_bytes(self.activation_bytes)
        if self.static_bytes >= self.budget_bytes:
            return (f"static memory alone ({static}) is over the budget: cut it by at least "
                    f"{format_bytes(self.static_bytes - self.budget_bytes)} first, as no activation saving can")
        can = [f"activations ({activ})" if self.activation_bytes >= over else None,
               f"static memory ({static})" if self.static_bytes >= over else None]
        can = [c for c in can if c]
        if not can:
            return f"static memory ({static}) and activations ({activ}) together must shrink by {format_bytes(over)}"
        return f"cutting {' or '.join(can)} by {format_bytes(over)} makes it fit"

    def to_dict(self) -> dict:
        return {"bottleneck": self.bottleneck.value, "capacity_bytes": self.capacity_bytes,
                "budget_bytes": self.budget_bytes, "required_bytes": self.required_bytes,
                "headroom_bytes": self.headroom_bytes, "static_bytes": self.static_bytes,
                "activation_bytes": self.activation_bytes, "cache_bytes": self.cache_bytes, "margin": self.margin,
                "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "outside_allocator_bytes": self.outside_allocator_bytes, "evictable_bytes": self.evictable_bytes,
                "required_is": "reserved + outside the allocator (device used), less evictable paged states",
                **({"required_is": "the least reserve the step runs with at the limit (the caching allocator frees "
                                   "its cached segments and retries before an OOM) + outside the allocator, less "
                                   "evictable paged states",
                    "with_room_bytes": self.with_room_bytes} if self.fits_by_retry else {})}


PAGED_STATES = TermKey.PAGED_STATES
"""The term of paged optimizer states (memfit.estimate.analytic), evictable by the driver."""


def static_floor_bytes(estimate: MemoryEstimate) -> int:
    """Static memory: what no activation saving can shrink. Parameters, gradients, optimizer states and the
    runtime's fixed overhead (CUDA context, cuBLAS workspaces, NCCL); not the allocator's reserve and rounding,
    which follow the whole step's allocations, activations included (memfit.estimate.device)."""
    fixed = sum(t.num_bytes for t in estimate.terms if t.category is Category.OVERHEAD
                and t.name not in (TermKey.ALLOCATOR_RESERVE, TermKey.ALLOCATOR_ROUNDING))
    return estimate.static_bytes + fixed


def cache_freed_at_limit(estimate: MemoryEstimate) -> int:
    """Bytes of the allocator's reserve that a full device takes back: the reserve with room less the least the
    step runs with (Term.at_limit of the reserve terms, memfit.estimate.allocator.least_capacity)."""
    return sum(t.num_bytes - max(0, min(t.at_limit_bytes(), t.num_bytes)) for t in estimate.terms
               if t.name == TermKey.ALLOCATOR_RESERVE and t.at_limit is not None)


def _reserve_bytes(estimate: MemoryEstimate) -> int:
    """The most a full device could take back: the whole reserve with room (the at-limit figure's lower bound)."""
    return sum(t.num_bytes for t in estimate.terms if t.name == TermKey.ALLOCATOR_RESERVE and t.at_limit is not None)


def diagnose(estimate: MemoryEstimate, hardware: Hardware, *, margin: float = DEFAULT_MARGIN) -> Diagnosis:
    """The step fits when what it holds on the device stays within the budget: the caching allocator's reserved
    segments + the memory outside it (CUDA context, NCCL), i.e. the predicted device-used figure; allocated alone
    would miss the cache that makes a real step OOM. Over the budget with that figure, it still fits when the
    least reserve it runs with at the limit does: a failed cudaMalloc makes the allocator free every cached
    segment with no block in use and retry (CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc:
    release_available_cached_blocks, release_cached_blocks), so only the segments live blocks keep (split,
    partly in use) and the rounding count then (memfit.estimate.allocator.least_capacity).

    A component is a bottleneck when it alone takes more than half of the budget: then no change to the other
    can make the step fit. Over budget, at least one of the two always does."""
    static = static_floor_bytes(estimate)
    activ = estimate.activation_bytes
    cache = estimate.by_category()[Category.OVERHEAD] - (static - estimate.static_bytes)
    capacity = hardware.gpu.memory_bytes
    budget = int(capacity * (1 - margin))
    reserved, outside = estimate.reserved_bytes, estimate.outside_allocator_bytes
    evictable = sum(t.num_bytes for t in estimate.terms if t.name == PAGED_STATES)
    required = reserved + outside - evictable
    with_room = 0
    # the least reserve at the limit is searched only where the verdict hangs on it: over the budget with room,
    # within it were the whole reserve taken back (else the figure at the limit is the required one)
    borderline = required > budget >= required - _reserve_bytes(estimate)
    at_limit = required - cache_freed_at_limit(estimate) if borderline else required
    if required > budget >= at_limit:
        with_room, required = required, at_limit
    if required <= budget:
        bottleneck = Bottleneck.FITS
    else:
        static_heavy, act_heavy = static > budget / 2, activ > budget / 2
        bottleneck = (Bottleneck.BOTH if static_heavy and act_heavy else
                      Bottleneck.STATIC if static_heavy else Bottleneck.ACTIVATIONS)
    return Diagnosis(bottleneck=bottleneck, capacity_bytes=capacity, budget_bytes=budget, required_bytes=required,
                     static_bytes=static, activation_bytes=activ, margin=margin, cache_bytes=cache,
                     allocated_bytes=estimate.allocated_bytes, reserved_bytes=reserved, outside_allocator_bytes=outside,
                     evictable_bytes=evictable, at_limit_bytes=at_limit, with_room_bytes=with_room)

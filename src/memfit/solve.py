"""Solve for the most that fits: the largest micro-batch, the longest sequence, the fewest GPUs, the cheapest catalog
GPU, and a sweep of sequence length x micro-batch x method.

Every answer comes from a search over an estimator (`(spec, setup, hardware) -> MemoryEstimate`, the analytic model
by default), exact to the step searched in: the answer fits and the next candidate does not, both sized with the same
estimator and kept in the result. With `with_ladder=True` a candidate counts as fitting when `memfit.plan.plan`
makes it fit (the searched field pinned, so the ladder cannot change it); the plan's final setup is the answer's.

Pure and torch-free: results are dataclasses with `to_dict()`, and the sweep renders itself as CSV and Markdown.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from .errors import ConfigError
from .finetune import ALL_LINEAR, Finetune
from .finetune import Method as FinetuneMethod
from .estimate.analytic import estimate
from .estimate.result import MemoryEstimate
from .hardware import GPU, Hardware, check_precision, gpu_catalog
from .model_spec import ModelSpec
from .search import GPUS_PER_NODE, MAX_GPUS, gpus_to_fit, scaled_out
from .setup import FIELD_LABELS, Checkpointing, Optimizer, Precision, Sharding, TrainingSetup
from .units import GiB, format_bytes

EstimateFn = Callable[[ModelSpec, TrainingSetup, Hardware], MemoryEstimate]

MAX_BATCH = 65_536
"""The largest micro-batch searched (no real step reaches it)."""
MAX_SEQ = 16 * 1024 * 1024
"""The longest sequence searched when the model states no context length."""
DEFAULT_SEQ_STEP = 64
GPU_ORDER = ("by memory, smallest first: the GPU catalog (data/gpus.json) has no prices, so the smallest-memory GPU "
             "that fits stands in for the cheapest")
METHODS_NOTE = ("LoRA / QLoRA columns: peft adapters in fp32 on a frozen bf16 base (LoRA) or a bitsandbytes NF4 base "
                "with double quantization (QLoRA), embeddings, head and norms unquantized and in fp32 as "
                "prepare_model_for_kbit_training leaves them")


# ----------------------------------------------------------------------------------------------------- one candidate


@dataclass(frozen=True)
class Point:
    """One sized candidate: the setup as searched, and (with the ladder) the setup the plan ended on."""

    value: int | str
    """The searched quantity's value here (a GPU count, a micro-batch, a sequence length, a GPU name)."""
    setup: TrainingSetup
    """What was sized: the candidate itself, or the ladder's final setup for it."""
    hardware: Hardware
    estimate: MemoryEstimate
    diagnosis: Diagnosis
    changes: tuple[str, ...] = ()
    """The ladder's steps that the plan took for this candidate (with_ladder only)."""

    @property
    def fits(self) -> bool:
        return self.diagnosis.fits

    @property
    def total_bytes(self) -> int:
        return self.estimate.total_bytes

    def text(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        return (f"{verdict}: needs {format_bytes(self.total_bytes)} of {format_bytes(self.diagnosis.budget_bytes)} "
                "usable")

    def to_dict(self) -> dict:
        return {"value": self.value, "fits": self.fits, "total_bytes": self.total_bytes,
                "budget_bytes": self.diagnosis.budget_bytes, "headroom_bytes": self.diagnosis.headroom_bytes,
                "bottleneck": self.diagnosis.bottleneck.value, "gpu": self.hardware.gpu.name,
                "world_size": self.hardware.world_size, "ladder_changes": list(self.changes),
                "setup": self.setup.to_dict(), "estimate": self.estimate.to_dict()}


class _Sizer:
    """Sizes candidates with one estimator, margin and ladder policy, each candidate once."""

    def __init__(self, spec: ModelSpec, *, margin: float, estimator: EstimateFn, with_ladder: bool,
                 explicit: frozenset[str], keep: frozenset[str]) -> None:
        self.spec, self.margin, self.estimator = spec, margin, estimator
        self.with_ladder, self.explicit, self.keep = with_ladder, explicit, keep
        self.cache: dict[tuple, Point] = {}

    def __call__(self, value: int | str, setup: TrainingSetup, hardware: Hardware) -> Point:
        key = (setup, hardware)
        if key not in self.cache:
            self.cache[key] = self._size(value, setup, hardware)
        return self.cache[key]

    def _size(self, value: int | str, setup: TrainingSetup, hardware: Hardware) -> Point:
        if not self.with_ladder:
            est = self.estimator(self.spec, setup, hardware)
            return Point(value, setup, hardware, est, diagnose(est, hardware, margin=self.margin))
        from .plan import plan

        result = plan(self.spec, setup, hardware, margin=self.margin, estimator=self.estimator,
                      explicit=self.explicit - self.keep, keep=self.keep)
        return Point(value, result.final_setup, hardware, result.final_estimate, result.final_diagnosis,
                     tuple(step.title for step in result.steps))

    @property
    def evaluations(self) -> int:
        return len(self.cache)


def _held_fixed(setup: TrainingSetup, hardware: Hardware, margin: float, *searched: str,
                with_ladder: bool = False) -> dict[str, Any]:
    """What a search did not vary: the setup's fields (not with the ladder, which may change them: then only the
    searched field is pinned), the GPU and the margin."""
    held = {} if with_ladder else {name: value for name, value in setup.to_dict().items()
                                   if name != "notes" and name not in searched}
    if "gpu" not in searched:
        held["gpu"] = hardware.gpu.name
    if with_ladder and "num_gpus" not in searched:
        held["num_gpus"] = setup.num_gpus
    held["margin"] = margin
    return held


def _start(setup: TrainingSetup, *searched: str) -> dict[str, Any]:
    return {name: value for name, value in setup.to_dict().items() if name != "notes" and name not in searched}


def describe_held(held: dict[str, Any]) -> str:
    """'micro-batch 8, seq 2048, ..., GPU H100-80GB': what a result held fixed, for one sentence. Fields at
    TrainingSetup's default that do not shape a plain step (no pipeline, no float8, ...) are left out, and the
    fine-tuning method reads as the plan prints it ('full', 'qlora r=16')."""
    labels = {**FIELD_LABELS, "gpu": "GPU", "margin": "margin"}
    defaults = TrainingSetup().to_dict()
    parts = []
    for name, value in held.items():
        if name not in _ALWAYS_SAID and name in defaults and value == defaults[name]:
            continue
        if name == "finetune" and isinstance(value, dict):
            value = Finetune(**value)  # printed as the plan prints it ('full', 'qlora r=16')
        parts.append(f"{labels.get(name, name)} {value}")
    return ", ".join(parts)


_ALWAYS_SAID = frozenset({"micro_batch_size", "seq_len", "grad_accum_steps", "precision", "optimizer", "checkpointing",
                          "sharding", "engine", "finetune", "num_gpus"})
"""The fields a "held fixed" sentence always names: those that decide most of a step's memory."""


# ------------------------------------------------------------------------------------- largest batch / longest seq


@dataclass(frozen=True)
class Largest:
    """The largest value of one setup field (micro-batch or sequence length) that fits, exact to `step`."""

    field: str
    """'micro_batch_size' or 'seq_len'."""
    value: int | None
    """None: not even the smallest candidate fits."""
    step: int
    """Candidates are the multiples of `step` up to `limit`."""
    limit: int
    best: Point | None
    """The answer, sized."""
    beyond: Point | None
    """value + step (or the smallest candidate when nothing fits), sized: it does not fit. None when `value` is
    the limit."""
    held_fixed: dict[str, Any]
    with_ladder: bool
    evaluations: int
    notes: tuple[str, ...] = ()
    start: dict[str, Any] = field(default_factory=dict)
    """The setup the search started from (the searched field aside); with the ladder, what the plan began with."""

    @property
    def fits(self) -> bool:
        return self.value is not None

    @property
    def limited_by(self) -> str:
        """'memory', or 'limit' when the largest candidate searched still fits."""
        return "limit" if self.value is not None and self.beyond is None else "memory"

    @property
    def label(self) -> str:
        return FIELD_LABELS[self.field]

    def text(self) -> str:
        how = " with the ladder's changes" if self.with_ladder else ""
        if self.value is None:
            return (f"no {self.label} fits{how}: {self.label} {self.beyond.value} "
                    f"{self.beyond.text()}")
        head = f"largest {self.label} that fits{how}: {self.value} ({self.best.text()}"
        if self.beyond is None:
            return head + f"; the search stops at {self.limit}, so memory is not the limit)"
        return head + f"; {self.label} {self.beyond.value} {self.beyond.text()})"

    def to_dict(self) -> dict:
        return {"field": self.field, "value": self.value, "fits": self.fits, "step": self.step, "limit": self.limit,
                "limited_by": self.limited_by, "with_ladder": self.with_ladder, "held_fixed": self.held_fixed,
                "start": self.start, "evaluations": self.evaluations, "notes": list(self.notes),
                "best": self.best.to_dict() if self.best else None,
                "beyond": self.beyond.to_dict() if self.beyond else None}


def _largest_multiple(fits: Callable[[int], bool], top: int) -> int:
    """The largest k in [1, top] with fits(k), given fits(1) and that fits is monotone (True then False):
    galloping from 1, then bisection between the last k that fits and the first that does not. 0 if not fits(1)."""
    if top < 1 or not fits(1):
        return 0
    good, probe = 1, 2
    while True:
        if probe >= top:
            if fits(top):
                return top
            bad = top
            break
        if not fits(probe):
            bad = probe
            break
        good, probe = probe, probe * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def _largest(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, name: str, *, step: int, limit: int,
             margin: float, estimator: EstimateFn, with_ladder: bool, explicit: frozenset[str] | None,
             fallback_below_step: bool, keep: frozenset[str] = frozenset()) -> Largest:
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"the search step must be a positive whole number, got {step!r}")
    if not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"the search limit must be a positive whole number, got {limit!r}")
    check_precision(setup.precision, hardware.gpu)
    sizer = _Sizer(spec, margin=margin, estimator=estimator, with_ladder=with_ladder,
                   explicit=frozenset(explicit or ()), keep=frozenset(keep) | {name})
    notes: list[str] = []
    held = _held_fixed(setup, hardware, margin, name, with_ladder=with_ladder)

    def point(value: int) -> Point:
        return sizer(value, setup.replace(**{name: value}), hardware)

    def search(step: int, top_value: int) -> int:
        return _largest_multiple(lambda k: point(k * step).fits, top_value // step) * step

    top = limit // step * step
    if top < step:
        step, top = 1, limit
    value = search(step, top)
    if not value and fallback_below_step and step > 1:
        notes.append(f"{FIELD_LABELS[name]} {step} does not fit, so the search went on below it in steps of 1")
        first_fail = point(step)
        step, top = 1, step - 1
        value = search(1, top)
        if not value:
            return Largest(name, None, 1, limit, None, point(1), held,
                           with_ladder, sizer.evaluations, tuple(notes), _start(setup, name))
        beyond = point(value + 1) if value + 1 < first_fail.value else first_fail
        return Largest(name, value, 1, limit, point(value), beyond, held,
                       with_ladder, sizer.evaluations, tuple(notes), _start(setup, name))
    if not value:
        return Largest(name, None, step, limit, None, point(step), held,
                       with_ladder, sizer.evaluations, tuple(notes), _start(setup, name))
    best = point(value)
    beyond = point(value + step) if value + step <= limit else None
    if beyond is not None and beyond.fits:  # cannot happen for a monotone quantity; say so rather than hide it
        notes.append(f"{FIELD_LABELS[name]} {beyond.value} fits too: memory is not monotone in it here")
    return Largest(name, value, step, limit, best, beyond, held, with_ladder,
                   sizer.evaluations, tuple(notes), _start(setup, name))


def max_micro_batch(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
                    estimator: EstimateFn = estimate, with_ladder: bool = False, step: int = 1,
                    limit: int = MAX_BATCH, explicit: frozenset[str] | None = None,
                    keep: frozenset[str] = frozenset()) -> Largest:
    """The largest micro-batch (a multiple of `step`) with which `setup` fits; every other field held fixed
    (accumulation included). `with_ladder`: with the plan's changes, micro-batch and the fields in `keep` pinned."""
    return _largest(spec, setup, hardware, "micro_batch_size", step=step, limit=limit, margin=margin,
                    estimator=estimator, with_ladder=with_ladder, explicit=explicit, fallback_below_step=False,
                    keep=keep)


def max_seq_len(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
                estimator: EstimateFn = estimate, with_ladder: bool = False, step: int = DEFAULT_SEQ_STEP,
                limit: int | None = None, explicit: frozenset[str] | None = None,
                keep: frozenset[str] = frozenset()) -> Largest:
    """The longest sequence (a multiple of `step`, 64 by default; 1 for exact) with which `setup` fits. The search
    stops at `limit`, by default the model's context (max_position_embeddings). When not even `step` tokens fit,
    it goes on below in steps of 1."""
    context = spec.max_position_embeddings
    result = _largest(spec, setup, hardware, "seq_len", step=step, limit=limit or context or MAX_SEQ, margin=margin,
                      estimator=estimator, with_ladder=with_ladder, explicit=explicit, fallback_below_step=True,
                      keep=keep)
    if limit is None and context and result.limited_by == "limit":
        result = dataclasses.replace(result, notes=result.notes + (
            f"stopped at the model's context ({context:,} tokens, max_position_embeddings)",))
    return result


# ------------------------------------------------------------------------------------------------------ fewest GPUs


@dataclass(frozen=True)
class FewestGpus:
    """The fewest GPUs on which the setup fits: 1 as given, then powers of two (8 per node) sharded."""

    value: int | None
    """None: not even on `limit` GPUs."""
    best: Point | None
    below: Point | None
    """The candidate before the answer (it does not fit); None when the answer is 1."""
    searched: tuple[int, ...]
    sharding: str
    """How the counts above 1 shard: the setup's own stage, ZeRO-3 when it has none, or the ladder's choice."""
    held_fixed: dict[str, Any]
    with_ladder: bool
    limit: int
    notes: tuple[str, ...] = ()
    start: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.value is not None

    def text(self) -> str:
        how = " with the ladder's changes" if self.with_ladder else ""
        if self.value is None:
            last = f" (on {self.below.value}: {self.below.text()})" if self.below is not None else ""
            return f"it does not fit{how} on up to {self.limit} x {self.held_fixed['gpu']}{last}"
        head = (f"fewest GPUs{how}: {self.value} x {self.best.hardware.gpu.name} "
                f"({self.best.text()}; {self.sharding}")
        if self.below is None:
            return head + ")"
        return head + f"; on {self.below.value}: {self.below.text()})"

    def to_dict(self) -> dict:
        return {"value": self.value, "fits": self.fits, "searched": list(self.searched), "sharding": self.sharding,
                "with_ladder": self.with_ladder, "limit": self.limit, "held_fixed": self.held_fixed,
                "start": self.start, "notes": list(self.notes), "best": self.best.to_dict() if self.best else None,
                "below": self.below.to_dict() if self.below else None}


def gpu_layout(hardware: Hardware, num_gpus: int) -> Hardware:
    """`hardware` with `num_gpus` GPUs laid out as search.gpus_to_fit lays them out (8 per node)."""
    return dataclasses.replace(hardware, gpus_per_node=min(num_gpus, GPUS_PER_NODE),
                               num_nodes=max(1, num_gpus // GPUS_PER_NODE))


def _on_one_gpu(setup: TrainingSetup) -> TrainingSetup | None:
    try:
        return setup.replace(num_gpus=1, sharding=Sharding.NONE)
    except ConfigError:
        return None


def fewest_gpus(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
                estimator: EstimateFn = estimate, with_ladder: bool = False, limit: int = MAX_GPUS,
                explicit: frozenset[str] | None = None, keep: frozenset[str] = frozenset()) -> FewestGpus:
    """The fewest GPUs of `hardware`'s kind on which `setup` fits. One GPU runs the setup unsharded; above one, the
    counts are powers of two (8 per node) and the setup shards with its own stage, or ZeRO-3 when it has none: the
    same search the plan's "how many GPUs" answer runs (search.gpus_to_fit). `with_ladder`: each count is planned
    (GPU count pinned), and the ladder picks the ZeRO stage."""
    check_precision(setup.precision, hardware.gpu)
    sizer = _Sizer(spec, margin=margin, estimator=estimator, with_ladder=with_ladder,
                   explicit=frozenset(explicit or ()), keep=frozenset(keep) | {"num_gpus"})
    held = _held_fixed(setup, hardware, margin, "num_gpus", "sharding", with_ladder=with_ladder)
    counts = [1] + [2**k for k in range(1, limit.bit_length()) if 2**k <= limit]
    one = _on_one_gpu(setup)
    notes = [] if one is not None else ["1 GPU: not a candidate (this setup needs sharding)"]
    own = setup.sharding is not Sharding.NONE
    if with_ladder:
        sharding = "the ladder chooses the ZeRO stage" + (f" from the setup's {setup.sharding}" if own else "")
    else:
        sharding = (f"the setup's {setup.sharding}" if own else "ZeRO-3, since the setup shards nothing") + \
            " above 1 GPU"

    def candidate(n: int) -> Point | None:
        hw = gpu_layout(hardware, n)
        if n == 1:
            return None if one is None else sizer(1, one, hw)
        cand = setup.replace(num_gpus=n) if with_ladder else scaled_out(
            setup, n, keep=frozenset({"sharding"}) if own else frozenset())
        return None if cand is None else sizer(n, cand, hw)

    def result(value: int | None, best: Point | None, below: Point | None) -> FewestGpus:
        return FewestGpus(value, best, below, tuple(counts), sharding, held, with_ladder, limit, tuple(notes),
                          _start(setup, "num_gpus"))

    first = candidate(1)
    if first is not None and first.fits:
        return result(1, first, None)
    if with_ladder:
        below = first
        for n in counts[1:]:
            here = candidate(n)
            if here is not None and here.fits:
                return result(n, here, below)
            below = here or below
        return result(None, None, below)
    found = gpus_to_fit(spec, setup, gpu_layout(hardware, 1), margin=margin, estimator=estimator,
                        keep=frozenset({"sharding"}) if own else frozenset(), limit=limit)
    if found is None:
        return result(None, None, candidate(counts[-1]) if len(counts) > 1 else first)
    best = sizer(found.num_gpus, found.setup, found.hardware)
    below = first if found.num_gpus == 2 else candidate(found.num_gpus // 2)
    return result(found.num_gpus, best, below)


# ---------------------------------------------------------------------------------------------------- cheapest GPU


@dataclass(frozen=True)
class Rejected:
    gpu: str
    memory_bytes: int
    reason: str
    point: Point | None = None

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "memory_bytes": self.memory_bytes, "reason": self.reason,
                "total_bytes": self.point.total_bytes if self.point else None,
                "budget_bytes": self.point.diagnosis.budget_bytes if self.point else None}


@dataclass(frozen=True)
class CheapestGpu:
    """The first catalog GPU, smallest memory first, on which the setup fits (the hardware's GPU count held)."""

    gpu: GPU | None
    best: Point | None
    rejected: tuple[Rejected, ...]
    """Every GPU before the answer (all of them when nothing fits), and why it was passed over."""
    held_fixed: dict[str, Any]
    with_ladder: bool
    order: str = GPU_ORDER
    evaluations: int = 0
    start: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.gpu is not None

    def text(self) -> str:
        how = " with the ladder's changes" if self.with_ladder else ""
        count = self.held_fixed.get("num_gpus", self.start.get("num_gpus", 1))
        on = f"{count} x " if count > 1 else ""
        if self.gpu is None:
            return f"it fits on no catalog GPU{how} ({on}each of {len(self.rejected)} tried)"
        return (f"smallest GPU that fits{how}: {on}{self.gpu.name} ({format_bytes(self.gpu.memory_bytes)}; "
                f"{self.best.text()}; {len(self.rejected)} smaller ones do not)")

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.name if self.gpu else None,
                "gpu_memory_bytes": self.gpu.memory_bytes if self.gpu else None, "fits": self.fits,
                "order": self.order, "with_ladder": self.with_ladder, "held_fixed": self.held_fixed,
                "start": self.start, "evaluations": self.evaluations,
                "best": self.best.to_dict() if self.best else None,
                "rejected": [r.to_dict() for r in self.rejected]}


def catalog_by_memory(gpus: Iterable[GPU] | None = None) -> list[GPU]:
    """The GPUs smallest memory first (name breaks ties): the order `cheapest_gpu` tries them in."""
    return sorted(gpu_catalog().values() if gpus is None else gpus, key=lambda g: (g.memory_bytes, g.name))


def cheapest_gpu(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
                 estimator: EstimateFn = estimate, with_ladder: bool = False, gpus: Iterable[GPU] | None = None,
                 explicit: frozenset[str] | None = None, keep: frozenset[str] = frozenset()) -> CheapestGpu:
    """The smallest-memory GPU of the catalog (or `gpus`) on which `setup` fits with `hardware`'s GPU count. The
    catalog has no prices, so memory stands in for cost (`GPU_ORDER`). A GPU that cannot run the setup's precision
    (bf16 on a T4) is passed over, saying so."""
    sizer = _Sizer(spec, margin=margin, estimator=estimator, with_ladder=with_ladder,
                   explicit=frozenset(explicit or ()), keep=frozenset(keep))
    held = _held_fixed(setup, hardware, margin, "gpu", with_ladder=with_ladder)
    rejected: list[Rejected] = []
    for gpu in catalog_by_memory(gpus):
        try:
            check_precision(setup.precision, gpu)
        except ConfigError:
            rejected.append(Rejected(gpu.name, gpu.memory_bytes, f"no bf16 for {setup.precision}"))
            continue
        here = sizer(gpu.name, setup, dataclasses.replace(hardware, gpu=gpu))
        if here.fits:
            return CheapestGpu(gpu, here, tuple(rejected), held, with_ladder, evaluations=sizer.evaluations,
                               start=_start(setup))
        rejected.append(Rejected(gpu.name, gpu.memory_bytes, here.text(), here))
    return CheapestGpu(None, None, tuple(rejected), held, with_ladder, evaluations=sizer.evaluations,
                               start=_start(setup))


# ------------------------------------------------------------------------------------------------------------ sweep


@dataclass(frozen=True, eq=False)
class Method:
    """One column of the sweep: how the model is trained (precision, optimizer, checkpointing and the fine-tuning
    method, LoRA / QLoRA included); `transform` lets a method also change the model."""

    key: str
    title: str
    fields: dict[str, Any] = field(default_factory=dict)
    """TrainingSetup fields the method sets; {} keeps the setup as given."""
    transform: Callable[[ModelSpec, TrainingSetup], tuple[ModelSpec, TrainingSetup]] | None = None

    def apply(self, spec: ModelSpec, setup: TrainingSetup) -> tuple[ModelSpec, TrainingSetup]:
        setup = setup.replace(**self.fields) if self.fields else setup
        return self.transform(spec, setup) if self.transform else (spec, setup)


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    METHODS[method.key] = method
    return method


for _method in (
        Method("setup", "the setup as given", {}),
        Method("full-amp-adamw", "full, bf16 autocast + AdamW",
               {"precision": Precision.AMP_BF16, "optimizer": Optimizer.ADAMW_FOREACH,
                "checkpointing": Checkpointing.NONE}),
        Method("full-bf16-adamw", "full bf16 + AdamW",
               {"precision": Precision.BF16, "optimizer": Optimizer.ADAMW_FOREACH,
                "checkpointing": Checkpointing.NONE}),
        Method("full-bf16-adamw8bit", "full bf16 + 8-bit AdamW",
               {"precision": Precision.BF16, "optimizer": Optimizer.ADAMW_8BIT, "checkpointing": Checkpointing.NONE}),
        Method("full-bf16-adamw-ckpt", "full bf16 + AdamW + checkpointing",
               {"precision": Precision.BF16, "optimizer": Optimizer.ADAMW_FOREACH,
                "checkpointing": Checkpointing.FULL}),
        Method("full-bf16-adamw8bit-ckpt", "full bf16 + 8-bit AdamW + checkpointing",
               {"precision": Precision.BF16, "optimizer": Optimizer.ADAMW_8BIT, "checkpointing": Checkpointing.FULL}),
):
    register_method(_method)

for _method in (
        Method("lora", "LoRA r=16 all-linear, bf16 base, autocast",
               {"precision": Precision.AMP_BF16, "optimizer": Optimizer.ADAMW_FOREACH,
                "checkpointing": Checkpointing.NONE,
                "finetune": Finetune(method=FinetuneMethod.LORA, rank=16, alpha=32, targets=(ALL_LINEAR,))}),
        Method("lora-ckpt", "LoRA r=16 all-linear + checkpointing",
               {"precision": Precision.AMP_BF16, "optimizer": Optimizer.ADAMW_FOREACH,
                "checkpointing": Checkpointing.FULL,
                "finetune": Finetune(method=FinetuneMethod.LORA, rank=16, alpha=32, targets=(ALL_LINEAR,))}),
        Method("qlora-ckpt", "QLoRA NF4 r=16 all-linear + checkpointing",
               {"precision": Precision.AMP_BF16, "optimizer": Optimizer.ADAMW_FOREACH,
                "checkpointing": Checkpointing.FULL,
                "finetune": Finetune(method=FinetuneMethod.QLORA, rank=16, alpha=32, targets=(ALL_LINEAR,))}),
):
    register_method(_method)

DEFAULT_METHODS = ("full-bf16-adamw", "full-bf16-adamw8bit-ckpt", "lora-ckpt", "qlora-ckpt")
"""A full fine-tune, the cheapest full one, LoRA and QLoRA: the columns users ask for (r=16, alpha 32, all-linear:
the common recipe, e.g. the QLoRA paper's targets)."""



def get_methods(keys: Sequence[str] | str | None) -> tuple[Method, ...]:
    """Methods by key ('full-bf16-adamw,full-bf16-adamw8bit'); LoRA / QLoRA name the issue they wait on."""
    if keys is None:
        keys = DEFAULT_METHODS
    if isinstance(keys, str):
        keys = [k for k in (part.strip() for part in keys.split(",")) if k]
    out = []
    for key in keys:
        name = key.strip().lower()
        if name not in METHODS:
            raise ConfigError(f"unknown method '{key}': choose from {', '.join(METHODS)}")
        out.append(METHODS[name])
    if not out:
        raise ConfigError(f"no method given: choose from {', '.join(METHODS)}")
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class SweepCell:
    seq_len: int
    micro_batch_size: int
    method: str
    total_bytes: int | None
    """None when the method cannot run here (`note` says why)."""
    budget_bytes: int
    fits: bool
    note: str = ""

    @property
    def gib(self) -> float | None:
        return None if self.total_bytes is None else self.total_bytes / GiB

    def text(self) -> str:
        if self.total_bytes is None:
            return "n/a"
        return f"{self.gib:.2f} {'fits' if self.fits else 'no'}"

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size, "method": self.method,
                "total_bytes": self.total_bytes, "budget_bytes": self.budget_bytes, "fits": self.fits,
                "note": self.note}


@dataclass(frozen=True)
class Sweep:
    seqs: tuple[int, ...]
    batches: tuple[int, ...]
    methods: tuple[Method, ...]
    cells: tuple[SweepCell, ...]
    """Sequence-major, then micro-batch, then method."""
    held_fixed: dict[str, Any]
    gpu: str
    world_size: int
    budget_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def any_fits(self) -> bool:
        return any(c.fits for c in self.cells)

    def cell(self, seq_len: int, micro_batch_size: int, method: str) -> SweepCell:
        for c in self.cells:
            if (c.seq_len, c.micro_batch_size, c.method) == (seq_len, micro_batch_size, method):
                return c
        raise KeyError((seq_len, micro_batch_size, method))

    def rows(self) -> list[tuple[int, int, list[SweepCell]]]:
        """(seq, micro-batch, one cell per method) in sweep order."""
        per = len(self.methods)
        return [(self.cells[i].seq_len, self.cells[i].micro_batch_size, list(self.cells[i:i + per]))
                for i in range(0, len(self.cells), per)]

    def title(self) -> str:
        on = f"{self.world_size} x " if self.world_size > 1 else ""
        return (f"GiB per GPU on {on}{self.gpu} ({format_bytes(self.budget_bytes)} usable); "
                "'fits' / 'no' against that budget")

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["seq_len", "micro_batch_size", "method", "method_title", "gib", "total_bytes",
                         "budget_bytes", "fits", "note"])
        titles = {m.key: m.title for m in self.methods}
        for c in self.cells:
            writer.writerow([c.seq_len, c.micro_batch_size, c.method, titles[c.method],
                             "" if c.gib is None else f"{c.gib:.2f}", "" if c.total_bytes is None else c.total_bytes,
                             c.budget_bytes, "yes" if c.fits else "no", c.note])
        return out.getvalue()

    def to_markdown(self) -> str:
        lines = [self.title() + ".", "",
                 "| seq | micro-batch | " + " | ".join(m.title for m in self.methods) + " |",
                 "|---:|---:|" + "---:|" * len(self.methods)]
        for seq, batch, cells in self.rows():
            lines.append(f"| {seq} | {batch} | " + " | ".join(_md_cell(c) for c in cells) + " |")
        lines += [""] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        return {"seqs": list(self.seqs), "batches": list(self.batches),
                "methods": [{"key": m.key, "title": m.title, "fields": {k: str(v) for k, v in m.fields.items()}}
                            for m in self.methods],
                "gpu": self.gpu, "world_size": self.world_size, "budget_bytes": self.budget_bytes,
                "held_fixed": self.held_fixed, "any_fits": self.any_fits, "notes": list(self.notes),
                "cells": [c.to_dict() for c in self.cells]}


def _md_cell(cell: SweepCell) -> str:
    if cell.total_bytes is None:
        return "n/a"
    return f"{cell.gib:.2f} ✅" if cell.fits else f"{cell.gib:.2f} ❌"


def _positive_values(values: Iterable[int], what: str) -> tuple[int, ...]:
    out = tuple(dict.fromkeys(values))
    bad = [v for v in out if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad or not out:
        raise ConfigError(f"the sweep's {what} must be positive whole numbers, got {list(values) or 'none'}")
    return out


def sweep(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, seqs: Iterable[int],
          batches: Iterable[int], methods: Sequence[Method] | Sequence[str] | str | None = None,
          margin: float = DEFAULT_MARGIN, estimator: EstimateFn = estimate) -> Sweep:
    """Every (sequence length, micro-batch, method) sized with `estimator`: each cell is one direct call on
    `method.apply(setup with seq and micro-batch)`. Fields no axis sets (accumulation, attention, sharding, GPUs)
    stay as in `setup`."""
    seqs, batches = _positive_values(seqs, "sequence lengths"), _positive_values(batches, "micro-batches")
    chosen = (tuple(methods) if methods and all(isinstance(m, Method) for m in methods)
              else get_methods(methods))  # type: ignore[arg-type]
    budget = int(hardware.gpu.memory_bytes * (1 - margin))
    cells: list[SweepCell] = []
    for seq in seqs:
        for batch in batches:
            base = setup.replace(seq_len=seq, micro_batch_size=batch)
            for method in chosen:
                try:
                    m_spec, m_setup = method.apply(spec, base)
                    check_precision(m_setup.precision, hardware.gpu)
                except ConfigError as error:
                    cells.append(SweepCell(seq, batch, method.key, None, budget, False, str(error)))
                    continue
                est = estimator(m_spec, m_setup, hardware)
                fits = diagnose(est, hardware, margin=margin).fits
                cells.append(SweepCell(seq, batch, method.key, est.total_bytes, budget, fits))
    set_by_methods = {name for m in chosen for name in m.fields}
    held = _held_fixed(setup, hardware, margin, "seq_len", "micro_batch_size", *set_by_methods)
    notes = [METHODS_NOTE] if any(m.fields.get("finetune") for m in chosen) else []
    context = spec.max_position_embeddings
    if context and max(seqs) > context:
        notes.append(f"sequences above the model's context ({context:,}) are sized as given")
    return Sweep(seqs, batches, chosen, tuple(cells), held, hardware.gpu.name, hardware.world_size, budget,
                 tuple(notes))

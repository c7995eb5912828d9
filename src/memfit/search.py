"""Searches over setups: every combination of the techniques for `plan --optimize`, and the one answer to "how many
GPUs would it take" that both the ladder's ZeRO rung and the plan's suggestions give."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .diagnose import DEFAULT_MARGIN, diagnose
from .errors import ConfigError
from .estimate.analytic import estimate
from .estimate.result import MemoryEstimate
from .frameworks import runs_as
from .hardware import Hardware
from .model_spec import ModelSpec
from .setup import Offload, Sharding, TrainingSetup, setup_changes
from .techniques import REGISTRY
from .techniques.base import SEARCH, with_engine_that_can

EstimateFn = Callable[[ModelSpec, TrainingSetup, Hardware], MemoryEstimate]


def candidate_setups(setup: TrainingSetup, hardware: Hardware, *, keep: frozenset[str] = frozenset(),
                     techniques: tuple[str, ...] = SEARCH) -> Iterator[TrainingSetup]:
    """Every setup TrainingSetup accepts that combines the values `techniques` (registry keys, default SEARCH)
    yield for `setup` on `hardware` (Technique.search_values), on `hardware`'s GPU count, at the same effective
    batch. Fields in `keep` stay as in `setup`."""
    choices: dict[str, list] = {}
    for key in techniques:
        choices.update(REGISTRY[key].search_values(setup, hardware))
    batch = setup.micro_batch_size * setup.grad_accum_steps
    if "grad_accum_steps" in keep and "micro_batch_size" in choices:
        choices["micro_batch_size"] = [setup.micro_batch_size]
    for name in choices:
        if name in keep:
            choices[name] = [getattr(setup, name)]
    names = list(choices)
    for values in itertools.product(*(choices[name] for name in names)):
        fields = dict(zip(names, values))
        fields["grad_accum_steps"] = batch // fields.get("micro_batch_size", setup.micro_batch_size)
        try:
            yield setup.replace(**fields, num_gpus=hardware.world_size)
        except ConfigError:
            continue


@dataclass(frozen=True)
class GpusToFit:
    """The fewest GPUs on which `setup` (the searched one: the given setup with ZeRO-3 over them) fits."""

    num_gpus: int
    setup: TrainingSetup
    hardware: Hardware
    estimate: MemoryEstimate
    base: TrainingSetup
    """The setup the search started from."""

    @property
    def flags(self) -> str:
        hw = self.hardware
        return f"--gpus {hw.gpus_per_node}" + (f" --nodes {hw.num_nodes}" if hw.num_nodes > 1 else "")

    def text(self, what: str = "the setup") -> str:
        """'it fits on N x GPU (--gpus N) with <every change> to <what> (<its techniques>)': the changes come from the
        setup diff, so the sentence says everything the number assumes."""
        added = [c.text for c in setup_changes(self.base, self.setup) if c.field != "num_gpus"]
        how = f"with {', '.join(added)} added" if added else "with nothing else changed"
        return (f"it fits on {self.num_gpus} x {self.hardware.gpu.name} ({self.flags}) {how} to {what} "
                f"({describe_techniques(self.base)})")


GPUS_PER_NODE = 8
MAX_GPUS = 1024


def scaled_out(setup: TrainingSetup, num_gpus: int, *, keep: frozenset[str] = frozenset()) -> TrainingSetup | None:
    """The one setup the GPU count is searched over: `setup` with ZeRO-3 (the stage that shards the most) over
    `num_gpus`, on the same engine when it can, else on the first other engine that can (QLoRA's packed base shards
    on FSDP2, not on DeepSpeed ZeRO-3); pinned fields stay. None when the pins forbid it or no engine can."""
    sharding = setup.sharding if "sharding" in keep else Sharding.ZERO3
    if sharding is Sharding.NONE:
        return None
    try:
        return with_engine_that_can(setup, keep=keep, sharding=sharding, num_gpus=num_gpus)
    except ConfigError:
        return None


def scaled_out_setups(setup: TrainingSetup, hardware: Hardware, *, keep: frozenset[str] = frozenset(),
                      limit: int = MAX_GPUS):
    """(n, scaled_out(setup, n), the hardware of n GPUs) for each power of two n above the current count (8 per
    node) up to `limit`, until the setup cannot scale; nothing when --keep pins the GPU count."""
    if "num_gpus" in keep:
        return
    n = 2
    while n <= limit:
        if n > hardware.world_size:
            hw = dataclasses.replace(hardware, gpus_per_node=min(n, GPUS_PER_NODE),
                                     num_nodes=max(1, n // GPUS_PER_NODE))
            candidate = scaled_out(setup, n, keep=keep)
            if candidate is None:
                return
            yield n, candidate, hw
        n *= 2


def gpus_to_fit(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
                estimator: EstimateFn = estimate, keep: frozenset[str] = frozenset(),
                limit: int = MAX_GPUS) -> GpusToFit | None:
    """The fewest GPUs on which `scaled_out(setup, n)` fits the GPU's budget (scaled_out_setups); None up to
    `limit` or when --keep pins the GPU count or forbids sharding."""
    for n, candidate, hw in scaled_out_setups(setup, hardware, keep=keep, limit=limit):
        candidate = runs_as(spec, candidate)
        est = estimator(spec, candidate, hw)
        if diagnose(est, hw, margin=margin).fits:
            return GpusToFit(n, candidate, hw, est, setup)
    return None


def describe_techniques(setup: TrainingSetup) -> str:
    """A short list of what a setup uses, for sentences that say what a number assumes."""
    parts = [str(setup.precision), str(setup.optimizer), f"checkpointing {setup.checkpointing}",
             f"micro-batch {setup.micro_batch_size} x accum {setup.grad_accum_steps}"]
    if setup.offload is not Offload.NONE:
        parts.append(f"offload {setup.offload}")
    if setup.finetune.adapters:
        parts.insert(0, str(setup.finetune))
    if setup.sharding is not Sharding.NONE:
        parts.append(f"{setup.sharding} on {setup.engine}")
    return ", ".join(parts)

"""Walk the seed's ladder from the cheapest change, re-estimating after each step, until the step fits.

What the user asked for is kept: fields the user set (`explicit`) are changed only when no other rung is left, and
the step then says "you asked for X; this rung changes it to Y because ..."; fields pinned with `keep` (--keep) are
never changed, and a rung that would change one is passed over with a reason naming the pin. Every step's `why`
ends with the list of every field it changes, generated from the setup diff, so no rung reverts another silently."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .diagnose import DEFAULT_MARGIN, Bottleneck, Diagnosis, diagnose, static_floor_bytes
from .errors import ConfigError
from .estimate import moe
from .estimate.analytic import estimate
from .estimate.comm import comm_volume
from .estimate.result import MemoryEstimate
from .frameworks import cannot, runs_as
from .graph.saved import NotModelledError
from .hardware import Hardware, check_precision, gpu_catalog
from .model_spec import ModelSpec
from .ladder import PlanStep, explain, walk  # noqa: F401  (PlanStep, explain: re-exported)
from .search import MAX_GPUS, GpusToFit, candidate_setups, describe_techniques, gpus_to_fit, scaled_out_setups
from .setup import FIELD_LABELS, Checkpointing, Sharding, TrainingSetup, field_names, setup_changes
from .techniques import REGISTRY, Context
from .techniques.base import EstimateFn, keep_name, static_over_budget
from .throughput import relative_step_time
from .units import format_bytes

NOT_SIZED = "not sized by memfit yet: sequence / context parallelism (each GPU holds a slice of every sequence)"
FUSED_LOSS_HINT = ("a fused cross-entropy (--loss fused, Liger; pinned here) never holds the whole B x T x V "
                   "logits, log-softmax and their gradients{loss}")
NO_GPU_COUNT = "it does not fit even on"


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
    """When nothing fits: what would, for the final bottleneck (more GPUs, a shorter sequence, LoRA...)."""
    margin: float = DEFAULT_MARGIN
    explicit: frozenset[str] = frozenset()
    """TrainingSetup fields the user set."""
    keep: frozenset[str] = frozenset()
    """TrainingSetup fields pinned with --keep."""
    more_gpus: GpusToFit | None = None
    """When nothing fits: the fewest GPUs on which memfit plans the step to a fit (the "more GPUs" suggestion)."""

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
                "explicit": sorted(self.explicit), "keep": sorted(self.keep),
                "initial_estimate": self.initial_estimate.to_dict(),
                "initial_diagnosis": self.initial_diagnosis.to_dict(), "steps": [s.to_dict() for s in self.steps],
                "skipped": [{"technique": t, "reason": r} for t, r in self.skipped],
                "final_setup": self.final_setup.to_dict(), "final_diagnosis": self.final_diagnosis.to_dict(),
                "suggestions": list(self.suggestions),
                "more_gpus": None if self.more_gpus is None else {
                    "num_gpus": self.more_gpus.num_gpus, "setup": self.more_gpus.setup.to_dict(),
                    "total_bytes": self.more_gpus.estimate.total_bytes}}


def plan(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
         estimator: EstimateFn = estimate, explicit: frozenset[str] | None = None,
         keep: frozenset[str] | None = None) -> Plan:
    """The seed's decision framework: diagnose, take the next untried rung of the ladder for the current bottleneck
    (falling back to the combined ladder when that one is spent), re-estimate, and stop at the first fit.

    `estimator(spec, setup, hardware)` sizes each setup: the analytic model by default; a trace
    (`memfit.trace.traced_estimator`) plans models that have no transformer shape, such as plain nn.Modules.
    `explicit`: the TrainingSetup fields the user set; rungs that change one are taken only when no other rung is
    left, and say so. `keep`: fields no rung may change. A precision in bf16 on a GPU without bf16 is a ConfigError."""
    check_precision(setup.precision, hardware.gpu)
    explicit, keep = frozenset(explicit or ()), frozenset(keep or ())
    _check_fields(explicit | keep)
    estimator = memoized(estimator)

    est = estimator(spec, setup, hardware)
    initial = (est, diagnose(est, hardware, margin=margin))
    walked = walk(spec, setup, hardware, initial, margin=margin, estimator=estimator, explicit=explicit, keep=keep)
    steps, skipped = walked.steps, walked.skipped
    current, est, diag = walked.setup, walked.estimate, walked.diagnosis

    def context(current: TrainingSetup, est: MemoryEstimate, diag: Diagnosis) -> Context:
        return Context(spec, hardware, current, est, diag, margin, estimator, explicit, keep)

    suggestions: tuple[str, ...] = ()
    found = None
    if not diag.fits:
        ctx = context(current, est, diag)
        more, found = _more_gpus(ctx, setup)
        if "zero" in skipped and hardware.world_size < 2:
            skipped["zero"] += "; " + more
        suggestions = tuple(_suggestions(ctx, more))
    return Plan(spec, hardware, setup, initial[0], initial[1], tuple(steps),
                tuple((REGISTRY[k].title, r) for k, r in skipped.items()), suggestions, margin, explicit, keep,
                found)


def memoized(estimator: EstimateFn) -> EstimateFn:
    """`estimator` remembering its answers for one plan: the ladder's rung picks, the walk's re-estimate of the rung
    it took, the GPU-count and larger-GPU suggestions and the longest-sequence search ask for the same setups again
    (half of a plan's estimates). An estimate depends on nothing but its arguments, all frozen values; the setup's
    notes are in the key because they compare equal but the estimate carries them (its `setup`). The spec is held
    with its answers, so its id names it for as long as the memo lives. A failure is not remembered: asked again,
    the estimator raises again."""
    if getattr(estimator, "memo", None) is not None:
        return estimator  # a plan inside a plan (the suggestions' walks) shares the outer one's memo
    memo: dict[tuple, tuple[ModelSpec, MemoryEstimate]] = {}

    def remembered(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> MemoryEstimate:
        key = (id(spec), setup, setup.notes, hardware)
        if key not in memo:
            memo[key] = (spec, estimator(spec, setup, hardware))
        return memo[key][1]

    remembered.memo = memo  # type: ignore[attr-defined]
    return remembered


def _check_fields(fields: frozenset[str]) -> None:
    unknown = sorted(fields - set(FIELD_LABELS))
    if unknown:
        raise ConfigError(f"unknown TrainingSetup field(s) {', '.join(unknown)}: choose from {', '.join(FIELD_LABELS)}")


def _more_gpus(ctx: Context, given: TrainingSetup) -> tuple[str, GpusToFit | None]:
    """The one answer to "how many GPUs would it take" (search.gpus_to_fit): the ZeRO rung's reason and the
    suggestion both print it. From the plan's final setup first: scaled out as it is, or, when static memory alone is
    still over the budget (the ladder took no activation rung), walked again on each GPU count (`_walked_gpus`).
    When the final setup cannot scale out (a rung it took does not shard: 8-bit AdamW on FSDP2 with a packed base),
    the ladder is walked again from the setup as given, so the answer is one memfit itself plans to a fit."""
    hw = ctx.hardware
    if "num_gpus" in ctx.keep:
        return f"more GPUs: not considered, --keep gpus pins {ctx.setup.num_gpus}", None
    kwargs = dict(margin=ctx.margin, estimator=ctx.estimator, keep=ctx.keep)
    if static_over_budget(ctx.estimate, ctx.diagnosis):
        found = _walked_gpus(ctx.spec, ctx.setup, hw, explicit=ctx.explicit, **kwargs)
    else:
        found = gpus_to_fit(ctx.spec, ctx.setup, hw, **kwargs)
    if found is not None:
        return "more GPUs: " + found.text("the final setup"), found
    if given != ctx.setup:
        found = _walked_gpus(ctx.spec, given, hw, explicit=ctx.explicit, **kwargs)
        if found is not None:
            return "more GPUs: " + found.text("the setup as given"), found
    return (f"more GPUs: {NO_GPU_COUNT} {MAX_GPUS} x {hw.gpu.name} with ZeRO-3 and the ladder's rungs added to the "
            f"final setup ({describe_techniques(ctx.setup)})"), None


def _walked_gpus(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float,
                 estimator: EstimateFn, keep: frozenset[str], explicit: frozenset[str] = frozenset()
                 ) -> GpusToFit | None:
    """The fewest GPUs (powers of two, as gpus_to_fit) on which `setup` with ZeRO-3, then the ladder's rungs, fits:
    a count whose static memory alone is over the budget is passed over without a walk."""
    for n, candidate, hw in scaled_out_setups(setup, hardware, keep=keep):
        candidate = runs_as(spec, candidate)
        est = estimator(spec, candidate, hw)
        diag = diagnose(est, hw, margin=margin)
        if static_floor_bytes(est) < diag.budget_bytes:
            walked = walk(spec, candidate, hw, (est, diag), margin=margin, estimator=estimator,
                          explicit=explicit, keep=keep)
            if walked.diagnosis.fits:
                return GpusToFit(n, walked.setup, hw, walked.estimate, setup)
    return None


def _suggestions(ctx: Context, more_gpus: str) -> list[str]:
    """What would fit, for the final bottleneck: activations -> what cuts activations (sized where memfit can), unless
    static memory alone is over the budget; static memory -> more GPUs and LoRA; either -> a larger GPU."""
    bottleneck = ctx.diagnosis.bottleneck
    static_over = static_over_budget(ctx.estimate, ctx.diagnosis) is not None  # no activation saving can help
    static = static_over or bottleneck in (Bottleneck.STATIC, Bottleneck.BOTH)
    activations = not static_over and bottleneck in (Bottleneck.ACTIVATIONS, Bottleneck.BOTH)
    out = []
    if activations:
        out += _activation_suggestions(ctx)
    if static or NO_GPU_COUNT not in more_gpus:
        out.append(more_gpus)
    tensor_parallel = _tensor_parallel_suggestion(ctx) if static else None
    if tensor_parallel:
        out.append(tensor_parallel)
    expert_parallel = _expert_parallel_suggestion(ctx) if static else None
    if expert_parallel:
        out.append(expert_parallel)
    larger = _larger_gpu(ctx)
    if larger:
        out.append(larger)
    if static and "finetune" in ctx.keep and not ctx.setup.finetune.adapters:
        out.append("LoRA / QLoRA: frozen base weights with no gradients or optimizer states (rungs beyond the "
                   "seed); not considered, --keep finetune pins the full fine-tune")
    return out


def _tensor_parallel_suggestion(ctx: Context) -> str | None:
    """Tensor parallelism inside the node (with sequence parallelism, and ZeRO-3 over the nodes when there are
    several), offered only beyond the ladder: it is no seed rung because it changes the parallel layout of the whole
    job (its model code, its mesh, its launch) and puts per-layer activation collectives on the critical path of
    every forward and backward, which only a node's NVLink-class links carry well. None unless the node's GPUs
    make it fit."""
    setup, hw = ctx.setup, ctx.hardware
    if setup.tp > 1 or hw.gpus_per_node < 2 or ctx.spec.graph is None or {"tp", "engine"} & set(ctx.keep):
        return None
    tp = 1
    while tp * 2 <= hw.gpus_per_node:
        tp *= 2
    for degree in (d for d in (tp, tp // 2, tp // 4) if d >= 2):
        try:
            dp = hw.world_size // degree
            cand = setup.replace(tp=degree, sequence_parallel=True, engine="torch", offload="none",
                                 sharding="zero3" if dp >= 2 else "none")
            if not ctx.fits_on(cand, hw):
                continue
            volume = comm_volume(ctx.spec, cand, hw).tensor_parallel_bytes
        except ConfigError:
            continue
        return (f"tensor parallelism: --tp {degree} --sequence-parallel --engine torch"
                f"{' --zero zero3' if dp >= 2 else ''} fits (TP inside each node, {dp} data-parallel ranks); it "
                f"sends {volume / 2**30:.2f} GiB per rank per step over the node's links (all-gathers and "
                "reduce-scatters of B x T x h per layer, on the critical path), so it is offered, not walked")
    return None


def _expert_parallel_suggestion(ctx: Context) -> str | None:
    """Expert parallelism for a mixture-of-experts model on several GPUs: each rank keeps 1/ep of the experts whole
    instead of all-gathering every expert of a layer under ZeRO-3. Offered, not walked (like tensor parallelism, it
    changes the job's parallel layout and adds all-to-alls of the routed tokens), at the largest degree that
    divides the GPUs and the experts; where memfit does not size it for the model (DeepSeek's latent attention and
    experts are derived, with no expert-parallel layout), it is still named, with why it is not sized."""
    setup, n = ctx.setup, ctx.hardware.world_size
    if not moe.has_experts(ctx.spec) or setup.expert_parallel > 1 or n < 2 or "expert_parallel" in ctx.keep:
        return None
    nodes = moe.experts_nodes(ctx.spec)
    experts = nodes[0].num_experts if nodes else None
    degree = 1
    while degree * 2 <= n and n % (degree * 2) == 0 and (experts is None or experts % (degree * 2) == 0):
        degree *= 2
    flag = f"--ep {degree}" + (" --zero none" if setup.sharding is not Sharding.NONE else "")
    try:
        est = ctx.size(setup.replace(expert_parallel=degree, sharding=Sharding.NONE))
    except ConfigError as error:
        return f"expert parallelism ({flag}): not sized here: {error}"
    fits = diagnose(est, ctx.hardware, margin=ctx.margin).fits
    share = f"{experts // degree} of {experts}" if experts else f"1/{degree}"
    zero = (" (memfit does not size EP combined with ZeRO yet, whose expert-data-parallel groups would shard the rest)"
            if setup.sharding is not Sharding.NONE else "")
    return (f"expert parallelism ({flag}): {format_bytes(est.total_bytes)} per GPU, {'fits' if fits else 'still over'}"
            f"{zero}: each rank keeps {share} experts per layer whole; all-to-all of the routed tokens every layer, "
            "so it is offered, not walked")


def _larger_gpu(ctx: Context) -> str | None:
    """The smallest catalog GPU with more memory on which the ladder, walked again from the final setup, fits: on a
    larger GPU static memory may fit, and the activation rungs passed over here open there."""
    for gpu in sorted(gpu_catalog().values(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= ctx.hardware.gpu.memory_bytes or not _runs_on(ctx.setup, gpu):
            continue
        hw = dataclasses.replace(ctx.hardware, gpu=gpu)
        est = ctx.size(ctx.setup, hw)
        walked = walk(ctx.spec, ctx.setup, hw, (est, diagnose(est, hw, margin=ctx.margin)), margin=ctx.margin,
                      estimator=ctx.estimator, explicit=ctx.explicit, keep=ctx.keep)
        if walked.diagnosis.fits:
            added = [c.text for c in setup_changes(ctx.setup, walked.setup)]
            return (f"a larger GPU: it fits on {gpu.name} ({format_bytes(gpu.memory_bytes)})"
                    + (f" with {', '.join(added)} added" if added else ""))
    return None


def _runs_on(setup: TrainingSetup, gpu) -> bool:
    try:
        check_precision(setup.precision, gpu)
    except ConfigError:
        return False
    return True


def _sized(ctx: Context, setup: TrainingSetup) -> str:
    est = ctx.size(setup)
    fits = diagnose(est, ctx.hardware, margin=ctx.margin).fits
    return (f"{format_bytes(est.total_bytes)} of {format_bytes(ctx.diagnosis.budget_bytes)} usable, "
            f"{'fits' if fits else 'still over'}")


def _pinned_note(ctx: Context, *fields: str) -> str:
    names = dict.fromkeys(keep_name(f) for f in fields if f in ctx.keep)
    return f" (--keep {','.join(names)} pins it)" if names else ""


def _activation_suggestions(ctx: Context) -> list[str]:
    setup, out = ctx.setup, []
    if "seq_len" in ctx.keep:
        out.append(f"a shorter sequence: not considered, --keep seq pins seq {setup.seq_len}")
    else:
        seq = longest_fitting_seq(ctx)
        if seq is None:
            out.append("a shorter sequence: none fits with this setup, even seq 1")
        else:
            out.append(f"a shorter sequence: seq {seq} is the longest that fits with this setup "
                       f"({_sized(ctx, setup.replace(seq_len=seq))}; searched in steps of {_seq_step(setup.seq_len)})")
    if setup.checkpointing is Checkpointing.NONE:
        refused = cannot(ctx.spec, setup, checkpointing=Checkpointing.FULL)
        out.append(f"gradient checkpointing: {refused or _sized(ctx, setup.replace(checkpointing=Checkpointing.FULL))}"
                   + _pinned_note(ctx, "checkpointing"))
    if setup.micro_batch_size > 1:
        smaller = setup.replace(micro_batch_size=1, grad_accum_steps=setup.grad_accum_steps * setup.micro_batch_size)
        out.append(f"micro-batch 1 x accum {smaller.grad_accum_steps}: {_sized(ctx, smaller)}"
                   + _pinned_note(ctx, "micro_batch_size", "grad_accum_steps"))
    out.append(NOT_SIZED)
    if ctx.setup.loss.value == "standard" and not cannot(ctx.spec, ctx.setup, loss="fused"):
        loss = sum(t.num_bytes for t in ctx.estimate.terms if "loss" in t.name or "logits" in t.name)
        out.append(FUSED_LOSS_HINT.format(loss=f": {format_bytes(loss)} here" if loss else ""))
    return out


def _seq_step(seq: int) -> int:
    return 64 if seq > 64 else 1


def longest_fitting_seq(ctx: Context) -> int | None:
    """The longest sequence below the current one, in steps of 64 (of 1 for short sequences), with which the
    setup fits: a binary search over the plan's estimator (activation memory grows with the sequence)."""
    step = _seq_step(ctx.setup.seq_len)
    lo, hi = 0, (ctx.setup.seq_len - 1) // step  # lo: known to fit (0 = none yet); hi: largest to try
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ctx.fits(ctx.setup.replace(seq_len=mid * step)):
            lo = mid
        else:
            hi = mid - 1
    if lo:
        return lo * step
    return None if step == 1 or not ctx.fits(ctx.setup.replace(seq_len=1)) else _short_seq(ctx, step)


def _short_seq(ctx: Context, step: int) -> int:
    best = 1
    for seq in range(2, step):
        if not ctx.fits(ctx.setup.replace(seq_len=seq)):
            break
        best = seq
    return best


@dataclass(frozen=True)
class OptimizedChoice:
    setup: TrainingSetup
    estimate: MemoryEstimate
    relative_step_time: float
    """Modelled time per sample relative to the ladder's final setup (lower is faster)."""
    differences: tuple[str, ...]


def optimize(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN,
             reference: TrainingSetup | None = None, estimator: EstimateFn = estimate,
             explicit: frozenset[str] | None = None, keep: frozenset[str] | None = None) -> OptimizedChoice | None:
    """Search every combination of the techniques (search.candidate_setups; fields in `keep` fixed), sized with
    `estimator` like plan(); return the fitting setup with the best modelled throughput. A difference in a field the
    user set (`explicit`) says what was asked."""
    check_precision(setup.precision, hardware.gpu)
    best = None
    explicit = frozenset(explicit or ())
    keep = frozenset(keep or ())
    if spec.extra.get("supports_sdpa") is False:  # e.g. gpt_oss (attention sinks): transformers builds eager only
        keep |= {"attention"}
    for cand in candidate_setups(setup, hardware, keep=keep):
        try:
            est = estimator(spec, cand, hardware)
        except NotModelledError:  # e.g. selective checkpointing of a derived model (no graph): not a candidate
            continue
        if not diagnose(est, hardware, margin=margin).fits:
            continue
        t = relative_step_time(spec, cand, hardware)
        if best is None or t < best[0]:
            best = (t, cand, est)
    if best is None:
        return None
    ref = reference or setup
    ref_time = relative_step_time(spec, ref, hardware)
    diffs = []
    for name in field_names():  # the technique sections' fields among the setup's own (memfit.fields)
        old, new = getattr(ref, name), getattr(best[1], name)
        if name == "notes" or old == new:
            continue
        asked = (f" (you asked for {getattr(setup, name)})"
                 if name in explicit and getattr(setup, name) != new else "")
        diffs.append(f"{name}: {old} -> {new}{asked}")
    return OptimizedChoice(best[1], best[2], best[0] / ref_time, tuple(diffs))

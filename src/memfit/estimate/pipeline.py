"""Pipeline parallelism, per stage: what each of the `pp` ranks of a pipeline holds at its peak.

Layout (torchtitan's pipeline_module_split over torch.distributed.pipelining): the layers are cut into pp x v stages
(v = pp_virtual_stages), rank r holds stages r, r + pp, ... ; the token embedding lives on the first stage, the final
norm, the LM head and the loss on the last. A step runs m = grad_accum_steps micro-batches of micro_batch_size
sequences through the stages. Per rank:

- static memory: its own stages' parameters, gradients and optimizer states, sharded by ZeRO / FSDP2 over the
  num_gpus / (tp x pp) data-parallel ranks (memfit.estimate.static);
- activations in flight: each micro-batch's saved tensors stay until its backward. GPipe (Huang et al. 2019) runs
  every forward first: m micro-batches. 1F1B (PipeDream-Flush, Narayanan et al. 2021 sec. 2.2.1; torch
  Schedule1F1B: warmup_chunks = min(m, pp - stage)) holds pp - r on rank r. Interleaved 1F1B (Narayanan et al.
  2021, arXiv:2104.04473, sec. 2.2.2; torch ScheduleInterleaved1F1B / _get_warmup_ops) runs
  (v - 1) x m_round + 2 (pp - 1 - r) warm-up forwards, then one more before its first backward, each of a stage of
  L / (pp v) layers: on rank 0 L (1 + (pp - 1) / (pp v)) layers' worth, Korthikanti et al. 2022 sec. 4.2.3;
- the stage boundary: torch's PipelineStage allocates one receive buffer per micro-batch for the activations a
  non-first stage receives and for the gradients a non-last stage receives (stage.py _prepare_forward_infra /
  _create_grad_recv_info), and keeps each micro-batch's stage output in fwd_cache until its backward; on the last
  stage that output is the logits (the loss_fn makes the loss), kept beside the loss's log-softmax.

The saved tensors per layer, the head's and the embedding's are memfit.estimate.activations', for one micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..model_spec import ModelSpec, ParamTensor
from ..setup import PipelineSchedule, TrainingSetup
from . import activations as act
from .moments import MomentKey, StepChange, StepMoments
from .result import Category, Phase, Term
from .terms import TermKey

SOURCE = "torch.distributed.pipelining (torch 2.13 stage.py, schedules.py); torchtitan pipeline_module_split"
NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473) sec. 2.2; torch schedules.py"
EMBEDDING_FRAGMENTS = ("embed_tokens", "wte", "wpe", "word_embeddings", "embed_in", "position_embeddings",
                       "token_type_embeddings", "embed_positions")


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers of each stage, in order: an even split, the first num_layers mod num_stages stages one layer more.
    ConfigError when a stage would hold no layer."""
    if num_layers < num_stages:
        raise ConfigError(f"{num_stages} pipeline stages (pp x virtual stages) need at least as many layers; the "
                          f"model has {num_layers}: lower --pp or --pp-virtual-stages")
    base, extra = divmod(num_layers, num_stages)
    return [base + (i < extra) for i in range(num_stages)]


@dataclass(frozen=True)
class RankStages:
    """What pipeline rank `rank` holds: its stages' indices and layers, whether it has the first / last stage."""

    rank: int
    stages: tuple[int, ...]
    num_layers: int
    first: bool
    last: bool


def rank_stages(spec: ModelSpec, setup: TrainingSetup, rank: int) -> RankStages:
    v = setup.pp_virtual_stages
    counts = stage_layers(spec.num_layers, setup.pp * v)
    stages = tuple(rank + k * setup.pp for k in range(v))
    return RankStages(rank, stages, sum(counts[s] for s in stages), first=0 in stages,
                      last=setup.pp * v - 1 in stages)


def stage_spec(spec: ModelSpec, held: RankStages) -> ModelSpec:
    """The parameters rank `held` trains: its layers' share of each per-layer tensor, the embedding on the first
    stage, every other non-layer tensor (final norm, LM head) on the last. A tied LM head is a copy of the
    embedding on the last stage (as Megatron-LM keeps one, its gradient all-reduced with the first stage's)."""
    params: list[ParamTensor] = []
    embedding = _embedding_names(spec)
    for p in spec.params:
        if ".*." in p.name or p.name.startswith("*."):
            count = p.count * held.num_layers // spec.num_layers
            if count:
                params.append(dataclasses.replace(p, count=count))
        elif p.name in embedding if embedding is not None else any(f in p.name for f in EMBEDDING_FRAGMENTS):
            if held.first:
                params.append(p)
            if held.last and spec.tie_word_embeddings and p.numel == spec.vocab_size * spec.hidden_size:
                params.append(dataclasses.replace(p, name="lm_head.weight (tied copy)"))
        elif held.last:
            params.append(p)
    return dataclasses.replace(spec, params=params, num_layers=held.num_layers)


def _embedding_names(spec: ModelSpec) -> frozenset[str] | None:
    """The parameters the first stage holds besides its layers: the graph's embedding and the tables beside it
    (learned positions, token types); None without a graph (then EMBEDDING_FRAGMENTS, the modules' own names)."""
    if spec.graph is None:
        return None
    from ..graph import tensors_of

    nodes = [spec.graph.embed, *spec.graph.extra_params]
    return frozenset(t.name for n in nodes for t in tensors_of(n, getattr(n, "name", "")))


def in_flight(setup: TrainingSetup, rank: int) -> int:
    """Stage-micro-batches whose saved activations rank `rank` holds when its first backward starts (the most it
    ever holds)."""
    m, pp, v = setup.grad_accum_steps, setup.pp, setup.pp_virtual_stages
    if setup.pp_schedule is PipelineSchedule.GPIPE:
        return m
    if setup.pp_schedule is PipelineSchedule.ONE_F_ONE_B:
        return min(m, pp - rank)  # Schedule1F1B: warmup_chunks = min(n_microbatches, num_stages - stage_index)
    per_round = m // max(1, m // pp)  # ScheduleInterleaved1F1B.microbatches_per_round
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)  # _get_warmup_ops
    return min(warmup + 1, m * v)  # the 1F1B phase runs one more forward before its first backward


def korthikanti_interleaved_layers(num_layers: int, pp: int, v: int) -> float:
    """Layers' worth of one micro-batch's activations on the first rank under interleaved 1F1B with m >= pp:
    L (1 + (pp - 1) / (pp v)) (Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.2.3)."""
    return num_layers * (1 + (pp - 1) / (pp * v))


@dataclass(frozen=True)
class StageMemory:
    """One pipeline rank: its held stages, the micro-batches in flight at its peak, that peak's terms."""

    held: RankStages
    in_flight: int
    terms: tuple[Term, ...]
    phase: Phase
    moment: str

    @property
    def tensor_bytes(self) -> int:
        return sum(t.num_bytes for t in self.terms)


def boundary_bytes(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> int:
    """One micro-batch's stage-boundary tensor: B x T x h in the residual stream's dtype (what a stage sends
    forward, and its gradient backward)."""
    d = act.dtypes(spec, setup, on_cpu)
    return setup.tokens_per_micro_step * spec.hidden_size * d.residual


def micro_batch_terms(spec: ModelSpec, setup: TrainingSetup, held: RankStages, counts: list[int],
                      on_cpu: bool = False, head_released: bool = False) -> list[Term]:
    """What the stage-micro-batches in flight on rank `held` (`counts`: how many of each of its stages, in order)
    keep: their layers' saved tensors, the embedding's (first stage) or the position tables (others), the stage
    outputs in fwd_cache, and on the last stage the final norm's, the logits and the loss's log-softmax
    (`head_released`: but the one being run back). A non-first stage's input is its receive buffer (counted there)."""
    tokens, seq = setup.tokens_per_micro_step, setup.seq_len
    d = act.dtypes(spec, setup, on_cpu)
    layers = stage_layers(spec.num_layers, setup.pp * setup.pp_virtual_stages)
    num_stages, total = len(layers), sum(counts)
    saved = sum(n * layers_saved_bytes(spec, setup, layers[s], on_cpu) for s, n in zip(held.stages, counts))
    boundary = boundary_bytes(spec, setup, on_cpu)
    first = counts[0] if held.first else 0  # the first stage's inputs are token ids, not a received tensor
    last = counts[-1] if held.last else 0
    embedding = act.embedding_saved_bytes(spec, setup, tokens, seq, on_cpu)
    ids = 8 * tokens
    terms = [
        Term(TermKey.PIPELINE_LAYERS, Category.ACTIVATIONS, saved - (total - first) * boundary,
             f"{total} stage-micro-batch(es) in flight ({' + '.join(map(str, counts))} over the rank's "
             f"{len(counts)} stage(s)) x their layers' saved tensors (checkpointing {setup.checkpointing}), less "
             "each received input (its buffer is counted apart)", act.__name__ + " recipe rows; " + NARAYANAN),
        Term(TermKey.EMBEDDINGS, Category.ACTIVATIONS, total * (embedding - ids) + first * ids,
             "token ids (first stage) and position tables, per micro-batch in flight", SOURCE),
        Term(TermKey.STAGE_OUTPUTS, Category.ACTIVATIONS, (total - last) * boundary,
             "B x T x h per micro-batch in flight: the stage output, kept in fwd_cache until its backward",
             "torch stage.py forward_one_chunk (fwd_cache)")]
    if held.last and num_stages - 1 in held.stages:
        last -= head_released
        vocab_tokens = spec.vocab_size * tokens
        head = act.head_saved_bytes(spec, setup, tokens)["head"]
        terms += [
            Term(TermKey.HEAD, Category.ACTIVATIONS, last * head, "final norm and LM-head input",
                 act.__name__),
            Term(TermKey.LOGITS, Category.ACTIVATIONS, last * vocab_tokens * d.compute,
                 f"B x T x V x {d.compute} B per micro-batch in flight: the last stage's output, kept in fwd_cache",
                 "torch stage.py forward_one_chunk (fwd_cache)"),
            Term(TermKey.LOSS, Category.ACTIVATIONS, last * (vocab_tokens * 4 + ids),
                 "B x T x V x 4 B log-softmax + shifted labels per micro-batch in flight",
                 "F.cross_entropy on the upcast logits (loss_fn)")]
    return terms


def in_flight_by_stage(setup: TrainingSetup, rank: int, count: int | None = None) -> list[int]:
    """How the `count` (default: in_flight) stage-micro-batches of rank `rank` fall on its stages: interleaved,
    forward step k runs local stage (k // m_round) mod v (ScheduleInterleaved1F1B.forward_stage_index)."""
    count = in_flight(setup, rank) if count is None else count
    v = setup.pp_virtual_stages
    if v == 1:
        return [count]
    m = setup.grad_accum_steps
    per_round = m // max(1, m // setup.pp)
    counts = [0] * v
    for step in range(count):
        counts[(step // per_round) % v] += 1
    return counts


def layers_saved_bytes(spec: ModelSpec, setup: TrainingSetup, num_layers: int, on_cpu: bool = False) -> int:
    """What `num_layers` consecutive layers keep for one micro-batch: every saved tensor of a plain block; a
    checkpointed block's input (selective-op: + its kept matmul / SDPA outputs), as memfit.estimate.analytic's
    activation terms count them; the eager mask once when a checkpoint holds it."""
    tokens, seq = setup.tokens_per_micro_step, setup.seq_len
    full = sum(act.layer_saved_bytes(spec, setup, tokens, seq, on_cpu).values())
    wrapped = setup.checkpointing.checkpointed_blocks(num_layers)
    checkpoint = tokens * spec.hidden_size * act.dtypes(spec, setup, on_cpu).residual
    if setup.checkpointing.value == "selective-op":
        checkpoint += act.selective_kept_bytes(spec, setup, tokens, seq, on_cpu)
    mask = act.checkpointed_mask_bytes(spec, setup, tokens, seq) if act.mask_kept(setup, num_layers) else 0
    return wrapped * checkpoint + (num_layers - wrapped) * full + mask


def receive_buffer_bytes(spec: ModelSpec, setup: TrainingSetup, held: RankStages, on_cpu: bool = False) -> int:
    """Receive buffers, one per micro-batch for each of the rank's stages: activations into every non-first stage,
    gradients into every non-last stage (allocated on the first step, kept)."""
    boundary = boundary_bytes(spec, setup, on_cpu)
    num_stages = setup.pp * setup.pp_virtual_stages
    buffers = sum((s > 0) + (s < num_stages - 1) for s in held.stages)
    return buffers * setup.grad_accum_steps * boundary


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    """What the model must allow: a causal LM with at least one layer per stage."""
    if setup.pp == 1:
        return
    if not spec.is_decoder:
        raise ConfigError(f"pipeline parallelism is sized for causal LMs (embedding -> layers -> LM head); "
                          f"'{spec.name}' is not one")
    stage_layers(spec.num_layers, setup.pp * setup.pp_virtual_stages)


def stage_memories(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False,
                   changes: Sequence[StepChange] = ()) -> list[StageMemory]:
    """Every pipeline rank's peak (the estimator's `spec` after LoRA / MoE / tensor-parallel rewrites; `setup` one
    context-parallel rank's, `changes` what techniques add to its moments: ring attention's buffers beside a
    block's backward)."""
    return [stage_memory(spec, setup, rank, on_cpu, changes) for rank in range(setup.pp)]


def stage_memory(spec: ModelSpec, setup: TrainingSetup, rank: int, on_cpu: bool = False,
                 changes: Sequence[StepChange] = ()) -> StageMemory:
    from .static import full_static, shard
    from .step_model import static_terms

    held = rank_stages(spec, setup, rank)
    own = stage_spec(spec, held)
    full = full_static(own, setup)
    static = shard(own, setup, full)
    count = in_flight(setup, rank)
    buffers = Term(TermKey.P2P_BUFFERS, Category.ACTIVATIONS, receive_buffer_bytes(spec, setup, held, on_cpu),
                   f"{setup.grad_accum_steps} micro-batches x B x T x h receive buffers per boundary of the rank's "
                   "stages (activations in, gradients in)", "torch stage.py _prepare_forward_infra / "
                   "_create_grad_recv_info")
    casts = _autocast_copies(spec, held, setup)
    moments = StepMoments()
    for name, grads, counts, extra in _backward_moments(spec, setup, held, count, static.grads_bytes, on_cpu):
        base = static_terms(own, setup, static, grads, on_cpu)
        if static.fsdp is not None and name == "second backward":
            base = _fsdp_no_sync_terms(own, setup, static, on_cpu)
        for what, temporaries in _backward_temporaries(spec, own, setup, held, on_cpu):
            # in a block's backward the micro-batch being run back has released its head, logits and loss
            acts = micro_batch_terms(spec, setup, held, counts, on_cpu, head_released=what == "block backward")
            moments.put(f"{name}, {what}", Phase.BACKWARD, base + acts + casts + [buffers] + temporaries + extra)
    step_temp = full.step_temp_bytes // (setup.shard_size if setup.sharding.stage >= 1 else 1)
    moments.set(MomentKey.OPTIMIZER_STEP, static_terms(own, setup, dataclasses.replace(
        static, param_working_set_bytes=0), static.grads_bytes, on_cpu) + [buffers, Term(
            TermKey.OPTIMIZER_STEP, Category.TEMPORARIES, step_temp, f"{setup.optimizer} step temporaries",
            "torch.optim.adamw")])
    moments = moments.apply(changes)  # ring attention: beside each block's backward (its layer temporaries)
    name = moments.peak_key()
    phase, terms = moments[name]
    return StageMemory(held, count, tuple(t for t in terms if t.num_bytes > 0), phase, name)


FSDP_NO_SYNC_SOURCE = ("torch pipelining stage.py backward_maybe_with_nosync: set_requires_gradient_sync(False), "
                       "set_reshard_after_backward(False) until the last micro-batch; fsdp _fsdp_param.py "
                       "to_accumulated_grad_if_needed")


def _fsdp_no_sync_terms(own: ModelSpec, setup: TrainingSetup, static, on_cpu: bool) -> list[Term]:
    """FSDP2 under a pipeline schedule: torch's PipelineStage turns gradient sync and resharding after backward off
    for every micro-batch but the last, so from the first backward on, the stage's parameters stay gathered
    (compute dtype) and its gradients accumulate unsharded (in the reduce dtype) until one reduce-scatter at the
    end of the step."""
    from .step_model import static_terms

    units = static.fsdp
    gathered = dataclasses.replace(static, param_working_set_bytes=own.num_params * units.compute_bytes)
    return static_terms(own, setup, gathered, 0, on_cpu) + [Term(
        TermKey.UNSHARDED_ACCUMULATED, Category.GRADIENTS, own.num_params * units.reduce_bytes,
        f"the stage's P x {units.reduce_bytes} B gradients, unsharded, accumulated over the micro-batches",
        FSDP_NO_SYNC_SOURCE)]


def _backward_moments(spec: ModelSpec, setup: TrainingSetup, held: RankStages, count: int, grads: int,
                      on_cpu: bool) -> list[tuple[str, int, list[int], list[Term]]]:
    """(moment, gradient bytes alive, micro-batches in flight per stage, extra terms) of the rank's first two
    backwards: the first before any gradient exists (zero_grad(set_to_none=True)), the second with every gradient
    accumulating. 1F1B refills the pipeline with one forward between them, GPipe does not; from the second on, a
    non-first stage's previous input gradient is still held by its send (Schedule1F1B keeps the ops, GPipe the
    works)."""
    rank = held.rank
    moments = [("first backward", 0, in_flight_by_stage(setup, rank, count), [])]
    if setup.grad_accum_steps > 1:
        refilled = setup.pp_schedule is not PipelineSchedule.GPIPE and setup.grad_accum_steps * \
            setup.pp_virtual_stages > count
        held_grad = [] if held.first else [Term(
            TermKey.P2P_SEND, Category.TEMPORARIES, boundary_bytes(spec, setup, on_cpu),
            "B x T x h: the previous micro-batch's input gradient, held by its send", SOURCE)]
        later = in_flight_by_stage(setup, rank, count) if refilled else in_flight_by_stage(setup, rank, count - 1)
        moments.append(("second backward", grads, later, held_grad))
    return moments


def _backward_temporaries(spec: ModelSpec, own: ModelSpec, setup: TrainingSetup, held: RankStages,
                          on_cpu: bool) -> list[tuple[str, list[Term]]]:
    """The last stage's loss backward: log-softmax backward's two B x T x V x 4 B gradients (as
    memfit.estimate.analytic's loss backward). Every stage's first block backward: one layer's backward
    temporaries (analytic's layer_temporaries) and, when that block is checkpointed, the block rebuilt."""
    from .step_model import StepModel

    out = []
    if held.last:
        out.append(("loss backward", [Term(
            TermKey.LOSS_BACKWARD, Category.TEMPORARIES, 2 * own.vocab_size * setup.tokens_per_micro_step * 4,
            "2 x B x T x V x 4 B: gradients of log-softmax and of the logits", "aten log_softmax_backward")]))
    tokens, seq = setup.tokens_per_micro_step, setup.seq_len
    step = StepModel.for_block(own, setup, on_cpu)
    per_layer = step.per_layer
    block = [step.layer_temporaries()]
    if setup.checkpointing.checkpointed(held.num_layers // setup.pp_virtual_stages - 1):
        rebuilt = sum(per_layer.values())
        if setup.checkpointing.value == "selective-op":
            rebuilt -= act.selective_kept_bytes(own, setup, tokens, seq, on_cpu)
        block.append(Term(TermKey.RECOMPUTED_BLOCK, Category.ACTIVATIONS, rebuilt,
                          "the stage's last block, rebuilt in its backward", "torch.utils.checkpoint"))
    out.append(("block backward", block))
    return out


def _autocast_copies(spec: ModelSpec, held: RankStages, setup: TrainingSetup) -> list[Term]:
    """Under autocast, the bf16 / fp16 casts of the stage's Linear weights, cached by autocast for the region and
    saved for backward (as memfit.estimate.analytic's autocast_weight_copies, once for the step's region): its
    layers' share of the blocks' projections, and on the last stage the LM head's (a tied head's copy included)."""
    if not setup.precision.is_autocast:
        return []
    from .forward_terms import linear_weight_parts

    blocks, outside = linear_weight_parts(spec)
    elems = blocks * held.num_layers // max(spec.num_layers, 1) + (outside if held.last else 0)
    return [Term(TermKey.AUTOCAST_WEIGHT_COPIES, Category.ACTIVATIONS, 2 * elems,
                 "2 B x the stage's Linear weights: casts cached by autocast, saved for backward",
                 "torch.autocast weight cast cache")]


def estimate(spec: ModelSpec, setup: TrainingSetup, sized: TrainingSetup, hardware, notes: tuple[str, ...] = ()):
    """The MemoryEstimate of the pipeline rank that peaks highest (`setup`: the user's; `sized`: the setup as the
    engine runs it, on one context-parallel rank), with every rank's peak in the notes."""
    from .device import runtime_overhead_terms
    from .result import MemoryEstimate

    from . import context_parallel

    changes = context_parallel.step_changes(spec, setup, act.dtypes(spec, sized, hardware.is_cpu).compute)
    stages = stage_memories(spec, sized, hardware.is_cpu, changes)
    peak = max(stages, key=lambda s: s.tensor_bytes)
    terms = list(peak.terms)
    terms += runtime_overhead_terms(peak.tensor_bytes, setup, hardware, spec=stage_spec(spec, peak.held),
                                    terms=peak.terms)
    phase_peaks: dict[Phase, int] = {}
    for stage in stages:
        phase_peaks[stage.phase] = max(phase_peaks.get(stage.phase, 0), stage.tensor_bytes)
    return MemoryEstimate(terms=tuple(terms), peak_phase=peak.phase, method="analytic", setup=setup,
                          phase_peaks=phase_peaks, notes=notes + (stage_note(sized, stages, peak),),
                          model_name=spec.name, device_name=hardware.gpu.name)


def stage_note(setup: TrainingSetup, stages: list[StageMemory], peak: StageMemory) -> str:
    from ..units import format_bytes

    per_rank = ", ".join(f"rank {s.held.rank} {format_bytes(s.tensor_bytes)} ({s.held.num_layers} layers, "
                         f"{s.in_flight} in flight)" for s in stages)
    return (f"pipeline {setup.pp_schedule} over {setup.pp} ranks x {setup.pp_virtual_stages} stage(s), "
            f"{setup.grad_accum_steps} micro-batches: pipeline rank {peak.held.rank} peaks ({peak.moment}); "
            f"tensor peaks {per_rank}")

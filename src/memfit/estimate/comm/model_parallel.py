"""Tensor, sequence, context, pipeline and expert parallelism's collectives (memfit.estimate.comm)."""

from __future__ import annotations


from ...model_spec import ModelSpec
from ...setup import Checkpointing, TrainingSetup
from .result import Collective
from .runtime import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SEND


def context_parallel_collectives(spec: ModelSpec, setup: TrainingSetup) -> list[Collective]:
    """Ring attention's K/V and dK/dV traffic inside each context-parallel group, per layer and micro-step
    (memfit.estimate.context_parallel.collectives_per_layer)."""
    if setup.cp < 2:
        return []
    from ..activations import dtypes
    from ..context_parallel import collectives_per_layer

    calls = spec.num_layers * setup.grad_accum_steps
    return [Collective(kind, what, elements, size, per_layer * calls, group="context")
            for kind, what, elements, size, per_layer in
            collectives_per_layer(spec, setup, dtypes(spec, setup).compute)]


def pipeline_collectives(spec: ModelSpec, setup: TrainingSetup, rank: int | None = None) -> list[Collective]:
    """What pipeline rank `rank` (default: the busiest) sends point to point per step (see the module docstring)."""
    if setup.pp < 2:
        return []
    from ..pipeline import boundary_bytes, rank_stages

    num_stages = setup.pp * setup.pp_virtual_stages
    ranks = range(setup.pp) if rank is None else (rank,)
    counts = {r: [sum(s < num_stages - 1 for s in rank_stages(spec, setup, r).stages),
                  sum(s > 0 for s in rank_stages(spec, setup, r).stages)] for r in ranks}
    forward, backward = max(counts.values(), key=sum)
    boundary = boundary_bytes(spec, setup) // _residual_bytes(spec, setup)
    dtype, m = _residual_bytes(spec, setup), setup.grad_accum_steps
    return [c for c in (
        Collective(SEND, "stage outputs to the next stage, per micro-batch", boundary, dtype, forward * m,
                   group="pipeline"),
        Collective(SEND, "input gradients to the previous stage, per micro-batch", boundary, dtype, backward * m,
                   group="pipeline")) if c.calls_per_step]


def _residual_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    from ..activations import dtypes

    return dtypes(spec, setup).residual


def _largest_stage(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    if setup.pp < 2:
        return spec
    from ..pipeline import rank_stages, stage_spec

    return max((stage_spec(spec, rank_stages(spec, setup, r)) for r in range(setup.pp)), key=lambda s: s.num_params)


def tensor_parallel_collectives(spec: ModelSpec, setup: TrainingSetup) -> list[Collective]:
    """What one tensor-parallel rank sends per optimizer step inside its group (see the module docstring)."""
    if setup.tp < 2:
        return []
    from ..activations import column_parallel_inputs, dtypes

    elements, dtype = setup.tokens_per_micro_step * spec.hidden_size, dtypes(spec, setup).compute
    layers, micro = spec.num_layers, setup.grad_accum_steps
    recomputed = _recomputed_blocks(setup, layers)
    if setup.sequence_parallel:
        per_step = (2 * layers + 1) * micro * 2  # forward and backward
        return [Collective(ALL_GATHER, "layer inputs (attention, MLP, LM head) gathered from the sequence shards, "
                           "and in backward the gradients of the row-parallel outputs" + _RECOMPUTE_AG, elements,
                           dtype, per_step + 2 * recomputed * micro, group="tensor"),
                Collective(REDUCE_SCATTER, "row-parallel outputs and the embedding to the sequence shards, and in "
                           "backward the gathered inputs' gradients" + _RECOMPUTE_RS, elements, dtype,
                           per_step + recomputed * micro, group="tensor")]
    column_inputs = column_parallel_inputs(spec)
    return [Collective(ALL_REDUCE, "row-parallel outputs (attention, MLP) and the vocabulary-parallel embedding, "
                       "in forward" + _RECOMPUTE_AR, elements, dtype, (2 * layers + 1 + recomputed) * micro,
                       group="tensor"),
            Collective(ALL_REDUCE, f"each column-parallel input gradient ({column_inputs} per layer) and the LM "
                       "head's, in backward", elements, dtype, (column_inputs * layers + 1) * micro, group="tensor")]


def _recomputed_blocks(setup: TrainingSetup, layers: int) -> int:
    """Blocks whose forward checkpointing re-runs in backward, collectives included (full / every-N). Non-reentrant
    checkpoint stops the recompute once the last saved tensor is back (torch.utils.checkpoint early stop, on by
    default), so a block's final collective (the MLP output's all-reduce / reduce-scatter) is not re-issued.
    Selective op-level checkpointing is left out: which collectives it re-issues depends on its policy's save list."""
    if setup.checkpointing is Checkpointing.SELECTIVE_OP:
        return 0
    return setup.checkpointing.checkpointed_blocks(layers)


_RECOMPUTE_AG = "; with checkpointing, each recomputed block's two input gathers again"
_RECOMPUTE_RS = "; with checkpointing, each recomputed block's attention output again"
_RECOMPUTE_AR = "; with checkpointing, each recomputed block's attention output again"


ALL_TO_ALL = "all-to-all"


def _expert_parallel(spec: ModelSpec, setup: TrainingSetup) -> list[Collective]:
    """Expert parallelism: per MoE layer and micro-step, the tokens' rows go out to the ranks holding their experts
    and come back (dispatch, combine: T x k x h each, balanced routing), and backward sends their gradients the same
    two ways (GShard sec. 2.2 / Megatron-Core MoE token dispatcher)."""
    from .. import moe

    route = moe.routing(spec, setup)
    if route is None or route.ep <= 1:
        return []
    layers = moe.moe_layers(spec)
    h = moe.experts_nodes(spec)[0].expert.hidden
    size = setup.precision.compute_bytes
    calls = 4 * layers * setup.grad_accum_steps
    return [Collective(ALL_TO_ALL, f"MoE token dispatch + combine, forward and backward, over EP groups of "
                       f"{route.ep} ({layers} MoE layers)", route.balanced_rows * h, size, calls)]


def _expert_parallel_notes(spec: ModelSpec, setup: TrainingSetup) -> tuple[str, ...]:
    from .. import moe

    route = moe.routing(spec, setup)
    if route is None or route.ep <= 1:
        return ()
    e = moe.experts_nodes(spec)[0]
    return (f"expert parallelism: {setup.num_gpus // route.ep} EP group(s) of {route.ep} ranks, "
            f"{e.num_experts // route.ep} of {e.num_experts} experts per rank; the all-to-all volume assumes "
            f"balanced routing ({route.balanced_rows:,} rows per rank per layer), up to {route.worst_rows:,} "
            f"({route.name})",)

"""Communication per optimizer step: the one model of what each data-parallel rank sends, per engine and ZeRO stage.

Convention (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054, sec. 7): a collective over a buffer of Psi elements
moves Psi per rank for a reduce-scatter, an all-gather or a broadcast, and 2 Psi for an all-reduce (a ring all-reduce
is a reduce-scatter followed by an all-gather). A ring sends (N-1)/N of that per rank; the paper, and
`Collective.num_bytes`, round it to 1 (`CommVolume.ring_bytes_per_rank` keeps it). Bytes are Psi in the dtype that
goes over the wire. The paper's figures: data parallelism 2 Psi, ZeRO-1 and ZeRO-2 2 Psi (reduce-scatter of the
gradients, all-gather of the updated parameters), ZeRO-3 3 Psi (the parameters gathered in forward and again in
backward, then the gradients reduce-scattered).

What each engine really does (counted on 2 gloo ranks through the dispatcher, memfit._torch.comm_count, torch 2.13,
DeepSpeed 0.19, with accumulation 1 and 2, fp32, amp-bf16, bf16 and bf16-master; tests/test_launch.py re-counts DDP,
ZeroRedundancyOptimizer, FSDP2 ZeRO-2/3 and DeepSpeed ZeRO-2/3, and 2 micro-steps on FSDP2 and DeepSpeed ZeRO-2):

- DDP (engine torch, no sharding): one all-reduce of the gradients per optimizer step, in the gradient dtype (fp32
  under autocast, since the weights are fp32). memfit's engine all-reduces after the last micro-step, as DDP under
  `no_sync` (HF Trainer, accelerate) does. 2 Psi: the paper's figure.
- ZeroRedundancyOptimizer (engine torch, ZeRO-1): the same all-reduce of whole gradients, then each rank broadcasts
  the parameters it stepped (torch/distributed/optim/zero_redundancy_optimizer.py, `_sync_params`): 3 Psi where the
  paper's ZeRO-1 moves 2 Psi, because torch reduces every gradient everywhere instead of reduce-scattering.
- FSDP2 (engine torch, ZeRO-2 = reshard_after_forward=False, ZeRO-3 = True): per micro-step, an all-gather of the
  parameters before forward (ZeRO-3: again before backward) and a reduce-scatter of the gradients after backward;
  FSDP2 re-shards after every backward and reduce-scatters every micro-step unless the loop turns gradient sync off
  (`set_requires_gradient_sync(False)`, which memfit's loop does not). Gathers travel in the compute dtype; under
  memfit's MixedPrecisionPolicy (amp-*, bf16-master) gradients are reduced in fp32 (`reduce_dtype`), so ZeRO-2 with
  amp-bf16 moves Psi in bf16 plus Psi in fp32 rather than 2 Psi of one dtype. With accumulation 1: the paper's 2 Psi
  and 3 Psi.
- DeepSpeed (`communication_data_type`: the 16-bit dtype when bf16/fp16 is on, else fp32). ZeRO-0: one all-reduce
  at the accumulation boundary, 2 Psi. ZeRO-1 and ZeRO-2: each gradient bucket is all-reduced and each rank keeps
  its partition (runtime/zero/stage_1_and_2.py `average_tensor`: `use_multi_rank_bucket_allreduce` defaults to
  true), then the updated partitions are all-gathered: 3 Psi, not the paper's 2 (with that flag off it reduces to
  each partition's owner instead). ZeRO-1 reduces once, at the boundary; ZeRO-2 in every micro-step's backward.
  ZeRO-3: per micro-step, an all-gather in forward, a reduce-scatter of the gradients, and in backward an all-gather
  of what forward released: DeepSpeed keeps a parameter gathered when it is used again within
  `stage3_max_reuse_distance` (1e9) parameter elements (partitioned_param_coordinator.py `__params_to_release`).
  A block's reuse lies twice the parameters after it away (the rest of forward, then backward down to it), so
  memfit counts the last half of that distance as kept: backward re-gathers Psi - min(Psi, 5e8 elements), an
  approximation (a tiny model keeps everything: 2 Psi in all; Llama-2-70B re-gathers all but 0.7%). The first step
  gathers everything twice, before DeepSpeed has recorded the parameter order; these are the later steps.
- Tensor parallelism (engine torch, DTensor as torchtitan applies it; memfit.estimate.tensor_parallel): inside
  each tensor-parallel group, per micro-step, in the compute dtype, on buffers of B x T x h (one micro-batch's layer
  input). Without sequence parallelism every row-parallel output (attention, MLP) is all-reduced in forward, and in
  backward every column-parallel projection's input gradient is: DTensor reduces each ColwiseParallel module's
  input gradient on its own, so unfused q/k/v and gate/up projections make 3 + 2 all-reduces per layer where
  Megatron-LM's fused QKV and fused h-to-4h make 2 (Shoeybi et al. 2019 sec. 3: 2 all-reduces forward, 2 backward).
  The vocabulary-parallel embedding all-reduces its output, and the LM head its input gradient. With sequence
  parallelism each all-reduce becomes a reduce-scatter (forward of a row-parallel output) and an all-gather (the
  input of each attention / MLP, gathered once for all its projections), mirrored in backward: 4 all-gathers and 4
  reduce-scatters of B x T x h per layer (Korthikanti et al. 2022 sec. 4.2.2), plus one of each for the embedding
  and the LM head. Counted on 2 gloo ranks (tests/test_tensor_parallel.py). Data-parallel collectives then cover
  one tensor-parallel rank's parameters over the num_gpus / tp data-parallel ranks; loss_parallel's B x T
  statistics are not counted.
- HSDP (engine torch, FSDP2 on a 2D (replicate, shard) mesh; setup.dp_shard): the all-gathers and the
  reduce-scatter run inside each shard group of dp_shard ranks, on the whole Psi as above; then each rank's
  gradient shard, Psi / dp_shard elements, is all-reduced across the dp / dp_shard replicas, per micro-step
  (torch fsdp _fsdp_collectives.foreach_reduce: reduce_scatter on the shard group, all_reduce on the replicate
  group). A ring sends (s-1)/s of the first and (r-1)/r of the second; with the shard groups inside a node only the
  all-reduce crosses the network. DeepSpeed's MiCS (shard groups, replicated across) and ZeRO++ hpZ (a secondary
  parameter partition inside a node) have the same shape; they are not sized.
- Context parallelism (engine torch, torch context_parallel ring attention; memfit.estimate.context_parallel):
  inside each group of cp ranks, per layer and micro-step, the K/V chunks (allgather: one all-gather of cp x 2 x
  B x T/cp x h_kv x d, in forward and again in backward; alltoall: cp - 1 permutes of one chunk each way) and, in
  backward, cp permutes of the fp32 dK/dV chunk. Data-parallel collectives then span the dp x cp ranks. Not
  counted on a run (ring attention does not run on CPU).
- Pipeline parallelism (engine torch, torch.distributed.pipelining; memfit.estimate.pipeline): point-to-point, per
  optimizer step, each of the m = grad_accum_steps micro-batches' B x T x h boundary tensor in the residual dtype:
  every non-last stage sends its output forward, every non-first stage its input gradient backward (stage.py
  get_fwd_send_ops / get_bwd_send_ops). Counted on 2 gloo ranks (tests/test_pipeline.py). Data-parallel collectives
  then cover one pipeline rank's parameters (the largest stage's) over the num_gpus / (tp x pp) data-parallel ranks.
- Scalars (gradient norms, overflow checks) are not counted. Parameter offload adds host<->device copies
  (techniques.costs.offload_traffic_bytes), not network traffic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Checkpointing, Engine, Offload, Precision, Sharding, TrainingSetup

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST = "all-reduce", "reduce-scatter", "all-gather", "broadcast"
SEND = "send"
DEEPSPEED_MAX_REUSE_DISTANCE = 10**9
"""DeepSpeed's stage3_max_reuse_distance default, in parameter elements (runtime/zero/config.py)."""
PAPER_PSI_MULTIPLE = {0: 2, 1: 2, 2: 2, 3: 3}
"""ZeRO paper sec. 7: what each rank moves per step, in units of Psi, for data parallelism and ZeRO-1/2/3."""


class Runtime(enum.Enum):
    """What runs data parallelism for a setup: derived from (Engine, Sharding) by `runtime_of`, never typed in."""

    SINGLE = "one process (no communication)"
    DDP = "torch data parallel (gradients all-reduced)"
    ZERO_REDUNDANCY = "torch ZeroRedundancyOptimizer (ZeRO-1)"
    FSDP2_NO_RESHARD = "FSDP2 fully_shard, reshard_after_forward=False (ZeRO-2)"
    FSDP2_RESHARD = "FSDP2 fully_shard, reshard_after_forward=True (ZeRO-3)"
    DEEPSPEED = "DeepSpeed ZeRO"

    @property
    def is_fsdp2(self) -> bool:
        return self in (Runtime.FSDP2_NO_RESHARD, Runtime.FSDP2_RESHARD)


def runtime_of(engine: Engine, sharding: Sharding, world_size: int = 2) -> Runtime:
    """The one mapping from the setup's engine and ZeRO stage to what runs it (memfit._torch.engine.prepare)."""
    if engine is Engine.DEEPSPEED:
        return Runtime.DEEPSPEED
    if sharding is Sharding.NONE:
        return Runtime.SINGLE if world_size < 2 else Runtime.DDP
    return {Sharding.ZERO1: Runtime.ZERO_REDUNDANCY, Sharding.ZERO2: Runtime.FSDP2_NO_RESHARD,
            Sharding.ZERO3: Runtime.FSDP2_RESHARD}[sharding]


def deepspeed_stage(setup: TrainingSetup) -> int:
    """The stage DeepSpeed runs (offload alone runs ZeRO-1): memfit.emit.deepspeed.zero_stage."""
    from ..emit.deepspeed import zero_stage

    return zero_stage(setup)


def describe_runtime(setup: TrainingSetup) -> str:
    runtime = runtime_of(setup.engine, setup.sharding, setup.dp_size)
    if setup.tp > 1:
        sp = " + sequence parallel" if setup.sequence_parallel else ""
        return (f"torch DTensor tensor parallel (tp={setup.tp}{sp}) x {runtime.value} on {setup.dp_size} "
                "data-parallel groups")
    if runtime is Runtime.DEEPSPEED:
        return f"DeepSpeed ZeRO stage {deepspeed_stage(setup)}"
    return runtime.value


# ------------------------------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class Collective:
    name: str
    """'all-reduce', 'reduce-scatter', 'all-gather' or 'broadcast'."""
    what: str
    num_elements: int
    """Elements of the whole buffer one call covers (Psi for the whole model)."""
    dtype_bytes: int
    calls_per_step: int = 1
    """Calls per optimizer step: the micro-steps, for what an engine does in every backward."""
    group: str = "data"
    """Which ranks take part: 'data' (the data-parallel ranks, or an HSDP shard group), 'replicate' (the HSDP
    replicas of one shard), 'tensor' (one tensor-parallel group), 'context' (one context-parallel group) or
    'pipeline' (point to point, stage to stage)."""

    @property
    def payload_bytes(self) -> int:
        """Bytes of the buffers covered per step: what memfit._torch.comm_count measures."""
        return self.num_elements * self.dtype_bytes * self.calls_per_step

    @property
    def volume_elements(self) -> int:
        return self.num_elements * self.calls_per_step * (2 if self.name == ALL_REDUCE else 1)

    @property
    def num_bytes(self) -> int:
        """Bytes each rank sends per step in the paper's convention (2x the payload for an all-reduce)."""
        return self.volume_elements * self.dtype_bytes

    def to_dict(self) -> dict:
        return {"name": self.name, "what": self.what, "elements": self.num_elements, "dtype_bytes": self.dtype_bytes,
                "calls_per_step": self.calls_per_step, "payload_bytes": self.payload_bytes, "bytes": self.num_bytes,
                "group": self.group}


@dataclass(frozen=True)
class CommVolume:
    """What each rank sends per optimizer step, split by collective (see the module docstring)."""

    collectives: tuple[Collective, ...]
    num_params: int
    world_size: int
    num_nodes: int = 1
    gpus_per_node: int = 1
    runtime: Runtime = Runtime.DDP
    notes: tuple[str, ...] = ()
    tp: int = 1
    """Tensor-parallel degree: world_size / tp data-parallel ranks; the 'tensor' collectives run inside a group."""
    pp: int = 1
    """Pipeline-parallel degree: world_size / (tp x pp) data-parallel ranks; 'pipeline' sends go stage to stage."""
    shard_size: int = 0
    """HSDP: the shard group the 'data' collectives run in (0: every data-parallel rank)."""

    @property
    def replicas(self) -> int:
        return max(1, self.dp_size // self.shard_size) if self.shard_size else 1

    @property
    def dp_size(self) -> int:
        """Ranks of the data-parallel collectives: world_size / (tp x pp), the context-parallel ranks included."""
        return max(1, self.world_size // (self.tp * self.pp))

    @property
    def per_rank_bytes(self) -> int:
        return sum(c.num_bytes for c in self.collectives)

    @property
    def data_parallel_bytes(self) -> int:
        return sum(c.num_bytes for c in self.collectives if c.group in ("data", "replicate"))

    @property
    def replicate_bytes(self) -> int:
        """HSDP: what each rank sends across the replicas (the gradient shards' all-reduce)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "replicate")

    @property
    def tensor_parallel_bytes(self) -> int:
        """What each rank sends inside its tensor-parallel group per step (activations: B x T x h buffers)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "tensor")

    @property
    def context_parallel_bytes(self) -> int:
        """What each rank sends inside its context-parallel group per step (ring attention's K/V and dK/dV)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "context")

    @property
    def pipeline_parallel_bytes(self) -> int:
        """What the busiest pipeline rank sends to its neighbours per step (point to point, all of it on the wire)."""
        return sum(c.num_bytes for c in self.collectives if c.group == "pipeline")

    @property
    def ring_bytes_per_rank(self) -> int:
        """What a ring actually sends per rank: (N-1)/N of `per_rank_bytes`, N the ranks of each collective's group."""
        tp = self.tp
        data = self._ring_data_bytes()
        return (data + (self.tensor_parallel_bytes * (tp - 1) // tp if tp > 1 else 0)
                + self.pipeline_parallel_bytes + self.context_parallel_bytes)

    def _ring_data_bytes(self) -> int:
        """(N-1)/N of the data-parallel volume, N each collective's group: the shard group and the replicas."""
        shard, r = self.shard_size or self.dp_size, self.replicas
        inner = self.data_parallel_bytes - self.replicate_bytes
        return ((inner * (shard - 1) // shard if shard > 1 else 0)
                + (self.replicate_bytes * (r - 1) // r if r > 1 else 0))

    @property
    def psi_multiple(self) -> float:
        """Elements moved over P: 2 for the paper's DP and ZeRO-1/2, 3 for ZeRO-3 (see the docstring for engines);
        data-parallel collectives only, P one tensor-parallel rank's parameters."""
        data = sum(c.volume_elements for c in self.collectives if c.group in ("data", "replicate"))
        return data / self.num_params if self.num_params else 0.0

    def payload_bytes(self) -> dict[str, int]:
        """Payload bytes per collective name, comparable with memfit._torch.comm_count.CollectiveCounter."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            totals[c.name] = totals.get(c.name, 0) + c.payload_bytes
        return totals

    @property
    def inter_node_bytes_per_node(self) -> int:
        """Bytes per step crossing each node's network link. A ring over all ranks, ordered by node, sends on every
        link what each rank sends, (N-1)/N of Psi per collective; one link out of each node crosses the network,
        so each node's link carries one rank's volume and the node-local links (NVLink) carry the rest. Tensor
        parallelism stays inside a node when tp divides the GPUs per node (else its traffic crosses too)."""
        if self.num_nodes < 2:
            return 0
        data = self._ring_data_bytes()
        if self.shard_size and self.shard_size * self.tp <= self.gpus_per_node:
            # HSDP with node-local shard groups: only the replicas' all-reduce leaves the node
            r = self.replicas
            data = self.replicate_bytes * (r - 1) // r if r > 1 else 0
        crossing_tp = self.tp > self.gpus_per_node
        # torchtitan's mesh order (pp, dp, tp): a stage boundary crosses nodes once tp x dp outgrows a node
        crossing_pp = self.pp > 1 and self.world_size // self.pp >= self.gpus_per_node
        return (data + (self.tensor_parallel_bytes * (self.tp - 1) // self.tp if crossing_tp else 0)
                + (self.pipeline_parallel_bytes if crossing_pp else 0))

    @property
    def inter_node_peer_fraction(self) -> float:
        """Share of each rank's peers on other nodes, (N - G) / (N - 1): the share of its traffic that would cross
        the network without a node-aware (ring or hierarchical) algorithm."""
        if self.world_size < 2:
            return 0.0
        return (self.world_size - self.gpus_per_node) / (self.world_size - 1)

    def to_dict(self) -> dict:
        return {"per_rank_bytes": self.per_rank_bytes, "ring_bytes_per_rank": self.ring_bytes_per_rank,
                "psi_multiple": self.psi_multiple, "runtime": self.runtime.value,
                "collectives": [c.to_dict() for c in self.collectives],
                "inter_node_bytes_per_node": self.inter_node_bytes_per_node,
                "inter_node_peer_fraction": self.inter_node_peer_fraction, "world_size": self.world_size,
                "tp": self.tp, "pp": self.pp, "shard_size": self.shard_size,
                "data_parallel_bytes": self.data_parallel_bytes, "replicate_bytes": self.replicate_bytes,
                "tensor_parallel_bytes": self.tensor_parallel_bytes,
                "pipeline_parallel_bytes": self.pipeline_parallel_bytes,
                "context_parallel_bytes": self.context_parallel_bytes,
                "num_nodes": self.num_nodes, "notes": list(self.notes)}


# ---------------------------------------------------------------------------------------------------- the model


def comm_volume(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware | None = None) -> CommVolume:
    """Bytes each of `setup.num_gpus` ranks sends per optimizer step on the setup's engine. `hardware` only splits
    the ranks into nodes (default: one node)."""
    from . import moe
    from .tensor_parallel import rank_spec

    spec = rank_spec(spec, setup)  # data parallelism moves one tensor-parallel rank's parameters
    spec = moe.ep_local_spec(spec, setup)  # EP: each rank reduces its own experts' gradients (E / ep of them)
    from .context_parallel import rank_setup

    sends = pipeline_collectives(spec, rank_setup(setup))  # a context-parallel rank sends its seq / cp tokens
    spec = _largest_stage(spec, setup)  # ... and one pipeline rank's
    data_ranks = setup.dp_size * setup.cp  # torchtitan reduces gradients over the dp x cp mesh
    runtime = runtime_of(setup.engine, setup.sharding, data_ranks)
    params, trained = _gathered_and_trained(spec, setup)
    collectives = [] if data_ranks < 2 else list(_COLLECTIVES[runtime](params, setup, trained))
    if runtime.is_fsdp2:  # float8 all-gather: the Float8Linear weights travel in 1 B (memfit.estimate.float8)
        from .float8 import all_gather_collectives

        collectives = all_gather_collectives(spec, setup, collectives)
    collectives += tensor_parallel_collectives(spec, setup) + context_parallel_collectives(spec, setup)
    collectives += list(_expert_parallel(spec, setup)) + sends
    notes = _notes(runtime, setup) + _expert_parallel_notes(spec, setup)
    nodes, per_node = ((hardware.num_nodes, hardware.gpus_per_node) if hardware is not None
                       else (1, setup.num_gpus))
    return CommVolume(tuple(collectives), spec.num_params, setup.num_gpus, nodes, per_node, runtime, notes,
                      tp=setup.tp, pp=setup.pp, shard_size=setup.shard_size if setup.dp_shard else 0)


def context_parallel_collectives(spec: ModelSpec, setup: TrainingSetup) -> list[Collective]:
    """Ring attention's K/V and dK/dV traffic inside each context-parallel group, per layer and micro-step
    (memfit.estimate.context_parallel.collectives_per_layer)."""
    if setup.cp < 2:
        return []
    from .activations import dtypes
    from .context_parallel import collectives_per_layer

    calls = spec.num_layers * setup.grad_accum_steps
    return [Collective(kind, what, elements, size, per_layer * calls, group="context")
            for kind, what, elements, size, per_layer in
            collectives_per_layer(spec, setup, dtypes(spec, setup).compute)]


def pipeline_collectives(spec: ModelSpec, setup: TrainingSetup, rank: int | None = None) -> list[Collective]:
    """What pipeline rank `rank` (default: the busiest) sends point to point per step (see the module docstring)."""
    if setup.pp < 2:
        return []
    from .pipeline import boundary_bytes, rank_stages

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
    from .activations import dtypes

    return dtypes(spec, setup).residual


def _largest_stage(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    if setup.pp < 2:
        return spec
    from .pipeline import rank_stages, stage_spec

    return max((stage_spec(spec, rank_stages(spec, setup, r)) for r in range(setup.pp)), key=lambda s: s.num_params)


def tensor_parallel_collectives(spec: ModelSpec, setup: TrainingSetup) -> list[Collective]:
    """What one tensor-parallel rank sends per optimizer step inside its group (see the module docstring)."""
    if setup.tp < 2:
        return []
    from .activations import column_parallel_inputs, dtypes

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
    from . import moe

    route = moe.routing(spec, setup)
    if route is None or route.ep <= 1:
        return []
    layers = moe.moe_layers(spec)
    h = moe.experts_nodes(spec)[0].expert.hidden
    size = 4 if setup.precision.compute_dtype == "fp32" else 2
    calls = 4 * layers * setup.grad_accum_steps
    return [Collective(ALL_TO_ALL, f"MoE token dispatch + combine, forward and backward, over EP groups of "
                       f"{route.ep} ({layers} MoE layers)", route.balanced_rows * h, size, calls)]


def _expert_parallel_notes(spec: ModelSpec, setup: TrainingSetup) -> tuple[str, ...]:
    from . import moe

    route = moe.routing(spec, setup)
    if route is None or route.ep <= 1:
        return ()
    e = moe.experts_nodes(spec)[0]
    return (f"expert parallelism: {setup.num_gpus // route.ep} EP group(s) of {route.ep} ranks, "
            f"{e.num_experts // route.ep} of {e.num_experts} experts per rank; the all-to-all volume assumes "
            f"balanced routing ({route.balanced_rows:,} rows per rank per layer), up to {route.worst_rows:,} "
            f"({route.name})",)


def data_parallel_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """What plain data parallelism on the setup's engine sends per rank per step (DDP's all-reduce, or DeepSpeed
    ZeRO-0's), the baseline a ZeRO stage is compared with."""
    if setup.dp_size < 2:
        return 0
    from .tensor_parallel import rank_spec

    params, trained = _gathered_and_trained(rank_spec(spec, setup), setup)
    if setup.engine is Engine.DEEPSPEED:
        return _deepspeed(params, setup, trained, stage=0)[0].num_bytes
    return _ddp(params, setup, trained)[0].num_bytes


def _gathered_and_trained(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, int]:
    """(every parameter, the trained ones): under LoRA / QLoRA the frozen base is gathered (FSDP2, ZeRO-3) but
    has no gradient to reduce, nor a partition to step (DDP buckets, FSDP2's reduce-scatter and ZeRO-1/2 take
    only parameters that require grad: torch reducer.cpp, fsdp _fsdp_param_group, DeepSpeed stage_1_and_2)."""
    if not setup.finetune.adapters:
        return spec.num_params, spec.num_params
    from .lora import adapted_spec

    adapted = adapted_spec(spec, setup)
    return adapted.num_params + sum(p.total for p in adapted.frozen), adapted.num_params


def _ddp(params: int, setup: TrainingSetup, trained: int | None = None) -> list[Collective]:
    return [Collective(ALL_REDUCE, "gradients, after the last micro-step", _trained(params, trained),
                       _torch_param_bytes(setup))]


def _trained(params: int, trained: int | None) -> int:
    return params if trained is None else trained


def _zero_redundancy(params: int, setup: TrainingSetup, trained: int | None = None) -> list[Collective]:
    return [*_ddp(params, setup, trained),
            Collective(BROADCAST, "updated parameters, each from the rank that stepped it", _trained(params, trained),
                       _torch_param_bytes(setup))]


def _fsdp2(params: int, setup: TrainingSetup, trained: int | None = None) -> list[Collective]:
    micro = setup.grad_accum_steps
    gather, reduce = _fsdp2_dtype_bytes(setup)
    collectives = [Collective(ALL_GATHER, "parameters, before each forward", params, gather, micro)]
    if setup.sharding is Sharding.ZERO3:
        collectives.append(Collective(ALL_GATHER, "parameters again, before each backward", params, gather, micro))
    grads = _trained(params, trained)
    collectives.append(Collective(REDUCE_SCATTER, "gradients, after each backward", grads, reduce, micro))
    if setup.replicas > 1:  # HSDP: each gradient shard all-reduced across the replicas
        collectives.append(Collective(ALL_REDUCE, f"gradient shards across the {setup.replicas} HSDP replicas, "
                                      "after each backward", grads // setup.shard_size, reduce, micro,
                                      group="replicate"))
    return collectives


def _deepspeed(params: int, setup: TrainingSetup, trained: int | None = None,
               stage: int | None = None) -> list[Collective]:
    stage = deepspeed_stage(setup) if stage is None else stage
    micro, dtype = setup.grad_accum_steps, _deepspeed_dtype_bytes(setup)
    grads = _trained(params, trained)
    if stage == 0:
        return [Collective(ALL_REDUCE, "gradients, at the accumulation boundary", grads, dtype)]
    if stage == 3:
        regathered = params - min(params, DEEPSPEED_MAX_REUSE_DISTANCE // 2)
        collectives = [Collective(ALL_GATHER, "parameters, in each forward", params, dtype, micro)]
        if regathered:
            collectives.append(Collective(ALL_GATHER, "parameters released after forward, again in backward",
                                          regathered, dtype, micro))
        return collectives + [Collective(REDUCE_SCATTER, "gradients, in each backward", grads, dtype, micro)]
    reduce = (Collective(ALL_REDUCE, "gradient buckets, at the accumulation boundary", grads, dtype) if stage == 1
              else Collective(ALL_REDUCE, "gradient buckets, in each backward", grads, dtype, micro))
    return [reduce, Collective(ALL_GATHER, "updated parameter partitions, after the step", grads, dtype)]


_COLLECTIVES = {Runtime.SINGLE: lambda params, setup, trained=None: [], Runtime.DDP: _ddp,
                Runtime.ZERO_REDUNDANCY: _zero_redundancy, Runtime.FSDP2_NO_RESHARD: _fsdp2,
                Runtime.FSDP2_RESHARD: _fsdp2, Runtime.DEEPSPEED: _deepspeed}


def _torch_param_bytes(setup: TrainingSetup) -> int:
    """Parameters and gradients of an unsharded torch model: fp32 unless the weights are bf16 (bf16, bf16-master:
    memfit keeps the fp32 master copy in the optimizer, so gradients are bf16)."""
    return 2 if setup.precision.param_dtype == "bf16" else 4


def _fsdp2_dtype_bytes(setup: TrainingSetup) -> tuple[int, int]:
    """(all-gather, reduce-scatter) bytes per element under memfit's FSDP2 options (memfit._torch.engine.shard):
    MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype=fp32) for amp-* and bf16-master."""
    if setup.precision is Precision.FP32:
        return 4, 4
    if setup.precision is Precision.BF16:
        return 2, 2
    return 2, 4


def _deepspeed_dtype_bytes(setup: TrainingSetup) -> int:
    """DeepSpeed's communication_data_type default (runtime/engine.py): fp16 or bf16 when enabled, else fp32."""
    return 4 if setup.precision is Precision.FP32 else 2


def _notes(runtime: Runtime, setup: TrainingSetup) -> tuple[str, ...]:
    notes = []
    if runtime is Runtime.ZERO_REDUNDANCY:
        notes.append("torch's ZeRO-1 (ZeroRedundancyOptimizer) all-reduces whole gradients and broadcasts the "
                     "updated parameters: 3 Psi, where the ZeRO paper's ZeRO-1 moves 2 Psi")
    if runtime is Runtime.DEEPSPEED and deepspeed_stage(setup) in (1, 2):
        notes.append("DeepSpeed ZeRO-1/2 all-reduce gradient buckets (use_multi_rank_bucket_allreduce, on by "
                     "default) before all-gathering the updated partitions: 3 Psi, where the ZeRO paper moves 2 Psi")
    if setup.grad_accum_steps > 1 and (runtime.is_fsdp2 or (
            runtime is Runtime.DEEPSPEED and deepspeed_stage(setup) >= 2)):
        notes.append(f"gradients are reduced in each of the {setup.grad_accum_steps} micro-steps, not once per step")
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        notes.append("parameter offload adds host<->device copies (techniques.costs.offload_traffic_bytes), not "
                     "network traffic")
    return tuple(notes)

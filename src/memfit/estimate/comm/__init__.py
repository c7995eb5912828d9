"""Communication per optimizer step: the one model of what each data-parallel rank sends, per engine and ZeRO stage.

Convention (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054, sec. 7): a collective over a buffer of Psi elements
moves Psi per rank for a reduce-scatter, an all-gather or a broadcast, and 2 Psi for an all-reduce (a ring all-reduce
is a reduce-scatter followed by an all-gather). A ring sends (N-1)/N of that per rank; the paper, and
`Collective.num_bytes`, round it to 1 (`CommVolume.ring_bytes_per_rank` keeps it). Bytes are Psi in the dtype that
goes over the wire. The paper's figures: data parallelism 2 Psi, ZeRO-1 and ZeRO-2 2 Psi (reduce-scatter of the
gradients, all-gather of the updated parameters), ZeRO-3 3 Psi (the parameters gathered in forward and again in
backward, then the gradients reduce-scattered).

What each engine really does (counted on 2 gloo ranks through the dispatcher, memfit._torch.comm_count, torch 2.13,
DeepSpeed 0.19, with accumulation 1 and 2, fp32, amp-bf16, bf16 and bf16-master; tests/engines/test_launch.py re-counts DDP,
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
  and the LM head. Counted on 2 gloo ranks (tests/estimate/test_tensor_parallel.py). Data-parallel collectives then cover
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
  get_fwd_send_ops / get_bwd_send_ops). Counted on 2 gloo ranks (tests/estimate/test_pipeline.py). Data-parallel collectives
  then cover one pipeline rank's parameters (the largest stage's) over the num_gpus / (tp x pp) data-parallel ranks.
- Scalars (gradient norms, overflow checks) are not counted. Parameter offload adds host<->device copies
  (techniques.costs.offload_traffic_bytes), not network traffic.
"""

from __future__ import annotations


from ...hardware import Hardware
from ...model_spec import ModelSpec
from ...setup import TrainingSetup
from .data_parallel import _COLLECTIVES, _gathered_and_trained, _notes, data_parallel_bytes
from .model_parallel import (ALL_TO_ALL, _expert_parallel, _expert_parallel_notes, _largest_stage,
                             context_parallel_collectives, pipeline_collectives, tensor_parallel_collectives)
from .result import Collective, CommVolume
from .runtime import (ALL_GATHER, ALL_REDUCE, BROADCAST, DEEPSPEED_MAX_REUSE_DISTANCE, PAPER_PSI_MULTIPLE,
                      REDUCE_SCATTER, SEND, Runtime, deepspeed_stage, describe_runtime, runtime_of)

__all__ = [
    "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "BROADCAST", "DEEPSPEED_MAX_REUSE_DISTANCE", "PAPER_PSI_MULTIPLE",
    "REDUCE_SCATTER", "SEND", "Collective", "CommVolume", "Runtime", "comm_volume", "context_parallel_collectives",
    "data_parallel_bytes", "deepspeed_stage", "describe_runtime", "pipeline_collectives", "runtime_of",
    "tensor_parallel_collectives",
]


# ---------------------------------------------------------------------------------------------------- the model


def comm_volume(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware | None = None) -> CommVolume:
    """Bytes each of `setup.num_gpus` ranks sends per optimizer step on the setup's engine. `hardware` only splits
    the ranks into nodes (default: one node)."""
    from .. import moe
    from ..tensor_parallel import rank_spec

    spec = rank_spec(spec, setup)  # data parallelism moves one tensor-parallel rank's parameters
    spec = moe.ep_local_spec(spec, setup)  # EP: each rank reduces its own experts' gradients (E / ep of them)
    from ..context_parallel import rank_setup

    sends = pipeline_collectives(spec, rank_setup(setup))  # a context-parallel rank sends its seq / cp tokens
    spec = _largest_stage(spec, setup)  # ... and one pipeline rank's
    data_ranks = setup.dp_size * setup.cp  # torchtitan reduces gradients over the dp x cp mesh
    runtime = runtime_of(setup.engine, setup.sharding, data_ranks)
    params, trained = _gathered_and_trained(spec, setup)
    collectives = [] if data_ranks < 2 else list(_COLLECTIVES[runtime](params, setup, trained))
    if runtime.is_fsdp2:  # float8 all-gather: the Float8Linear weights travel in 1 B (memfit.estimate.float8)
        from ..float8 import all_gather_collectives

        collectives = all_gather_collectives(spec, setup, collectives)
    collectives += tensor_parallel_collectives(spec, setup) + context_parallel_collectives(spec, setup)
    collectives += list(_expert_parallel(spec, setup)) + sends
    notes = _notes(runtime, setup) + _expert_parallel_notes(spec, setup)
    nodes, per_node = ((hardware.num_nodes, hardware.gpus_per_node) if hardware is not None
                       else (1, setup.num_gpus))
    return CommVolume(tuple(collectives), spec.num_params, setup.num_gpus, nodes, per_node, runtime, notes,
                      tp=setup.tp, pp=setup.pp, shard_size=setup.shard_size if setup.dp_shard else 0)

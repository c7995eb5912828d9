"""Context parallelism, per rank: ring attention over `cp` ranks that split every sequence (torch 2.13
torch.distributed.tensor.experimental.context_parallel, _context_parallel/_attention.py; torchtitan's
context_parallel_degree and context_parallel_rotate_method).

Each rank of a context-parallel group holds seq_len / cp tokens of every activation (the inputs are sharded along
the sequence before the model; with load balancing, torch's _HeadTailLoadBalancer gives each rank chunk i and
2cp - 1 - i of 2cp, the zig-zag order, so causal attention costs every rank the same; memory is the same either way).
So one rank's activations are those of the model at seq_len / cp (`rank_setup`), and static memory is unchanged
except that torchtitan shards FSDP over the dp x cp mesh (memfit.setup.TrainingSetup.shard_size).

On top, the ring attention's own buffers while one layer's attention runs (b batch, h / h_kv heads, d head dim,
s_local = seq_len / cp, q = b h s_local d and kv = b h_kv s_local d elements, e the compute dtype's bytes):

- forward (_templated_ring_attention): K and V concatenated (2 kv x e) and, rotate method allgather (the default),
  all-gathered once: every rank's chunk, cp x 2 kv x e; alltoall passes one chunk on per step (permute_tensor,
  2 kv x e received). _SDPAMerger merges the partial outputs in fp32 (convert_to_f32): out and lse, q x 4 + lse.
- backward (_templated_ring_attention_backward): K/V gathered or rotated again as in forward; fp32 accumulators
  grad_query, grad_key, grad_value (zeros_like(dtype=float32): (q + 2 kv) x 4); each step's SDPA gradients
  ((q + 2 kv) x e); and the K/V gradients travel by permute_tensor in fp32 whatever the method (dkv_rotater =
  ALL_TO_ALL): the sent and the received copy, 2 x 2 kv x 4.

The backward set is the larger: `ring_backward_bytes`, added to every block-backward moment. A real run needs the
flash or memory-efficient SDPA kernel (the only ones the ring dispatch handles, _sdpa_handler); torch's CPU SDPA
runs neither, so memfit sizes CP on paper only.
"""

from __future__ import annotations

import dataclasses

from ..model_spec import ModelSpec
from ..setup import CpRotate, TrainingSetup
from .result import Category, Term
from .moments import AddBeside
from .terms import TermKey

SOURCE = "torch 2.13 distributed/tensor/experimental/_context_parallel/_attention.py (ring attention)"


def rank_setup(setup: TrainingSetup) -> TrainingSetup:
    """The setup one context-parallel rank runs: seq_len / cp tokens per sequence; the static memory sharded over
    the same dp x cp ranks (the cp ranks folded into the data-parallel shard group). `setup` itself when cp is 1."""
    if setup.cp == 1:
        return setup
    shard = setup.shard_size
    return dataclasses.replace(setup, seq_len=setup.seq_len // setup.cp, cp=1,
                               dp_shard=shard if setup.dp_shard else 0)


def _local_elements(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, int]:
    """(q, kv) elements of one layer's local query and key (= value) chunk on one rank."""
    local = setup.micro_batch_size * (setup.seq_len // setup.cp)
    head_dim = spec.head_dim
    return local * spec.num_attention_heads * head_dim, local * spec.num_kv_heads * head_dim


def ring_forward_bytes(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> int:
    q, kv = _local_elements(spec, setup)
    received = setup.cp * 2 * kv if setup.cp_rotate is CpRotate.ALLGATHER else 2 * kv
    lse = q // max(spec.head_dim, 1) * 4
    return (2 * kv + received) * compute_bytes + q * 4 + lse


def ring_backward_bytes(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> int:
    """One layer's ring-attention backward buffers beyond plain SDPA's (see the module docstring)."""
    q, kv = _local_elements(spec, setup)
    received = setup.cp * 2 * kv if setup.cp_rotate is CpRotate.ALLGATHER else 2 * kv
    kv_buffers = (2 * kv + received) * compute_bytes
    accumulators = (q + 2 * kv) * 4
    step_grads = (q + 2 * kv) * compute_bytes
    dkv_rotation = 2 * 2 * kv * 4
    return kv_buffers + accumulators + step_grads + dkv_rotation


def ring_term(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> Term:
    """The ring attention's backward buffers, as a term of a block-backward moment (`setup`: the user's, cp > 1)."""
    gathered = "all cp K/V chunks gathered" if setup.cp_rotate is CpRotate.ALLGATHER else "one K/V chunk received"
    return Term(TermKey.RING_ATTENTION, Category.TEMPORARIES, ring_backward_bytes(spec, setup, compute_bytes),
                f"ring attention backward over cp={setup.cp}: local K/V + {gathered}, fp32 dq/dk/dv accumulators, "
                "one step's SDPA gradients, the fp32 dK/dV sent and received", SOURCE)


def step_changes(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> list[AddBeside]:
    """Ring attention's buffers beside every block's backward (`setup`: the user's); none without cp."""
    if setup.cp == 1:
        return []
    return [AddBeside(ring_term(spec, setup, compute_bytes), TermKey.LAYER_BACKWARD)]


def collectives_per_layer(spec: ModelSpec, setup: TrainingSetup,
                          compute_bytes: int) -> list[tuple[str, str, int, int, int]]:
    """(kind, what, elements, dtype bytes, calls per layer and micro-step) of one layer's ring attention, forward
    and backward: allgather: one all-gather of K/V each way; alltoall: cp - 1 K/V steps each way; either: the dK/dV
    ring, cp permutes in fp32."""
    _, kv = _local_elements(spec, setup)
    if setup.cp_rotate is CpRotate.ALLGATHER:
        kv_moves = [("all-gather", "K/V chunks, in forward and again in backward", setup.cp * 2 * kv,
                     compute_bytes, 2)]
    else:
        kv_moves = [("all-to-all", "K/V chunk to the next rank, forward and backward", 2 * kv, compute_bytes,
                     2 * (setup.cp - 1))]
    return kv_moves + [("all-to-all", "dK/dV to the next rank (fp32), in backward", 2 * kv, 4, setup.cp)]


def notes(setup: TrainingSetup) -> tuple[str, ...]:
    if setup.cp == 1:
        return ()
    return (f"context parallel over {setup.cp} ranks ({setup.cp_rotate}): each holds {setup.seq_len // setup.cp} "
            f"of the {setup.seq_len} tokens of every activation (load-balanced zig-zag chunks), static memory "
            f"sharded over dp x cp = {setup.shard_size} ranks; sized on paper from torch's ring attention (it "
            "needs the flash / memory-efficient SDPA kernels, not on CPU)",)

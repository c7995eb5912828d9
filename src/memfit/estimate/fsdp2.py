"""What FSDP2 (`fully_shard` per block, then the root) keeps alive during backward, beyond the shards.

Read off torch 2.13 `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py` and `_fsdp_collectives.py`, and
checked to the byte on fake-process-group traces, which equal real 2-rank gloo runs (tests/trace/test_trace.py):

- a block's gradients are made unsharded, in the compute dtype, until its post-backward reduce-scatter;
- the reduce-scatter input is a flat copy of them in the reduce dtype (fp32 under MixedPrecisionPolicy(
  reduce_dtype=fp32)), and FSDP2 holds it until the next reduce-scatter (`comm_ctx.reduce_scatter_state`), so the
  previous block's is alive while a block runs backward;
- with resharding after forward (ZeRO-3), the next block's all-gather is issued before the current block's backward
  (backward prefetch): its flat all-gather output lives until it is copied out;
- the root unit (embeddings, final norm, LM head) reduce-scatters last: the LM head's gradient is unsharded from the
  loss backward to the end of backward, and a tied embedding's two gradient contributions are summed (three copies
  at once) before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..setup import Engine
from .result import Category, Term
from .terms import TermKey

SOURCE = "torch FSDP2 (_fsdp_param_group.post_backward, foreach_reduce, backward prefetch); fake-process-group traces"


def fsdp2_shards(setup) -> bool:
    """Whether FSDP2 shards the parameters (engine torch, zero2 / zero3, more than one data-parallel rank)."""
    return setup.engine is Engine.TORCH and setup.sharding.stage >= 2 and setup.dp_size > 1


@dataclass(frozen=True)
class Fsdp2Units:
    """Element counts and dtypes of FSDP2's units for one model: one unit per block, the rest in the root."""

    block_params: int
    root_params: int
    head_params: int
    """The LM head's (or tied embedding's) matrix: vocab x hidden."""
    num_blocks: int
    compute_bytes: int
    reduce_bytes: int
    reshard_after_forward: bool
    tied: bool
    gathered_block_bytes: int | None = None
    """One block's all-gather output when it is not `block_params` x compute dtype: a LoRA block gathers its frozen
    base too (memfit.estimate.lora_sharded)."""
    gathered_root_bytes: int | None = None

    @property
    def last_prefetching_block(self) -> int:
        """Blocks whose gradients are sharded when the late-backward peak comes: under ZeRO-3 it is block 1's
        backward (the last one with a prefetch in flight), else block 0's."""
        return self.num_blocks - (2 if self.reshard_after_forward and self.num_blocks > 1 else 1)

    @property
    def block_bytes(self) -> int:
        """One block's unsharded gradients (compute dtype)."""
        return self.block_params * self.compute_bytes

    def gathered_bytes(self, blocks: int) -> int:
        """The unsharded root and `blocks` blocks, as FSDP2's all-gathers made them."""
        block = self.block_bytes if self.gathered_block_bytes is None else self.gathered_block_bytes
        root = self.root_params * self.compute_bytes if self.gathered_root_bytes is None else self.gathered_root_bytes
        return root + blocks * block

    def block_terms(self, *, first: bool) -> list[Term]:
        """What is unsharded while one block runs backward (memfit.estimate.fsdp1.Fsdp1Units: FSDP1's)."""
        return block_backward_terms(self, first=first)

    def root_gradient_terms(self) -> list[Term]:
        return root_gradient_terms(self)

    def root_reduce_terms(self) -> list[Term]:
        return root_reduce_terms(self)

    def block_share(self, grads_sharded: int, blocks: int) -> int:
        """Per-rank sharded gradient bytes of `blocks` blocks, out of `grads_sharded` for the whole model."""
        total = self.block_params * self.num_blocks + self.root_params
        return grads_sharded * self.block_params * blocks // max(total, 1)


def block_backward_terms(units: Fsdp2Units, *, first: bool) -> list[Term]:
    """Unsharded buffers while one block runs backward: its own gradients, the previous block's reduce-scatter
    input (none for the first block), the next block's prefetched all-gather (ZeRO-3), and the LM head's gradient,
    unsharded until the root reduces at the end. `first`: the first block to run backward (the model's last)."""
    terms = [Term(TermKey.ROOT_UNSHARDED, Category.GRADIENTS, units.head_params * units.compute_bytes,
                  "V x h x compute dtype: the LM head's gradient, unsharded until the root's reduce-scatter", SOURCE),
             Term(TermKey.GRAD_REDUCE_SCATTER, Category.TEMPORARIES, units.block_bytes,
                  "one block's unsharded gradients (compute dtype), until its post-backward reduce-scatter", SOURCE)]
    if not first:
        terms.append(Term(TermKey.REDUCE_SCATTER_HELD, Category.TEMPORARIES,
                          units.block_params * units.reduce_bytes,
                          "the previous block's reduce-scatter input (reduce dtype), held to the next one", SOURCE))
    if units.reshard_after_forward and units.num_blocks > 1:
        terms.append(Term(TermKey.PREFETCHED, Category.PARAMETERS, units.gathered_bytes(1) - units.gathered_bytes(0),
                          "the next block's all-gather output (backward prefetch)", SOURCE))
    return terms


def root_gradient_terms(units: Fsdp2Units) -> list[Term]:
    """After the last block: the embedding's gradient beside the LM head's (a tied matrix sums its two
    contributions: three copies at once), the last block's reduce-scatter input still held."""
    copies = 3 if units.tied else 2
    return [Term(TermKey.ROOT_UNSHARDED, Category.GRADIENTS, copies * units.head_params * units.compute_bytes,
                 f"{copies} x V x h x compute dtype: " + ("the tied matrix's LM-head and embedding gradients and "
                                                          "their sum" if units.tied else
                                                          "the LM head's and the embedding's gradients"), SOURCE),
            Term(TermKey.REDUCE_SCATTER_HELD, Category.TEMPORARIES, units.block_params * units.reduce_bytes,
                 "block 0's reduce-scatter input, held to the root's", SOURCE)]


def root_reduce_terms(units: Fsdp2Units) -> list[Term]:
    """The root's post-backward: its unsharded gradients and their flat reduce-scatter copy."""
    return [Term(TermKey.ROOT_UNSHARDED, Category.GRADIENTS, units.root_params * units.compute_bytes,
                 "the root's gradients (embeddings, final norm, LM head), unsharded", SOURCE),
            Term(TermKey.GRAD_REDUCE_SCATTER, Category.TEMPORARIES, units.root_params * units.reduce_bytes,
                 "the root's reduce-scatter input (reduce dtype)", SOURCE)]

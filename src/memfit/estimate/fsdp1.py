"""FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel): what each rank holds with flat parameters.

Read off torch 2.13's FSDP1 (torch/distributed/fsdp/_flat_param.py, _runtime_utils.py, _init_utils.py,
fully_sharded_data_parallel.py) and measured on real gloo ranks (bench/fsdp1.py, tests/engines/test_fsdp1.py):

- units: each wrapped module's parameters are flattened into one FlatParameter (`FlatParamHandle.flatten_tensors`),
  padded at the end to a multiple of the ranks (`_get_shard`: ceil(numel / N) elements per rank) and, with
  use_orig_params=True, each tensor's start aligned to 16 bytes (`_init_flat_param_and_metadata`,
  `_get_aligned_numel`). The frameworks' auto-wrap unit is the transformer block (accelerate TRANSFORMER_BASED_WRAP,
  Lightning `auto_wrap_policy={Block}`); the root FSDP holds the rest (embeddings, final norm, LM head);
- one dtype and one requires_grad per flat parameter, except that use_orig_params=True permits mixed requires_grad
  (`_validate_tensors_to_flatten`): the flat parameter then requires grad (`flat_param_requires_grad or ...`), the
  views FSDP hands the forward are views of it and require grad too, so backward computes the frozen weights'
  gradients, SplitWithSizesBackward concatenates them into one unsharded flat gradient, and the reduce-scattered
  shard the rank keeps (`_saved_grad_shard`, then `.grad`) covers the frozen elements: Lightning / LitGPT LoRA
  (FSDPStrategy sets use_orig_params=True, blocks as the only units) keeps a gradient shard of the whole block, at
  the flat parameter's dtype (`_cast_grad_to_param_dtype`). peft's `fsdp_auto_wrap_policy`, which the HF Trainer and
  accelerate install for a PeftModel, gives each trainable leaf (every lora_A / lora_B Linear) a unit of its own: no
  flat parameter mixes, and the base's units have no gradient at all;
- mixed precision (MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=bf16), as accelerate and Lightning pass it):
  the sharded flat parameter stays in its dtype (accelerate upcasts the trainable ones to fp32, Lightning builds in
  fp32), the all-gather makes the unsharded flat parameter in bf16 (`_use_low_precision_shard`, `_full_param_padded`),
  the gradient is reduced in bf16 and cast back to the parameter's dtype on the shard;
- resharding: the root is never resharded after forward (`_post_forward`: `not state._is_root`); FULL_SHARD frees a
  block's unsharded flat parameter after its forward and all-gathers it again for backward, prefetching the next one
  (BackwardPrefetch.BACKWARD_PRE, the default); SHARD_GRAD_OP keeps every block gathered from its forward to its
  backward;
- backward: a unit's post-backward hook (on the flat parameter's AccumulateGrad) reshards it and reduce-scatters its
  flat gradient at once (`_post_backward_hook`, `_reduce_grad`): nothing is held to the next unit, unlike FSDP2;
- CPU offload (CPUOffload(offload_params=True)): the flat shards, a copy of their gradient shards (`_cpu_grad`)
  and the optimizer on the host; the device holds what is gathered and, unlike FSDP2's CPUOffloadPolicy, each
  reduce-scattered gradient shard until backward ends (`_saved_grad_shard`, deleted by
  `FlatParamHandle.prepare_gradient_for_optim`). FSDP1's CPUOffload needs an accelerator (torch 2.13 refuses it on a
  CPU-only build), so this part is read off the code, not measured;
- limit_all_gathers bounds the CUDA caching allocator's in-flight all-gathers to two (`_limiter_utils`); a CPU step
  is synchronous and the sizing counts live tensors, so it moves no number here; sync_module_states broadcasts at
  wrap time only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..choices import FsdpVersion
from ..model_spec import ModelSpec, ParamTensor
from ..setup import Offload, Precision, TrainingSetup
from .fsdp2 import Fsdp2Units
from .result import Category, Term
from .terms import TermKey

SOURCE = ("torch FSDP1 FullyShardedDataParallel (_flat_param.py flatten / _get_shard; _runtime_utils.py "
          "_post_backward_hook, _reduce_grad); bench/fsdp1.py on gloo ranks")
ALIGN_BYTES = 16
"""use_orig_params=True aligns each original tensor's start in the flat parameter to 16 bytes (_flat_param.py)."""


def applies(setup: TrainingSetup) -> bool:
    """Whether FSDP1 shards this setup (engine torch, zero2 / zero3, more than one rank, --fsdp-version 1*)."""
    return setup.fsdp_version.is_fsdp1 and setup.sharding.stage >= 2 and setup.shard_size > 1


@dataclass(frozen=True)
class FlatUnit:
    """One kind of FSDP1 unit (`count` alike): its flat parameter's elements, what of them is trainable, its dtype at
    rest and gathered, and whether it lives in a block (gathered and resharded with it)."""

    name: str
    numel: int
    trainable: int
    count: int
    storage_bytes: int
    compute_bytes: int
    in_block: bool

    @property
    def requires_grad(self) -> bool:
        return self.trainable > 0

    def shard(self, ranks: int) -> int:
        """Elements of one rank's shard: the flat parameter padded to a multiple of the ranks (_get_shard)."""
        return -(-self.numel // ranks)

    def padded(self, ranks: int) -> int:
        return self.shard(ranks) * ranks


def _storage_bytes(setup: TrainingSetup, t: ParamTensor, trainable: bool) -> int:
    """A tensor's dtype at rest inside its flat parameter."""
    if setup.fsdp_version is FsdpVersion.V1_BLOCKS and setup.finetune.adapters:
        return 2 if setup.precision is Precision.BF16 else 4  # one dtype for base and adapters (Lightning)
    if not setup.finetune.adapters:
        return 2 if setup.precision is Precision.BF16 else 4  # MixedPrecision: the fp32 flat parameter
    if trainable:
        return 4 if mixed_precision(setup) else (t.nbytes // max(t.numel, 1) or 4)
    return t.nbytes // max(t.numel, 1) or setup.precision.param_bytes


def mixes_frozen(setup: TrainingSetup) -> bool:
    """A block's flat parameter holds its frozen base and its adapters (LoRA, blocks as the only units): every
    weight of the block is a view that requires grad, so forward saves what the frozen weights' gradients need
    (the norms' normalized inputs) and backward computes them (memfit.estimate.lora.adapted_layer)."""
    return applies(setup) and setup.fsdp_version is FsdpVersion.V1_BLOCKS and setup.finetune.adapters


def adapters_cast_input(setup: TrainingSetup) -> bool:
    """peft's policy gives each adapter Linear a unit of its own: outside that unit's forward its weight is the
    fp32 shard view (use_orig_params=True), so peft's lora.Linear casts x to fp32 (`_cast_input_dtype`) and the
    adapter's autocast linear saves its own bf16 copy of x instead of sharing the base's (measured on gloo)."""
    return (applies(setup) and setup.fsdp_version is FsdpVersion.V1 and setup.finetune.adapters
            and mixed_precision(setup))


def mixed_precision(setup: TrainingSetup) -> bool:
    """MixedPrecision(param_dtype=bf16 / fp16): amp-* and bf16-master, as accelerate and Lightning run them."""
    return setup.precision.is_autocast or setup.precision.master_weights


def _aligned(tensors: list[tuple[int, int]], orig_params: bool) -> int:
    """Elements of a flat parameter of `tensors` ((numel, bytes per element) in order): with use_orig_params each
    tensor's start is aligned to 16 bytes."""
    total = 0
    for numel, elem in tensors:
        align = ALIGN_BYTES // elem if orig_params else 1
        if total % align:
            total += align - total % align
        total += numel
    return total


def units(spec: ModelSpec, setup: TrainingSetup) -> list[FlatUnit]:
    """The flat parameters of the model as the framework wraps it (memfit._torch.fsdp1.wrap): the root, one per
    block, and under peft's policy one per adapter Linear of each block."""
    orig = setup.fsdp_version is FsdpVersion.V1_BLOCKS
    low = 2 if mixed_precision(setup) else 0
    rows = [(t, True) for t in spec.params] + [(t, False) for t in spec.frozen]
    per_layer = [(t, trainable) for t, trainable in rows if ".*." in t.name]
    root = [(t, trainable) for t, trainable in rows if ".*." not in t.name]
    own_units = setup.finetune.adapters and not orig  # peft fsdp_auto_wrap_policy: each adapter Linear alone
    out = []

    def unit(name: str, tensors: list[tuple[ParamTensor, bool]], count: int, in_block: bool) -> None:
        if not tensors:
            return
        sizes = [(t.numel, _storage_bytes(setup, t, trainable)) for t, trainable in tensors]
        storage = max(elem for _, elem in sizes)
        out.append(FlatUnit(name, _aligned(sizes, True), sum(t.numel for t, trainable in tensors if trainable), count,
                            storage, low or storage, in_block))

    unit("root", root, 1, False)
    if own_units:
        unit("block", [(t, tr) for t, tr in per_layer if not tr], spec.num_layers, True)
        for t, _ in (row for row in per_layer if row[1]):
            unit(t.name, [(t, True)], t.count, True)
    else:
        unit("block", per_layer, spec.num_layers, True)
    return out


@dataclass(frozen=True)
class Fsdp1Units(Fsdp2Units):
    """FSDP1's units in the shape the backward moments read (memfit.estimate.fsdp2.Fsdp2Units): `block_params` are
    the elements of one block that get a gradient (the whole block when its flat parameter mixes frozen and
    trainable tensors), `gathered_*` the unsharded flat parameters in the compute dtype."""

    mixed_flat: bool = False
    """A block's flat parameter mixes its frozen base and its adapters (use_orig_params=True, blocks alone)."""
    peak_block_grads: int = 0
    """Elements of a block's weight gradients made before its backward peaks: its MLP output projection's (I x h),
    the first matmul backward of a Llama block (memfit.estimate.backward_moments._down_projection_grads)."""
    padded_block: int = 0
    """Elements of a block's unsharded flat gradient (its flat parameter padded to the ranks)."""

    def block_terms(self, *, first: bool) -> list[Term]:
        """Unsharded buffers while one block runs backward: the LM head's gradient (until the root's reduce), the
        block's weight gradients, the next block's prefetched all-gather (FULL_SHARD). FSDP1 reduce-scatters a
        unit in its own post-backward hook: no earlier block's reduce-scatter input is still held."""
        terms = [Term(TermKey.ROOT_UNSHARDED, Category.GRADIENTS, self.head_params * self.compute_bytes,
                      "V x h x compute dtype: the LM head's gradient, unsharded until the root's post-backward",
                      SOURCE),
                 Term(TermKey.GRAD_REDUCE_SCATTER, Category.TEMPORARIES, self.peak_block_grads * self.compute_bytes,
                      "the block's weight gradients made before its backward peaks (its MLP output projection's, "
                      "compute dtype)" + (", the frozen one's too: its view of the flat parameter requires grad"
                                          if self.mixed_flat else ""), SOURCE)]
        if self.reshard_after_forward and self.num_blocks > 1:
            terms.append(Term(TermKey.PREFETCHED, Category.PARAMETERS, self.gathered_bytes(1) - self.gathered_bytes(0),
                              "the next block's unsharded flat parameter (BackwardPrefetch.BACKWARD_PRE)", SOURCE))
        return terms

    def flat_gradient_terms(self) -> list[Term]:
        """The end of a block's backward: all its weight gradients, held by SplitWithSizesBackward's input buffer,
        and the unsharded flat gradient it concatenates them into (padded), before AccumulateGrad's post-backward
        hook reduce-scatters it and frees both; the LM head's gradient; the next block prefetched."""
        terms = self.block_terms(first=False)[:1]
        terms += [Term(TermKey.GRAD_REDUCE_SCATTER, Category.TEMPORARIES, self.block_bytes,
                       "one block's weight gradients (compute dtype)" + (
                           ", its frozen base's too: their views of the flat parameter require grad"
                           if self.mixed_flat else ""), SOURCE),
                  Term(TermKey.GRAD_REDUCE_SCATTER, Category.TEMPORARIES, self.padded_block * self.compute_bytes,
                       "their concatenation, the block's unsharded flat gradient (SplitWithSizesBackward), the "
                       "reduce-scatter input", SOURCE)]
        if self.reshard_after_forward and self.num_blocks > 1:
            terms += self.block_terms(first=False)[2:]
        return terms

    def root_gradient_terms(self) -> list[Term]:
        copies = 3 if self.tied else 2
        return [Term(TermKey.ROOT_UNSHARDED, Category.GRADIENTS, copies * self.head_params * self.compute_bytes,
                     f"{copies} x V x h x compute dtype: the LM head's and the embedding's gradients"
                     + (" and their sum" if self.tied else ""), SOURCE)]

    def root_reduce_terms(self) -> list[Term]:
        return [Term(TermKey.ROOT_UNSHARDED, Category.GRADIENTS, self.root_params * self.compute_bytes,
                     "the root's weight gradients (embeddings, final norm, LM head)", SOURCE),
                Term(TermKey.GRAD_REDUCE_SCATTER, Category.TEMPORARIES, self.root_params * self.compute_bytes,
                     "their concatenation into the root's unsharded flat gradient (SplitWithSizesBackward)", SOURCE)]


def layout(spec: ModelSpec, setup: TrainingSetup, full, static):
    """`static` (memfit.estimate.static's per-rank layout) as FSDP1 holds it: flat shards, flat gradient shards,
    the optimizer's states over the flat parameters (use_orig_params=False) or the original ones (True), the root
    and one block (FULL_SHARD) or every block (SHARD_GRAD_OP) gathered."""
    n = setup.shard_size
    flat = units(spec, setup)
    trained = [u for u in flat if u.requires_grad]
    params = sum(u.count * u.shard(n) * u.storage_bytes for u in trained)
    frozen = sum(u.count * u.shard(n) * u.storage_bytes for u in flat if not u.requires_grad)
    grads = params
    if setup.optimizer.torch_adam:
        # use_orig_params=True: the optimizer steps the original parameters' views into the shard (their elements
        # in this rank's shard), in the flat parameter's dtype, and one `step` per trainable parameter
        elem = max(u.storage_bytes for u in trained) if trained else 4
        optimizer = 2 * elem * spec.num_params // n + 4 * sum(p.count for p in spec.params)
    else:
        optimizer = full.states_bytes // n
    block = [u for u in flat if u.in_block]
    per_block_grads = sum(u.numel * u.count for u in block if u.requires_grad) // max(spec.num_layers, 1)
    root = next((u for u in flat if u.name == "root"), None)
    # the block's own flat parameter gets gradients (full fine-tune, or a mixed block); peft's adapter units reduce
    # each adapter's gradient as soon as it is made
    block_grads = any(u.requires_grad for u in block if u.name == "block")
    head_trained = any(p.name.endswith("lm_head.weight") for p in spec.params)
    fsdp = Fsdp1Units(block_params=per_block_grads,
                      root_params=root.numel if root is not None and root.requires_grad else 0,
                      head_params=spec.vocab_size * spec.hidden_size if head_trained else 0,
                      num_blocks=spec.num_layers, compute_bytes=max(u.compute_bytes for u in flat),
                      reduce_bytes=max(u.compute_bytes for u in flat),
                      reshard_after_forward=setup.sharding.stage >= 3, tied=spec.tie_word_embeddings,
                      gathered_block_bytes=sum(u.padded(n) * u.count * u.compute_bytes for u in block)
                      // max(spec.num_layers, 1),
                      gathered_root_bytes=root.padded(n) * root.compute_bytes if root is not None else 0,
                      mixed_flat=any(0 < u.trainable < u.numel for u in block),
                      peak_block_grads=spec.intermediate_size * spec.hidden_size if block_grads else 0,
                      padded_block=sum(u.padded(n) * u.count for u in block if u.requires_grad)
                      // max(spec.num_layers, 1))
    working = fsdp.gathered_bytes(1 if setup.sharding.stage >= 3 else spec.num_layers)
    notes = (f"FSDP1: {len(flat)} kinds of flat parameter, each padded to a multiple of {n} ranks"
             + ("; a block's flat parameter holds its frozen base and its adapters (use_orig_params=True): its "
                "gradient shard covers the frozen elements too" if fsdp.mixed_flat else ""),)
    out = replace(static, params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer, frozen_bytes=frozen,
                  param_working_set_bytes=working, fsdp=fsdp, master_grad_upcast=False, comm_buffers_bytes=0,
                  notes=static.notes + notes)
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        # CPUOffload(offload_params=True): flat shards, a host copy of their gradient shards (`_cpu_grad`) and the
        # optimizer on the host. The reduce-scattered shard itself stays on the device as `_saved_grad_shard`
        # until the end of backward (`_offload_grad` copies it; `prepare_gradient_for_optim` deletes it)
        out = replace(out, params_bytes=0, optimizer_bytes=0, frozen_bytes=0,
                      cpu_bytes=params + frozen + grads + optimizer)
    return out


__all__ = ["Fsdp1Units", "FlatUnit", "applies", "layout", "units"]

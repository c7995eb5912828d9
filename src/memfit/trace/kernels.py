"""Which device's kernels a trace stands for.

A trace runs on CPU fake tensors, so by default it would take the CPU's kernel choices. Two of them keep different
tensors from the CUDA kernels a GPU run takes (FACTS.md, checked against ATen):

- dropout: on CPU `at::dropout` multiplies by a mask it keeps for backward in the input's dtype; on CUDA it runs the
  fused `native_dropout`, whose saved mask is bool (ATen Dropout.cpp `is_fused_kernel_acceptable`: CUDA inputs with
  0 < p < 1);
- scaled_dot_product_attention with dropout: the CPU flash kernel has no dropout, so SDPA falls back to the math
  path and keeps B x H x T x T probabilities, mask and dropped probabilities; CUDA runs FlashAttention (fp16/bf16, no
  explicit mask) or the memory-efficient kernel, which keep the output, the log-sum-exp and an RNG seed only
  (ATen sdp_utils.cpp selection order: flash, then memory-efficient, then math).

- autocast's op policy: CUDA autocast runs softmax and layer_norm in fp32 (torch.amp's CUDA fp32 list); CPU
  autocast runs them in bf16 (BERT's eager softmax, its MLM head's LayerNorm).

`device_kernels("cuda")` swaps those calls for the ops a CUDA device runs; on fake tensors their meta functions
give the exact output and saved-tensor shapes. Kernel workspaces are not tensors and stay uncounted either way.

Some kernels allocate scratch below the dispatcher, which a dispatch mode never sees; `hidden_scratch(kernels)`
sizes it per op:

- bitsandbytes' optimizer ops run Python kernels on the CPU that allocate fp32 scratch (memfit.estimate.bnb_cpu);
- an elementwise op on operands of different dtypes (a bf16 expert output times fp32 routing weights): on the CPU,
  TensorIterator copies each input of another dtype than the common one into a temporary of that dtype, and an
  in-place op on a lower-precision tensor also computes into a temporary output (ATen TensorIterator.cpp
  `compute_types`, "Promotes inputs by creating temporaries of the correct dtype", for a CPU common device only);
  CUDA kernels cast as they load. `torch.where` casts its inputs with `.to` on every device (ATen TensorCompare.cpp
  `where_self_out`). These temporaries live while the op's output is made.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..estimate.bnb_cpu import adam_step_scratch_bytes

Kernels = Literal["cuda", "cpu"]
KERNELS: tuple[str, ...] = ("cuda", "cpu")

CUDA_NOTE = ("CUDA kernel choices emulated on the CPU trace: dropout keeps a bool mask (fused native_dropout), "
             "SDPA with dropout runs the flash / memory-efficient kernel (no T x T), autocast runs softmax and "
             "layer_norm in fp32; kernel workspaces not counted")
CPU_NOTE = ("CPU kernel choices: dropout keeps its mask in the input dtype and SDPA with dropout takes the math path "
            "(T x T); a CUDA device keeps less (trace with kernels='cuda')")


def hidden_scratch(kernels: Kernels):
    """`(op, args) -> bytes` of the tensors `kernels`' implementation of an op allocates inside it and frees when
    it returns, out of a TorchDispatchMode's sight (alive together with the op's outputs)."""
    return _cpu_scratch if kernels == "cpu" else _cuda_scratch


def _cuda_scratch(func, args) -> int:
    return _where_casts(args) if getattr(func, "overloadpacket", None) is torch.ops.aten.where else 0


_BNB_ADAM = {"bitsandbytes::optimizer_update_8bit_blockwise": True, "bitsandbytes::optimizer_update_32bit": False}


def _cpu_scratch(func, args) -> int:
    packet = getattr(func, "overloadpacket", None)
    if packet in _PROMOTING:
        return _promotion_casts(args, in_place=packet in _IN_PLACE)
    if packet is torch.ops.aten.where:
        return _where_casts(args)
    return _bnb_scratch(func, args) if getattr(func, "namespace", "") == "bitsandbytes" else 0


_aten = torch.ops.aten
_IN_PLACE = frozenset((_aten.add_, _aten.sub_, _aten.mul_, _aten.div_, _aten.addcmul_, _aten.addcdiv_, _aten.lerp_))
_PROMOTING = _IN_PLACE | frozenset((
    _aten.add, _aten.sub, _aten.rsub, _aten.mul, _aten.div, _aten.maximum, _aten.minimum, _aten.addcmul,
    _aten.addcdiv, _aten.lerp, _aten.eq, _aten.ne, _aten.lt, _aten.le, _aten.gt, _aten.ge))
"""TensorIterator ops built with promote_inputs_to_common_dtype (ATen BinaryOps.cpp / PointwiseOps.cpp /
TensorIterator.cpp `build_borrowing_binary_op`, `build_borrowing_comparison_op`, `build_ternary_op`)."""


def _promotion_casts(args, *, in_place: bool) -> int:
    """Bytes of the CPU's cast copies: each tensor input of another dtype than the common one, at the common dtype;
    for an in-place op on a tensor of another dtype, also its temporary output."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) < 2 or len({t.dtype for t in tensors}) < 2:
        return 0
    common = _common_dtype(args)
    size = common.itemsize
    casts = sum(t.numel() * size for t in tensors if t.dtype != common)
    if in_place and tensors[0].dtype != common:
        casts += tensors[0].numel() * size
    return casts


def _where_casts(args) -> int:
    """`torch.where(condition, self, other)`: self / other of another dtype than their common one are cast."""
    values = args[1:3]
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    if len(tensors) < 2 or tensors[0].dtype == tensors[1].dtype:
        return 0
    common = _common_dtype(values)
    return sum(t.numel() * common.itemsize for t in tensors if t.dtype != common)


def _common_dtype(args) -> torch.dtype:
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    operands = [a for a in args if isinstance(a, (torch.Tensor, bool, int, float, complex))]
    return elementwise_dtypes(*operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH)[1]


def _bnb_scratch(func, args) -> int:
    """bitsandbytes' CPU Adam step (backends/cpu/ops.py `_optimizer_update_8bit_blockwise_cpu` /
    `_optimizer_update_32bit_cpu`): args are (optimizer_name, g, p, ...)."""
    eight_bit = _BNB_ADAM.get(func.name())
    if eight_bit is None or len(args) < 3 or args[0] not in ("adam", "lamb"):
        return 0

    param = args[2]
    return adam_step_scratch_bytes(param.numel(), param.element_size(), eight_bit)


@contextlib.contextmanager
def cpu_rng_states(see) -> Iterator[None]:
    """On a CPU device, count the generator states activation checkpointing stashes: torch.utils.checkpoint
    (preserve_rng_state=True) keeps `torch.get_rng_state()` per checkpointed call until its recompute, and
    torch.random.fork_rng takes another one around the recompute: a 5,056-byte CPU tensor each (the Mersenne Twister
    state), made by the generator, not by an op, so a dispatch mode never sees it. `see(tensor)` hands it to the
    tracker. A CUDA device keeps these in host memory (its own RNG state is a CPU tensor too), so only the CPU."""
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        see(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def kernel_note(kernels: Kernels) -> str:
    return CUDA_NOTE if kernels == "cuda" else CPU_NOTE


@contextlib.contextmanager
def device_kernels(kernels: Kernels) -> Iterator[None]:
    """Run the step with `kernels`' memory behaviour: CUDA's by swapping `F.dropout` and
    `F.scaled_dot_product_attention` for the calls a CUDA device makes, the CPU's as they are.

    The functions are swapped on the module (modelling code looks them up at call time), not through a
    TorchFunctionMode: the recomputation of a checkpointed block runs inside backward, where a function mode entered
    around the step is not active, and would then save other tensors than the first forward (CheckpointError)."""
    if kernels not in KERNELS:
        raise ConfigError(f"unknown kernels '{kernels}': choose one of {', '.join(KERNELS)}")
    if kernels == "cpu":
        yield
        return
    originals = {"dropout": F.dropout, "scaled_dot_product_attention": F.scaled_dot_product_attention,
                 "softmax": F.softmax, "layer_norm": F.layer_norm}
    F.dropout = functools.partial(_dropout, originals["dropout"])
    F.scaled_dot_product_attention = functools.partial(_sdpa_or, originals["scaled_dot_product_attention"])
    F.softmax = functools.partial(_fp32_under_autocast, originals["softmax"])
    F.layer_norm = functools.partial(_fp32_under_autocast, originals["layer_norm"])
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(F, name, function)


def _fp32_under_autocast(original, input, *args, **kwargs):
    """CUDA autocast's fp32 policy: a half-precision input is cast to fp32 (and so are the tensor arguments, as
    autocast does), and the op runs outside the lower-precision region."""
    if not torch.is_autocast_enabled("cpu") or input.dtype not in (torch.float16, torch.bfloat16):
        return original(input, *args, **kwargs)
    cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    with torch.autocast("cpu", enabled=False):
        return original(input.float(), *cast, **kw)


def _sdpa_or(original, *args, **kwargs):
    out = _sdpa(*args, **kwargs)
    return original(*args, **kwargs) if out is None else out


def _dropout(original, input, p: float = 0.5, training: bool = True, inplace: bool = False):
    if not training or not 0 < p < 1 or input.numel() == 0:
        return original(input, p, training, inplace)
    out, _mask = torch.ops.aten.native_dropout(input, p, True)
    if inplace:
        return input.copy_(out)
    return out


def _sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
          enable_gqa: bool = False):
    """The CUDA kernel's call for SDPA with dropout, or None where CPU and CUDA keep the same tensors."""
    if dropout_p <= 0 or query.dim() != 4:
        return None
    if key.size(-3) != query.size(-3):
        if not enable_gqa:
            return None
        # flash takes grouped K/V as they are; the memory-efficient kernel needs them repeated per query head
        if attn_mask is not None or query.dtype not in (torch.float16, torch.bfloat16):
            groups = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.size(-1) <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype is torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]

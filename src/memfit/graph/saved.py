"""The `saved` operation: what the module a node stands for keeps for backward, as rows of per-token elements.

Each node kind registers `@handler("saved", Kind)` next to its parameter handlers; the handler reads only the
node's typed fields and the step's context (`SavedCtx`: dtypes, attention kind, checkpointing, sequence length,
the dropouts of the enclosing block). A Block composes its nodes' rows. A kind without a handler, or a node whose
fields describe something no handler models yet (q/k norms, latent attention...), raises: the estimator then sizes
that model with memfit.derive, never with another family's formula.

The rows were read off the transformers 5.x modelling code and checked tensor by tensor with
`torch.autograd.graph.saved_tensors_hooks` on tiny real models (tests/estimate/test_estimate_accuracy.py measures whole steps
against the profiler).

Dtype classes: 'f32' always fp32; 'res' the residual stream (fp32 under fp32 and autocast, bf16 when pure bf16);
'cmp' a matmul output (fp32, or bf16/fp16 under autocast and pure bf16); 'lin' the input a Linear saves: under
autocast every Linear casts its fp32 input to its own bf16 copy (autocast caches casts of weights only), otherwise
all Linears reading one tensor share it, so 'lin' rows carry how many Linears read the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..setup import Attention as AttentionImpl
from ..setup import Checkpointing, Precision, TrainingSetup
from .registry import UnknownNodeKindError, dispatch


class NotModelledError(UnknownNodeKindError):
    """A node of a known kind whose fields describe a module no `saved` handler models yet."""


@dataclass(frozen=True)
class Saved:
    """Per-token elements of one saved tensor (or `readers` Linears' inputs) in one layer."""

    group: str  # attention / mlp / norms
    elems: float
    dtype: str  # f32 / res / cmp / lin
    readers: int = 1
    role: str = ""
    """Saved only for a weight's gradient, and so not when that weight is frozen: 'norm' (a norm's normalised
    value, which its weight multiplies), or the projection whose input it is ('qkv', 'out', 'up', 'down', 'head')."""


@dataclass(frozen=True)
class Dtypes:
    residual: int
    compute: int
    autocast: bool
    on_cpu: bool = False
    """CPU kernels differ: dropout keeps a mask in the input's dtype (CUDA: bool), and SDPA with dropout falls
    back to the math path that materialises T x T (CUDA's flash / memory-efficient kernels do not)."""
    mlp_in_residual: bool = False
    """The MLP's matmul outputs come back in the residual dtype: a bitsandbytes-quantized frozen Linear returns
    its input's dtype (Linear4bit.forward `.to(inp_dtype)`), fp32 once prepare_model_for_kbit_training made the
    norms fp32, even under autocast."""
    float8_hp_input: bool = False
    """torchao Float8Linears under CPU autocast: `Float8Linear.forward` asks `torch.is_autocast_enabled()` (CUDA's
    flag), so it does not cast its input and saves the shared fp32 tensor, not a bf16 copy per Linear
    (memfit.estimate.float8; on CUDA the input is cast as F.linear's is)."""

    @classmethod
    def of(cls, precision: Precision, on_cpu: bool = False) -> "Dtypes":
        if precision.is_autocast:
            return cls(residual=4, compute=2, autocast=True, on_cpu=on_cpu)
        if precision.param_dtype == "bf16":
            return cls(residual=2, compute=2, autocast=False, on_cpu=on_cpu)
        return cls(residual=4, compute=4, autocast=False, on_cpu=on_cpu)

    @property
    def mask(self) -> str:
        """Dtype class of a dropout mask."""
        return "cmp" if self.on_cpu else "u8"

    def bytes_of(self, item: Saved) -> float:
        if item.dtype == "f32":
            return 4 * item.elems
        if item.dtype == "res" or (item.dtype == "cmp" and self.mlp_in_residual and item.group == "mlp"):
            return self.residual * item.elems
        if item.dtype in ("cmp", "c16"):  # c16: the compute dtype whatever the group (an autocast cast)
            return self.compute * item.elems
        if item.dtype == "u8":
            return item.elems
        if item.dtype == "i64":  # index tensors (top-k indices, MoE token permutations)
            return 8 * item.elems
        # 'lin': one shared copy in the residual dtype, or one bf16 copy per reading Linear under autocast
        cast = self.autocast and not self.float8_hp_input
        copies = item.readers if cast else 1
        size = self.compute if cast else self.residual
        return copies * size * item.elems


@dataclass(frozen=True)
class SavedCtx:
    """What a `saved` handler may read besides its node. `dropout`: the enclosing block's dropout probabilities
    by place ('attention', 'residual'), set by the Block handler; `frozen`: the model is a LoRA base (its weights
    need no gradient)."""

    setup: TrainingSetup
    seq_len: int
    d: Dtypes
    frozen: bool = False
    dropout: tuple[tuple[str, float], ...] = ()
    input_saved: bool = True
    """False for a norm whose input another norm of the block already keeps."""

    def dropout_p(self, where: str) -> float:
        return sum(p for place, p in self.dropout if place == where)

    @property
    def attention_dropout(self) -> bool:
        return self.dropout_p("attention") > 0

    @property
    def sdpa_kernel(self) -> bool:
        """SDPA runs a fused kernel that keeps no T x T (CPU SDPA with dropout takes the math path instead)."""
        return self.setup.attention is AttentionImpl.SDPA and not (self.attention_dropout and self.d.on_cpu)

    @property
    def core_recomputed(self) -> bool:
        return core_recomputed(self.setup)

    def with_dropout(self, dropout: tuple[tuple[str, float], ...]) -> "SavedCtx":
        return replace(self, dropout=dropout)


def core_recomputed(setup: TrainingSetup) -> bool:
    """Megatron's selective recompute on an eager attention: the core (QK^T, softmax, dropout, x V) runs under
    checkpoint, so its T x T tensors are rebuilt in backward. SDPA's kernels keep no T x T: there it changes
    nothing and memfit leaves the attention as it is."""
    return setup.checkpointing is Checkpointing.ATTENTION and setup.attention is AttentionImpl.EAGER


def saved_by(node: Any, ctx: SavedCtx) -> list[Saved]:
    """The rows `node` keeps for backward (UnknownNodeKindError when its kind has no 'saved' handler)."""
    return list(dispatch("saved", node, ctx))


def shard_degree(proj: Any) -> int:
    """How many tensor-parallel ranks split a projection (1 unsharded); a LoRA projection's base says."""
    shard = getattr(getattr(proj, "base", proj), "shard", None)
    return shard.degree if shard is not None else 1

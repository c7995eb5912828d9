"""Attention: the numbers the estimator needs (heads, head size, rotary share, soft-capping, window, direction)
and the projections that hold its parameters, in typed fields so transforms know their role:
`qkv` (column-parallel), `out` (row-parallel), `down` (MLA's low-rank down projections, replicated), `norms`
(q/k norms, latent norms)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...setup import Attention as AttentionImpl
from ..registry import Node, children_params, children_tensors, field_children, handler
from ..saved import NotModelledError, Saved, SavedCtx, shard_degree
from .linear import Linear, LoraLinear
from .norm import Norm

ATTENTION_KINDS = ("causal", "bidirectional", "cross")
POSITIONS = ("rope", "learned", "relative", "alibi", "none")


@dataclass(frozen=True)
class LatentKV:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a `kv_lora_rank` latent plus a
    shared `rope_head_dim` rotary key; queries from a `q_lora_rank` latent (0: a plain q projection)."""

    kv_lora_rank: int
    q_lora_rank: int
    rope_head_dim: int
    nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Attention(Node):
    q_heads: int
    kv_heads: int
    head_dim: int
    """Query/key head size (MLA: nope + rope)."""
    hidden: int
    qkv: tuple[Linear | LoraLinear, ...]
    out: Linear | LoraLinear
    rotary_fraction: float = 1.0
    softcap: float | None = None
    window: int | None = None
    kind: str = "causal"
    latent_kv: LatentKV | None = None
    position: str = "rope"
    down: tuple[Linear | LoraLinear, ...] = ()
    norms: tuple[Norm, ...] = ()
    name: str = field(default="self_attn", kw_only=True)
    softmax_fp32: bool = field(default=True, kw_only=True)
    """Eager attention takes the softmax in fp32 (transformers' eager_attention_forward: `softmax(..., dtype=
    torch.float32)`); False: in the scores' dtype (GPT-2's and BERT's own attention code)."""
    contiguous_out: bool = field(default=False, kw_only=True)
    """The attention output is made contiguous before the output projection, one more q-sized copy that the
    projection saves (Phi-3, GPT-NeoX; read off saved_tensors_hooks on a tiny GPTNeoXForCausalLM, transformers
    5.24)."""

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind must be one of {', '.join(ATTENTION_KINDS)}, got {self.kind!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"attention position must be one of {', '.join(POSITIONS)}, got {self.position!r}")

    @property
    def fused_qkv(self) -> bool:
        return len(self.qkv) == 1 and self.latent_kv is None

    @property
    def qkv_bias(self) -> bool:
        return any(_bias(p) for p in self.qkv)

    @property
    def out_bias(self) -> bool:
        return _bias(self.out)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _bias(proj: Linear | LoraLinear) -> bool:
    return proj.base.bias if isinstance(proj, LoraLinear) else proj.bias


_FIELDS = ("down", "qkv", "norms", "out")


@handler("children", Attention)
def _attention_children(node: Attention, path: str):
    return field_children(node, path, _FIELDS)


handler("params", Attention)(children_params)
handler("tensors", Attention)(children_tensors)


# ---- what it keeps for backward ---------------------------------------------------------------------------------

def _widths(node: Attention) -> tuple[int, int, int]:
    """(query heads, query/output width, key/value width) on one tensor-parallel rank."""
    degree = shard_degree(node.qkv[0])
    heads = node.q_heads // degree
    return heads, heads * node.head_dim, node.kv_heads // degree * node.head_dim


def _check_modelled(node: Attention) -> None:
    if node.norms or node.latent_kv is not None or node.kind == "cross":
        what = "q/k norms" if node.norms else "latent attention" if node.latent_kv is not None else "cross-attention"
        raise NotModelledError(f"attention with {what}: no 'saved' formula yet")


@handler("saved", Attention)
def _attention_saved(node: Attention, ctx: SavedCtx) -> list[Saved]:
    """The q/k/v projections' shared input (one reader when fused) and the core's tensors."""
    _check_modelled(node)
    return [Saved("attention", node.hidden, "lin", 1 if node.fused_qkv else 3, role="qkv")] + core_saved(node, ctx)


def core_saved(node: Attention, ctx: SavedCtx) -> list[Saved]:
    """q, k, v, output and softmax statistics (SDPA) or the T x T probabilities (eager)."""
    heads, q, kv = _widths(node)
    if ctx.core_recomputed:
        return _checkpointed_core(node, q, kv)
    if ctx.sdpa_kernel:
        # Flash / memory-efficient SDPA saves q, k, v (k, v at kv-head width: GQA is passed through), the output
        # and the fp32 log-sum-exp per head and token; never the T x T matrix.
        if not node.fused_qkv:
            return [Saved("attention", q + 2 * kv, "cmp"), Saved("attention", q, "cmp"),
                    Saved("attention", heads, "f32")]
        # q/k/v are views of one fused projection output; v (and, without rotary, q/k) keep it all alive.
        rotated = q + kv if node.rotary_fraction > 0 else 0  # rotary writes new q, k tensors
        rows = [Saved("attention", q + 2 * kv, "cmp"), Saved("attention", rotated, "cmp"),
                Saved("attention", q, "cmp"), Saved("attention", heads, "f32")]
        if node.contiguous_out:
            rows.append(Saved("attention", q, "cmp", role="out"))  # saved by the output projection only
        return rows
    # Eager (or CPU SDPA with dropout, which takes the math path): q and k (repeated to all heads) for QK^T, the
    # softmax output, v repeated, and the transposed output copy fed to o_proj. The probabilities that meet v are
    # the softmax cast back to the compute dtype, or with dropout its mask and the dropped probabilities.
    t = ctx.seq_len
    if ctx.setup.attention is AttentionImpl.SDPA:
        # CPU math fallback: computes in fp32 whatever the input dtype (q, k, v, output; softmax, mask, dropped)
        return [Saved("attention", 3 * q, "f32"), Saved("attention", q, "f32", role="out"),
                Saved("attention", 3 * heads * t, "f32")]
    softmax = eager_softmax_dtype(node, ctx)
    # (the output copy is the output projection's input, saved for its weight gradient only)
    rows = [Saved("attention", 3 * q, "cmp"), Saved("attention", q, "cmp", role="out"),
            Saved("attention", heads * t, softmax)]
    if node.softcap:
        rows.append(Saved("attention", heads * t, "cmp"))  # Gemma 2: tanh(scores / cap) keeps its output
    if ctx.attention_dropout:
        rows += [Saved("attention", heads * t, ctx.d.mask), Saved("attention", heads * t, "cmp")]
    elif ctx.d.compute == 2 and softmax == "f32":
        rows.append(Saved("attention", heads * t, "cmp"))
    return rows


def _checkpointed_core(node: Attention, q: int, kv: int) -> list[Saved]:
    """What a layer keeps of a checkpointed eager core: its inputs q, k, v (the checkpoint holds them; k and v at
    kv-head width, repeat_kv is inside the core) and its output, which the output projection saves. A fused
    projection's q/k/v are views that keep the whole q + 2 kv output alive; rotary on a fused output (Phi-3,
    GPT-NeoX) writes new q, k beside it. Korthikanti et al. 2022 sec. 4.2: the 5·a·s/h term (softmax, dropout mask,
    dropout output) is what goes; the 2 x 2sbh of Q, K and the V input stay."""
    rotary = node.rotary_fraction > 0
    if node.fused_qkv:
        rows = [Saved("attention", q + 2 * kv, "cmp")]
        if rotary:
            rows.append(Saved("attention", q + kv, "res"))
    elif rotary:
        # rotary multiplies by the fp32 cos/sin tables: under autocast q and k come out fp32 (the residual dtype)
        rows = [Saved("attention", q + kv, "res"), Saved("attention", kv, "cmp")]
    else:
        rows = [Saved("attention", q + 2 * kv, "cmp")]
    return rows + [Saved("attention", q, "cmp", role="out")]


def eager_softmax_dtype(node: Attention, ctx: SavedCtx) -> str:
    """The dtype class of the eager softmax: fp32 where the code asks for it (`softmax_fp32`); otherwise the
    scores' dtype, which under autocast is fp32 anyway on CUDA (autocast's CUDA fp32 list has softmax) and on CPU
    for causal models (the fp32 additive mask promotes them); CPU autocast leaves a bidirectional (BERT) one in
    bf16."""
    if node.softmax_fp32:
        return "f32"
    if ctx.setup.precision.is_autocast and (not ctx.d.on_cpu or node.kind == "causal"):
        return "f32"
    return "cmp"


@handler("matmuls", Attention)
def _attention_matmuls(node: Attention) -> list[tuple[str, int]]:
    """(group, output width) of its matmuls in forward order: q, k, v (or the fused qkv), then the output."""
    _, q, kv = _widths(node)
    qkv = [("attention", q + 2 * kv)] if node.fused_qkv else [("attention", q), ("attention", kv), ("attention", kv)]
    return qkv + [("attention", node.hidden)]

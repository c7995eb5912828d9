"""Attention: the numbers the estimator needs (heads, head size, rotary share, soft-capping, window, direction)
and the projections that hold its parameters, in typed fields so transforms know their role:
`qkv` (column-parallel), `out` (row-parallel), `down` (MLA's low-rank down projections, replicated), `norms`
(q/k norms, latent norms)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..registry import Node, children_params, children_tensors, field_children, handler
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

"""Norm (RMSNorm / LayerNorm) and Dropout (no parameters; the estimator needs where a mask is kept)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..registry import GraphTensor, Node, handler, join
from ..saved import Saved, SavedCtx

NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class Norm(Node):
    """`kind` 'rms' or 'layer' over `dim` features: a weight (unless `affine` is False) and, with `bias`, a bias.
    `copies` > 1 is one norm per head kept as separate modules (StableLM's per-head q/k LayerNorms:
    <path>.norms.*.weight). `fp32_output`: the normalised value stays fp32 until the weight multiplies it
    (Gemma's RMSNorm: `_norm(x.float()) * (1 + weight.float())`, cast back only after)."""

    kind: str
    dim: int
    bias: bool = False
    name: str = field(default="", kw_only=True)
    affine: bool = field(default=True, kw_only=True)
    copies: int = field(default=1, kw_only=True)
    trainable: bool = field(default=True, kw_only=True)
    fp32_output: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ValueError(f"norm kind must be one of {', '.join(NORM_KINDS)}, got {self.kind!r}")


@handler("params", Norm)
def _norm_params(node: Norm) -> int:
    if not node.affine:
        return 0
    return node.copies * node.dim * (2 if node.bias else 1)


@handler("tensors", Norm)
def _norm_tensors(node: Norm, path: str) -> Iterator[GraphTensor]:
    if not node.affine:
        return
    base = join(path, "norms.*") if node.copies > 1 else path
    for suffix in ("weight", "bias") if node.bias else ("weight",):
        yield GraphTensor(join(base, suffix), node.dim, node.copies, node.trainable)


@handler("saved", Norm)
def _norm_saved(node: Norm, ctx: SavedCtx) -> list[Saved]:
    """LlamaRMSNorm (modeling_llama): x.to(fp32) (saved by pow and mul), rsqrt (B*T*1), the normalised x cast
    back (saved by the weight's mul; fp32 with `fp32_output`). aten.native_layer_norm saves its input and fp32
    mean and rstd (B*T*1 each); `ctx.input_saved` False: another norm already keeps that same input (a parallel
    residual's second LayerNorm)."""
    h = node.dim
    if node.kind == "rms":
        return [Saved("norms", h, "f32"), Saved("norms", 1, "f32"),
                Saved("norms", h, "f32" if node.fp32_output else "res", role="norm")]
    rows = [Saved("norms", 1, "f32"), Saved("norms", 1, "f32")]
    return rows + [Saved("norms", h, "res")] if ctx.input_saved else rows


@handler("matmuls", Norm)
def _norm_matmuls(node: Norm) -> list[tuple[str, int]]:
    return []


DROPOUT_PLACES = ("embedding", "attention", "residual", "mlp", "head")


@dataclass(frozen=True)
class Dropout(Node):
    """Dropout with probability `p` at `where`: 'embedding', 'attention' (the probabilities), 'residual' (a
    sub-layer's output), 'mlp' (after the activation) or 'head'."""

    p: float
    where: str
    name: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        if self.where not in DROPOUT_PLACES:
            raise ValueError(f"dropout place must be one of {', '.join(DROPOUT_PLACES)}, got {self.where!r}")


@handler("params", Dropout)
def _dropout_params(node: Dropout) -> int:
    return 0


@handler("tensors", Dropout)
def _dropout_tensors(node: Dropout, path: str) -> Iterator[GraphTensor]:
    return iter(())


@handler("saved", Dropout)
def _dropout_saved(node: Dropout, ctx: SavedCtx) -> list[Saved]:
    """Nothing of its own: the module that applies it keeps the mask (the attention its probabilities', the
    Block its residual masks, the embedding's the model), as SavedCtx.dropout tells them."""
    return []


@handler("matmuls", Dropout)
def _dropout_matmuls(node: Dropout) -> list[tuple[str, int]]:
    return []

"""Input-side kinds: Embedding (a lookup table: tokens, positions, token types, relative-position buckets),
PatchEmbedding (ViT's Conv2d over image patches) and Param (one raw parameter tensor: a CLS token, a learned
position table stored as nn.Parameter)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..registry import GraphTensor, Node, handler, join
from ..saved import Saved, SavedCtx
from .linear import Shard


@dataclass(frozen=True)
class Embedding(Node):
    """`num_embeddings` x `dim` table. `shard` (style 'vocab') is set by with_tensor_parallel: each rank holds
    ceil(num_embeddings / degree) rows (Megatron pads the vocabulary to a multiple of the degree). `lookup`: what
    indexes it, 'tokens' (one id per token: words, token types) or 'positions' (one id per position, shared by the
    batch: a learned position table)."""

    num_embeddings: int
    dim: int
    trainable: bool = True
    storage: str | None = None
    name: str = field(default="", kw_only=True)
    shard: Shard | None = field(default=None, kw_only=True)
    lookup: str = field(default="tokens", kw_only=True)

    def __post_init__(self) -> None:
        if self.lookup not in ("tokens", "positions"):
            raise ValueError(f"embedding lookup must be 'tokens' or 'positions', got {self.lookup!r}")


def embedding_local(num_embeddings: int, dim: int, shard: Shard | None) -> int:
    rows = -(-num_embeddings // shard.degree) if shard is not None else num_embeddings
    return rows * dim


@handler("params", Embedding)
def _embedding_params(node: Embedding) -> int:
    return node.num_embeddings * node.dim


@handler("tensors", Embedding)
def _embedding_tensors(node: Embedding, path: str) -> Iterator[GraphTensor]:
    yield GraphTensor(join(path, "weight"), node.num_embeddings * node.dim, 1, node.trainable,
                      embedding_local(node.num_embeddings, node.dim, node.shard))


@handler("saved", Embedding)
def _embedding_saved(node: Embedding, ctx: SavedCtx) -> list[Saved]:
    """The int64 indices embedding_backward needs for the table's gradient, per token (a position table's are
    one per position: memfit.estimate.activations counts those per sequence); none for a frozen table."""
    return [] if ctx.frozen or node.lookup != "tokens" else [Saved("embedding", 1, "i64")]


@dataclass(frozen=True)
class PatchEmbedding(Node):
    """Conv2d(channels, dim, kernel=stride=patch): one `dim`-vector per image patch."""

    channels: int
    patch: tuple[int, int]
    dim: int
    bias: bool = True
    trainable: bool = True
    name: str = field(default="", kw_only=True)


@handler("params", PatchEmbedding)
def _patch_params(node: PatchEmbedding) -> int:
    return node.dim * node.channels * node.patch[0] * node.patch[1] + (node.dim if node.bias else 0)


@handler("tensors", PatchEmbedding)
def _patch_tensors(node: PatchEmbedding, path: str) -> Iterator[GraphTensor]:
    yield GraphTensor(join(path, "weight"), node.dim * node.channels * node.patch[0] * node.patch[1], 1,
                      node.trainable)
    if node.bias:
        yield GraphTensor(join(path, "bias"), node.dim, 1, node.trainable)


@dataclass(frozen=True)
class Param(Node):
    """One raw parameter tensor of `shape` (nn.Parameter: a CLS token, a table kept as a Parameter, a bias)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@handler("params", Param)
def _param_params(node: Param) -> int:
    return node.numel


@handler("tensors", Param)
def _param_tensors(node: Param, path: str) -> Iterator[GraphTensor]:
    yield GraphTensor(path, node.numel, 1, node.trainable)

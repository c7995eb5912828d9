"""Linear (any dense projection: nn.Linear, GPT-2's Conv1D, a router) and LoraLinear (a frozen base plus trainable
low-rank A and B), with their tensor-parallel split."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ..registry import GraphTensor, Node, handler, join

SHARD_STYLES = ("column", "row", "vocab")


@dataclass(frozen=True)
class Shard:
    """How tensor parallelism splits a node over `degree` ranks: 'column' splits the output features (weight rows
    and bias), 'row' splits the input features (the bias stays whole), 'vocab' splits a vocabulary (embedding rows,
    LM-head outputs) padded up to a multiple of the degree."""

    style: str
    degree: int

    def __post_init__(self) -> None:
        if self.style not in SHARD_STYLES:
            raise ValueError(f"shard style must be one of {', '.join(SHARD_STYLES)}, got {self.style!r}")
        if self.degree < 1:
            raise ValueError(f"shard degree must be at least 1, got {self.degree}")


@dataclass(frozen=True)
class Linear(Node):
    """y = x W^T (+ b): `in_features` x `out_features` weight. `storage` names a quantized storage ('nf4', 'int8')
    when a transform sets one; `shard` is set by with_tensor_parallel."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    trainable: bool = True
    storage: str | None = None
    shard: Shard | None = None
    conv1d: bool = field(default=False, kw_only=True)
    """transformers' Conv1D (GPT-2): the weight is stored in x out and `addmm(bias, x, weight)` saves the
    nn.Parameter itself for backward, not a transposed view of it."""
    bnb_quantized: bool = field(default=True, kw_only=True)
    """Whether transformers' bitsandbytes loader packs it (4-bit / 8-bit): replace_with_bnb_linear
    (integrations/bitsandbytes.py) converts a module whose type is exactly nn.Linear or Conv1D, so a subclass
    (Falcon's FalconLinear) keeps its 16-bit weight under QLoRA."""

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features


def _local_out(out_features: int, shard: Shard | None) -> int:
    if shard is None or shard.style == "row":
        return out_features
    if shard.style == "vocab":  # padded to a multiple of the degree
        return -(-out_features // shard.degree)
    return out_features // shard.degree


def linear_rows(node: Linear) -> tuple[tuple[str, int, int], ...]:
    """(suffix, numel, numel on one rank) of the weight and, with a bias, the bias."""
    s, out = node.shard, node.out_features
    local_in = node.in_features // s.degree if s is not None and s.style == "row" else node.in_features
    rows = [("weight", node.weight_numel, local_in * _local_out(out, s))]
    if node.bias:
        rows.append(("bias", out, _local_out(out, s)))
    return tuple(rows)


@handler("params", Linear)
def _linear_params(node: Linear) -> int:
    return node.weight_numel + (node.out_features if node.bias else 0)


@handler("tensors", Linear)
def _linear_tensors(node: Linear, path: str) -> Iterator[GraphTensor]:
    for suffix, numel, local in linear_rows(node):
        yield GraphTensor(join(path, suffix), numel, 1, node.trainable, local)


@dataclass(frozen=True)
class LoraLinear(Node):
    """A LoRA-adapted projection (peft's lora.Linear): the frozen `base`, A (in x rank) and B (rank x out), both
    trainable and bias-free. Tensors are named like peft's: <path>.base_layer.weight, <path>.lora_A.<adapter>.weight."""

    base: Linear
    rank: int
    a: Linear
    b: Linear
    alpha: float = 8.0
    adapter: str = "default"
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.base.name)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features


def lora_shards(shard: Shard | None) -> tuple[Shard | None, Shard | None]:
    """(A's, B's) shard under a base sharded `shard`: a column-split base splits B's outputs (A whole); a
    row-split base splits A's inputs (B whole), as Megatron-style LoRA layers do."""
    if shard is None:
        return None, None
    if shard.style == "row":
        return Shard("row", shard.degree), None
    return None, Shard(shard.style, shard.degree)


def make_lora(base: Linear, rank: int, *, alpha: float = 8.0, adapter: str = "default") -> LoraLinear:
    a_shard, b_shard = lora_shards(base.shard)
    return LoraLinear(
        base=replace(base, trainable=False),  # the base as it was, frozen (every field carried over)
        rank=rank,
        a=Linear("lora_A", base.in_features, rank, False, True, None, a_shard),
        b=Linear("lora_B", rank, base.out_features, False, True, None, b_shard),
        alpha=alpha,
        adapter=adapter,
    )


@handler("children", LoraLinear)
def _lora_children(node: LoraLinear, path: str):
    yield "base", None, node.base, join(path, "base_layer")
    yield "a", None, node.a, join(path, f"lora_A.{node.adapter}")
    yield "b", None, node.b, join(path, f"lora_B.{node.adapter}")


@handler("params", LoraLinear)
def _lora_params(node: LoraLinear) -> int:
    return sum(_linear_params(n) for n in (node.base, node.a, node.b))


@handler("tensors", LoraLinear)
def _lora_tensors(node: LoraLinear, path: str) -> Iterator[GraphTensor]:
    for _, _, child, child_path in _lora_children(node, path):
        yield from _linear_tensors(child, child_path)

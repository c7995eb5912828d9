"""The structure kinds: Block (one layer: its nodes in execution order), Stack (a ModuleList of identical blocks)
and ModelGraph (embedding, stacks, final norm, head and the odd extra parameters)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..model_spec import ParamTensor
from .kinds.embedding import Embedding, PatchEmbedding
from .kinds.linear import Linear, LoraLinear
from .kinds.norm import Dropout, Norm
from .registry import (GraphTensor, Node, children_params, children_tensors, dispatch, field_children, handler,
                       params_of, tensors_of, walk)
from .saved import NotModelledError, Saved, SavedCtx, saved_by

SEQ_AXES = ("tokens", "source", "target", "patches")


@dataclass(frozen=True)
class Block(Node):
    """One layer. `nodes` run in this order (pre-norm: Norm, Attention, Norm, MLP; post-norm: Attention, Norm, MLP,
    Norm). `parallel_residual`: attention and MLP read the same input (GPT-J, GPT-NeoX, Falcon, Phi-1/2);
    `sandwich_norms`: norms before and after each sub-layer (Gemma 2/3)."""

    nodes: tuple[Node, ...]
    parallel_residual: bool = False
    sandwich_norms: bool = False
    name: str = field(default="", kw_only=True)


@handler("children", Block)
def _block_children(node: Block, path: str):
    return field_children(node, path, ("nodes",))


handler("params", Block)(children_params)
handler("tensors", Block)(children_tensors)


@handler("saved", Block)
def _block_saved(node: Block, ctx: SavedCtx) -> list[Saved]:
    """Its nodes' rows, each node seeing the block's dropouts. With a parallel residual every norm reads the
    block input, kept once (GPT-NeoX's two LayerNorms); pre- and post-norm blocks need nothing more."""
    ctx = ctx.with_dropout(tuple((n.where, n.p) for n in node.nodes if isinstance(n, Dropout)))
    norms = [n for n in node.nodes if isinstance(n, Norm)]
    if any(n.fp32_output for n in norms) and not node.sandwich_norms:
        # Gemma 1's blocks: fp32 norm outputs were checked on Gemma 2's sandwich blocks only
        raise NotModelledError("fp32-output norms outside sandwich blocks: no measured 'saved' formula yet")
    rows: list[Saved] = []
    input_kept = False
    for child in node.nodes:
        if isinstance(child, Norm) and node.parallel_residual:
            rows += saved_by(child, replace(ctx, input_saved=not input_kept))
            input_kept = True
        else:
            rows += saved_by(child, ctx)
    return rows + _residual_masks(node, norms, ctx)


def _residual_masks(node: Block, norms: list[Norm], ctx: SavedCtx) -> list[Saved]:
    """Dropout on each sub-layer's output keeps only its mask (GPT2Block's resid_dropout / GPT2MLP's dropout,
    BertSelfOutput / BertOutput). Counted for sequential LayerNorm blocks, where it was measured; Phi-3's
    resid_attn/mlp_dropout and GPT-NeoX's post_attention/post_mlp_dropout masks are not counted yet."""
    if ctx.dropout_p("residual") <= 0 or node.parallel_residual or not norms or any(n.kind != "layer" for n in norms):
        return []
    return [Saved("norms", norms[0].dim, ctx.d.mask)] * 2


@handler("matmuls", Block)
def _block_matmuls(node: Block) -> list[tuple[str, int]]:
    """(group, output width) of every matmul of the layer, in the order the forward runs them."""
    return [m for child in node.nodes for m in dispatch("matmuls", child)]


@dataclass(frozen=True)
class Stack(Node):
    """`count` copies of `block` in the ModuleList at `name` (tensors named '<name>.*.<...>'), from layer `first`
    (two stacks share a ModuleList when its layers differ: DeepSeek's dense first layers). `seq_axis`: which
    sequence the stack runs over. `before` / `after`: nodes (named by their full paths) the stack runs before and
    after its blocks (BERT's embedding LayerNorm, OPT's project_in, T5's encoder final norm)."""

    name: str
    count: int
    block: Block
    seq_axis: str = "tokens"
    first: int = 0
    before: tuple[Node, ...] = ()
    after: tuple[Node, ...] = ()

    def __post_init__(self) -> None:
        if self.seq_axis not in SEQ_AXES:
            raise ValueError(f"seq_axis must be one of {', '.join(SEQ_AXES)}, got {self.seq_axis!r}")

    @property
    def layer_params(self) -> int:
        return params_of(self.block)


@handler("children", Stack)
def _stack_children(node: Stack, path: str):
    for index, child in enumerate(node.before):
        yield "before", index, child, child.name
    yield "block", None, node.block, f"{node.name}.*"
    for index, child in enumerate(node.after):
        yield "after", index, child, child.name


@handler("params", Stack)
def _stack_params(node: Stack) -> int:
    edges = sum(params_of(n) for n in (*node.before, *node.after))
    return edges + node.count * params_of(node.block)


@handler("tensors", Stack)
def _stack_tensors(node: Stack, path: str) -> Iterator[GraphTensor]:
    for field_name, _, child, child_path in _stack_children(node, path):
        for t in tensors_of(child, child_path):
            yield t if field_name != "block" else GraphTensor(t.name, t.numel, t.count * node.count, t.trainable,
                                                              t.local)


@dataclass(frozen=True)
class ModelGraph(Node):
    """A whole model: `embed`, then `stacks` in order (encoder before decoder), `final_norm` (after the last
    stack), `head`. `extra_params`: parameters outside those (learned position tables, T5's relative-position
    buckets, ViT's CLS token). Every node is named by its full path, so param_tensors() reads like the module's
    own named_parameters(), a layer index shown as '*'."""

    name: str
    embed: Embedding | PatchEmbedding
    stacks: tuple[Stack, ...]
    head: Node | None
    final_norm: Norm | None = None
    extra_params: tuple[Node, ...] = ()
    model_type: str = ""
    config: Any = field(default=None, compare=False, hash=False, repr=False)
    """The config the graph was built from (for display; never read by handlers)."""

    @property
    def num_params(self) -> int:
        return params_of(self)

    @property
    def num_trainable_params(self) -> int:
        return sum(t.total for t in self.tensors() if t.trainable)

    @property
    def num_params_per_rank(self) -> int:
        """Parameter elements one tensor-parallel rank holds (= num_params without with_tensor_parallel)."""
        return sum(t.local * t.count for t in self.tensors())

    @property
    def num_trainable_params_per_rank(self) -> int:
        return sum(t.local * t.count for t in self.tensors() if t.trainable)

    @property
    def num_layers(self) -> int:
        return sum(s.count for s in self.stacks)

    def tensors(self) -> tuple[GraphTensor, ...]:
        """Every parameter tensor once (tied weights once), equal rows merged: ('model.layers.*.mlp.up_proj.weight',
        numel, count=num_layers, trainable, local)."""
        merged: dict[tuple[str, int, bool, int], int] = {}
        for t in tensors_of(self, ""):
            key = (t.name, t.numel, t.trainable, t.local)
            merged[key] = merged.get(key, 0) + t.count
        return tuple(GraphTensor(name, numel, count, trainable, local)
                     for (name, numel, trainable, local), count in merged.items())

    def param_tensors(self, *, trainable: bool | None = None, per_rank: bool = False) -> tuple[ParamTensor, ...]:
        """The tensors as ModelSpec.params holds them (name pattern, numel, count); `trainable` keeps only the
        trainable (True) or frozen (False) ones; `per_rank` gives one tensor-parallel rank's numel."""
        merged: dict[tuple[str, int], int] = {}
        for t in self.tensors():
            if trainable is None or t.trainable == trainable:
                key = (t.name, t.local if per_rank else t.numel)
                merged[key] = merged.get(key, 0) + t.count
        return tuple(ParamTensor(name, numel, count) for (name, numel), count in merged.items())

    def linears(self) -> tuple[tuple[str, Linear | LoraLinear], ...]:
        """(path, node) of every projection, LoRA-adapted ones as one LoraLinear, tied heads left out."""
        return linears_of(self)

    def nodes(self, kind: type) -> tuple[tuple[str, Node], ...]:
        """(path, node) of every node of exactly `kind`."""
        return tuple((path, node) for path, node, _ in walk(self) if type(node) is kind)


def linear_copies(graph: ModelGraph) -> Iterator[tuple[Linear, int, tuple]]:
    """Every Linear node (a LoRA base, A and B each), with how many copies of it the model holds (its stack's depth
    x the experts of a stacked Experts) and its ancestry, as `walk` gives it."""
    from .kinds.mlp import Experts

    for _path, node, parents in walk(graph):
        if isinstance(node, Linear):
            copies = 1
            for parent, field_name in parents:
                if isinstance(parent, Stack) and field_name == "block":
                    copies *= parent.count
                elif isinstance(parent, Experts) and field_name == "expert":
                    copies *= parent.num_experts
            yield node, copies, parents


def linears_of(node: Node, path: str = "") -> tuple[tuple[str, Linear | LoraLinear], ...]:
    """(path, projection) of every Linear / LoraLinear under any node (an Attention's q/k/v/o, an MLP's
    up/down, a whole graph's), LoRA-adapted ones as one LoraLinear, a tied head's projection left out."""
    return tuple((p, n) for p, n, parents in walk(node, path)
                 if isinstance(n, (Linear, LoraLinear)) and not inside_lora(parents) and not tied_head_weight(parents))


def inside_lora(parents: tuple) -> bool:
    """Whether a node is the base, A or B of a LoraLinear."""
    return bool(parents) and isinstance(parents[-1][0], LoraLinear)


def tied_head_weight(parents: tuple) -> bool:
    """Whether a projection is a tied head's (its weight is the embedding's)."""
    return bool(parents) and getattr(parents[-1][0], "tied", False) is True and parents[-1][1] in ("proj", "decoder")


@handler("children", ModelGraph)
def _graph_children(node: ModelGraph, path: str):
    yield from field_children(node, "", ("embed", "extra_params", "stacks", "final_norm", "head"))


handler("params", ModelGraph)(children_params)
handler("tensors", ModelGraph)(children_tensors)


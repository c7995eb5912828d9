"""MLP (dense feed-forward) and Experts (a routed mixture of MLPs, optionally with shared experts)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..registry import (GraphTensor, Node, children_params, children_tensors, field_children, handler, join, params_of,
                        tensors_of)
from ..saved import Saved, SavedCtx, shard_degree
from .linear import Linear, LoraLinear, linear_rows


@dataclass(frozen=True)
class MLP(Node):
    """`up` holds the column-parallel input projections (gate and up, a fused gate_up, or fc1), `down` the
    row-parallel output projection. `gated`: act(gate(x)) * up(x) (SwiGLU, GeGLU) rather than act(fc1(x))."""

    hidden: int
    intermediate: int
    gated: bool
    act: str
    up: tuple[Linear | LoraLinear, ...]
    down: Linear | LoraLinear
    name: str = field(default="mlp", kw_only=True)

    @property
    def bias(self) -> bool:
        return any((p.base if isinstance(p, LoraLinear) else p).bias for p in (*self.up, self.down))


@handler("children", MLP)
def _mlp_children(node: MLP, path: str):
    return field_children(node, path, ("up", "down"))


handler("params", MLP)(children_params)
handler("tensors", MLP)(children_tensors)


def act_saved(act: str) -> int:
    """I-sized tensors the activation saves: gelu_new is written out in Python (pow, tanh, two muls) and saves
    four; torch's own silu/gelu/relu save their input only."""
    return 4 if act == "gelu_new" else 1


def _local_intermediate(node: MLP) -> int:
    return node.intermediate // shard_degree(node.up[0])


@handler("saved", MLP)
def _mlp_saved(node: MLP, ctx: SavedCtx) -> list[Saved]:
    """The input projections' shared input; gated: the gate output (saved by the activation), the activation and
    up outputs (saved by the mul), the product (saved by down); plain: the activation's saved tensors and the
    down projection's input."""
    inter = _local_intermediate(node)
    if node.gated:
        return [Saved("mlp", node.hidden, "lin", 1 if len(node.up) == 1 else 2, role="up"),
                Saved("mlp", (2 + act_saved(node.act)) * inter, "cmp"), Saved("mlp", inter, "cmp", role="down")]
    return [Saved("mlp", node.hidden, "lin", role="up"), Saved("mlp", act_saved(node.act) * inter, "cmp"),
            Saved("mlp", inter, "cmp", role="down")]


@handler("matmuls", MLP)
def _mlp_matmuls(node: MLP) -> list[tuple[str, int]]:
    """(group, output width) of its matmuls in forward order: gate and up (or the fused gate_up, or fc1), down."""
    inter = _local_intermediate(node)
    if node.gated:
        up = [("mlp", 2 * inter)] if len(node.up) == 1 else [("mlp", inter), ("mlp", inter)]
    else:
        up = [("mlp", inter)]
    return up + [("mlp", node.hidden)]


@dataclass(frozen=True)
class Experts(Node):
    """`num_experts` copies of `expert`, `top_k` of them per token, chosen by `router` (hidden -> num_experts).
    `shared_experts`: an MLP every token goes through (DeepSeek merges its n shared experts into one wider MLP);
    `shared_gate`: Qwen2-MoE's sigmoid gate on it. `stacked`: transformers 5 keeps each projection of all experts
    as one 3-D parameter (<path>.experts.gate_up_proj, E x 2I x H); otherwise a ModuleList
    (<path>.experts.*.<proj>.weight).

    What the router keeps (read off transformers 5.24's TopKRouter classes): `normalize_topk` divides the top-k
    probabilities by their sum (Mixtral always; Qwen2-MoE / OLMoE per norm_topk_prob); `scores_dtype` is 'f32' when
    the routing weights stay fp32 (Mixtral) or 'cmp' when they are cast back to the logits' dtype. `implementation`:
    transformers' experts implementation ('grouped_mm', its default, or 'eager', the per-expert loop); `aux_loss`:
    output_router_logits (the load-balancing loss is computed, its inputs kept for backward)."""

    num_experts: int
    top_k: int
    expert: MLP
    router: Linear | LoraLinear
    shared_experts: MLP | None = None
    shared_gate: Linear | LoraLinear | None = None
    stacked: bool = True
    normalize_topk: bool = True
    scores_dtype: str = "f32"
    implementation: str = "grouped_mm"
    aux_loss: bool = False
    name: str = field(default="mlp", kw_only=True)


@handler("children", Experts)
def _experts_children(node: Experts, path: str):
    yield "expert", None, node.expert, join(path, "experts.*" if not node.stacked else "experts")
    yield from field_children(node, path, ("router", "shared_experts", "shared_gate"))


@handler("params", Experts)
def _experts_params(node: Experts) -> int:
    shared = sum(params_of(n) for n in (node.router, node.shared_experts, node.shared_gate) if n is not None)
    return node.num_experts * params_of(node.expert) + shared


@handler("tensors", Experts)
def _experts_tensors(node: Experts, path: str) -> Iterator[GraphTensor]:
    for field_name, _, child, child_path in _experts_children(node, path):
        if field_name != "expert":
            yield from tensors_of(child, child_path)
        elif node.stacked:
            yield from _stacked(node, child_path)
        else:
            for t in children_tensors(child, child_path):
                yield GraphTensor(t.name, t.numel, t.count * node.num_experts, t.trainable, t.local)


def _stacked(node: Experts, path: str) -> Iterator[GraphTensor]:
    """One E x out x in tensor per projection (and an E x out '<proj>_bias' where the projection has a bias)."""
    for proj in (*node.expert.up, node.expert.down):
        if isinstance(proj, LoraLinear):
            raise TypeError(f"LoRA on stacked expert weights ('{join(path, proj.name)}') is not modelled")
        for suffix, numel, local in linear_rows(proj):
            name = join(path, proj.name if suffix == "weight" else f"{proj.name}_bias")
            yield GraphTensor(name, node.num_experts * numel, 1, proj.trainable, node.num_experts * local)


@handler("matmuls", Experts)
def _experts_matmuls(node: Experts) -> list[tuple[str, int]]:
    """One expert's matmuls in its own layout (stacked experts: one gate_up): what selective-op's recompute cost
    (memfit.techniques.costs) reads. A routed token's top_k experts, the router and a shared expert are not in it."""
    return _mlp_matmuls(node.expert)

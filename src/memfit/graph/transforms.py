"""Structural techniques as pure functions over a graph: each returns a new ModelGraph and never mutates its input.

- with_lora: every targeted Linear becomes a LoraLinear (frozen base + trainable A, B); the rest is frozen.
- with_tensor_parallel: sets `shard` on column- and row-parallel projections, the token embedding and the heads.
Both only restructure and recount parameters; memory formulas stay in the estimator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConfigError
from .kinds.attention import Attention
from .kinds.embedding import Embedding
from .kinds.heads import LMHead, MaskedLMHead, Seq2SeqLMHead
from .kinds.linear import Linear, LoraLinear, Shard, lora_shards, make_lora
from .kinds.mlp import MLP, Experts
from .model import ModelGraph, inside_lora, tied_head_weight
from .registry import children_of, walk

Parents = tuple[tuple[Any, str], ...]
"""(ancestor node, the field of it that leads here), outermost first."""


def rewrite(node: Any, fn: Callable[[Any, str, Parents], Any], path: str = "", parents: Parents = ()) -> Any:
    """Rebuild `node` bottom-up: children first, then fn(node, path, parents) (return the node to keep it)."""
    changes: dict[str, Any] = {}
    for field, index, child, child_path in list(children_of(node, path)):
        new = rewrite(child, fn, child_path, parents + ((node, field),))
        if new is child:
            continue
        if index is None:
            changes[field] = new
        else:
            current = changes.get(field, getattr(node, field))
            changes[field] = current[:index] + (new,) + current[index + 1:]
    if changes:
        node = dataclasses.replace(node, **changes)
    return fn(node, path, parents)


def _in_stacked_experts(parents: Parents) -> bool:
    return any(isinstance(n, Experts) and f == "expert" and n.stacked for n, f in parents)


def _matches(path: str, targets: tuple[str, ...]) -> bool:
    """peft's rule for a list of target_modules: the module's name is a target or ends with '.' + a target."""
    return any(path == t or path.endswith("." + t) for t in targets)


def with_lora(graph: ModelGraph, rank: int, targets: Iterable[str], *, alpha: float = 8.0,
              freeze_base: bool = True) -> ModelGraph:
    """LoRA on every Linear whose path matches `targets` (peft's target_modules rule: a name or a dotted suffix):
    frozen base, trainable A (in x rank) and B (rank x out). With `freeze_base` (peft's default) every other
    parameter is frozen too. Stacked expert weights and tied heads are not targets (peft cannot adapt them
    through target_modules either). ConfigError (one line) when nothing matches."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"LoRA rank must be a positive whole number, got {rank!r}")
    if not targets:
        raise ConfigError("LoRA needs at least one target module name (e.g. q_proj, v_proj)")
    matched: list[str] = []

    def adapt(node: Any, path: str, parents: Parents) -> Any:
        if inside_lora(parents):
            return node
        if (isinstance(node, Linear) and _matches(path, targets) and not _in_stacked_experts(parents)
                and not tied_head_weight(parents)):
            matched.append(path)
            return make_lora(node, rank, alpha=float(alpha))
        if freeze_base and getattr(node, "trainable", False) is True and not isinstance(node, LoraLinear):
            return dataclasses.replace(node, trainable=False)
        return node

    new = rewrite(graph, adapt)
    if not matched:
        names = sorted({path.rsplit(".", 1)[-1] for path, _ in graph.linears()})
        raise ConfigError(f"no Linear in '{graph.name}' matches LoRA targets {list(targets)}; "
                          f"its projections are named: {', '.join(names)}")
    return new


# (parent kind, field) -> how tensor parallelism splits the projection held there
_TP_STYLE: dict[tuple[type, str], str] = {
    (Attention, "qkv"): "column",
    (Attention, "out"): "row",
    (MLP, "up"): "column",
    (MLP, "down"): "row",
    (LMHead, "proj"): "vocab",
    (Seq2SeqLMHead, "proj"): "vocab",
    (MaskedLMHead, "decoder"): "vocab",
}


def _tp_problems(graph: ModelGraph, degree: int) -> list[str]:
    problems: list[str] = []
    for path, node, _ in walk(graph):
        if isinstance(node, Attention):
            for label, value in (("q_heads", node.q_heads), ("kv_heads", node.kv_heads)):
                if value % degree:
                    problems.append(f"{path} {label} ({value})")
        elif isinstance(node, MLP) and node.intermediate % degree:
            problems.append(f"{path} intermediate ({node.intermediate})")
    return list(dict.fromkeys(problems))


def with_tensor_parallel(graph: ModelGraph, degree: int) -> ModelGraph:
    """Megatron-style tensor parallelism over `degree` ranks: q/k/v and MLP input projections split by output
    (column), attention output and MLP down projections by input (row), the token embedding and LM head by
    vocabulary; norms, routers, position tables and MLA's down projections stay whole on every rank. A LoRA
    adapter follows its base (lora_shards). ConfigError (one line) unless `degree` divides every attention's
    query and key/value heads and every MLP's intermediate size."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"tensor parallel degree must be a positive whole number, got {degree!r}")
    if degree == 1:
        return graph
    problems = _tp_problems(graph, degree)
    if problems:
        raise ConfigError(f"tensor parallel degree {degree} must divide " + "; ".join(problems))

    def style_of(parents: Parents) -> str | None:
        return _TP_STYLE.get((type(parents[-1][0]), parents[-1][1])) if parents else None

    def shard(node: Any, path: str, parents: Parents) -> Any:
        if isinstance(node, Embedding) and parents and isinstance(parents[-1][0], ModelGraph):
            return dataclasses.replace(node, shard=Shard("vocab", degree))
        if inside_lora(parents):
            return node  # set with its LoraLinear below
        style = style_of(parents)
        if style is None:
            return node
        if isinstance(node, Linear):
            return dataclasses.replace(node, shard=Shard(style, degree))
        if isinstance(node, LoraLinear):
            base_shard = Shard(style, degree)
            a_shard, b_shard = lora_shards(base_shard)
            return dataclasses.replace(node, base=dataclasses.replace(node.base, shard=base_shard),
                                       a=dataclasses.replace(node.a, shard=a_shard),
                                       b=dataclasses.replace(node.b, shard=b_shard))
        return node

    return rewrite(graph, shard)

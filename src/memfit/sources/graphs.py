"""Attach the typed model graph (memfit.graph) to a ModelSpec built from an HF config, where a builder exists."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..errors import MemfitError
from ..model_spec import ModelSpec


def with_graph(spec: ModelSpec, config: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> ModelSpec:
    """`spec` with its ModelGraph (built from `config`, or from what `config()` returns), or `spec` unchanged when
    no graph builder knows the architecture: the transforms that need the graph (LoRA) then say so."""
    from ..graph import graph_from_config, graph_model_types

    if spec.graph is not None or spec.model_type not in graph_model_types():
        return spec
    try:
        values = config() if callable(config) else config
        graph = graph_from_config(values, name=spec.name)
    except (MemfitError, ArithmeticError, ValueError, TypeError, KeyError):
        return spec
    return replace(spec, graph=graph)

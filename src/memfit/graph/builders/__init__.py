"""HF config dict -> ModelGraph: one small builder per family, registered by model_type (`@builder("llama")`).
An unknown model_type raises ModelSourceError naming it (the caller may then trace the real module instead)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ...errors import ModelSourceError
from ..model import ModelGraph
from .common import _BUILDERS, SEQUENCE_CLASSIFIERS, Builder, Cfg, builder, sequence_labels  # noqa: F401

def graph_model_types() -> tuple[str, ...]:
    """The model_types a graph can be built for from a config alone."""
    return tuple(sorted(_BUILDERS))


def config_reader(config: Mapping[str, Any]) -> Cfg:
    """A reader of `config` (a dict with a model_type that has a builder) with its family's defaults: the one place a
    config value and its transformers default are read (memfit.sources reads the spec's numbers through it)."""
    model_type = config["model_type"]
    return Cfg(config, model_type, _BUILDERS[model_type][1])


def graph_from_config(config: Any, *, name: str | None = None, source: str = "config") -> ModelGraph:
    """The ModelGraph of a Hugging Face config (a dict or anything with to_dict(), e.g. a PretrainedConfig).
    ModelSourceError (one line) for an unknown model_type or a malformed config."""
    if not isinstance(config, Mapping) and callable(getattr(config, "to_dict", None)):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ModelSourceError(f"{source}: a model config must be a mapping, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelSourceError(f"{source}: config has no 'model_type' string; is this a Hugging Face config.json?")
    if model_type not in _BUILDERS:
        raise ModelSourceError(f"{source}: no graph builder for model_type '{model_type}' (known: "
                               f"{', '.join(graph_model_types())}); trace the built module instead")
    fn = _BUILDERS[model_type][0]
    cfg = config_reader(config)
    try:
        graph = fn(cfg, name or str(config.get("_name_or_path") or model_type))
    except (ArithmeticError, ValueError, TypeError):
        cfg.check(source)  # a bad value usually caused it: name the key
        raise
    cfg.check(source)
    if sequence_labels(cfg) is not None and model_type not in SEQUENCE_CLASSIFIERS:
        raise ModelSourceError(f"{source}: a {model_type} sequence classifier is not modelled (memfit builds "
                               f"{', '.join(SEQUENCE_CLASSIFIERS.values())}); trace the built module instead")
    return replace(graph, model_type=model_type, config=dict(config))


from . import decoders, encoders, gpt, moe, seq2seq  # noqa: E402,F401  (registers the builders)

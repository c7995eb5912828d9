"""A live model -> ModelSpec: exact parameter tensors from the module, architecture numbers from its HF config.

Nothing here imports torch or transformers: a module is read through `named_parameters()` and a config through
`to_dict()`, so this works on meta-device, fake-tensor and real models alike.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ..errors import ModelSourceError
from ..model_spec import ModelSpec, ParamTensor
from .hf_config import from_hf_config

_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def is_module(obj: Any) -> bool:
    """Duck-typed torch.nn.Module (no torch import): has named_parameters() and parameters()."""
    return callable(getattr(obj, "named_parameters", None)) and callable(getattr(obj, "parameters", None))


def is_hf_config(obj: Any) -> bool:
    """Duck-typed transformers.PretrainedConfig: has to_dict() and a model_type, and is not a module."""
    return callable(getattr(obj, "to_dict", None)) and hasattr(obj, "model_type") and not is_module(obj)


def module_params(model: Any) -> tuple[ParamTensor, ...]:
    """The module's parameter tensors, tied ones once (named_parameters() skips repeats of the same Parameter),
    grouped so a tensor repeated in every layer is one row: 'model.layers.*.mlp.up_proj.weight' x num_layers."""
    counts: dict[tuple[str, int], int] = {}
    for name, param in model.named_parameters():
        key = (_LAYER_INDEX.sub("*", name), int(param.numel()))
        counts[key] = counts.get(key, 0) + 1
    return tuple(ParamTensor(name, numel, count) for (name, numel), count in counts.items())


def _frozen_numel(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters() if not getattr(p, "requires_grad", True))


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _numbers_without_layout(config: Any) -> dict[str, Any]:
    """Best-effort architecture numbers of a config whose model_type memfit has no layout for."""
    get = lambda key: _positive(getattr(config, key, None))  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or (hidden // heads if heads and hidden % heads == 0 else 0)
    return dict(
        hidden_size=hidden,
        num_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def from_pretrained_config(config: Any, *, name: str | None = None, source: str = "config") -> ModelSpec:
    """A ModelSpec from a transformers.PretrainedConfig object (through its to_dict(), no import needed)."""
    label = name or getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or "model"
    return from_hf_config(config.to_dict(), name=label, source=source)


def from_module(model: Any, *, name: str | None = None) -> ModelSpec:
    """A ModelSpec whose params are the module's own tensors (exact, tied once). A transformers PreTrainedModel
    also gives its architecture numbers through model.config; a plain nn.Module gives params only (model_type
    'custom', num_layers 0, so only a trace can size its activations)."""
    if not is_module(model):
        raise ModelSourceError(f"expected an nn.Module, got {type(model).__name__}")
    params = module_params(model)
    extra: dict[str, Any] = {}
    frozen = _frozen_numel(model)
    if frozen:
        extra["num_frozen_params"] = frozen
    config = getattr(model, "config", None)
    label = name or (getattr(config, "_name_or_path", "") if config is not None else "") or type(model).__name__
    if config is None or not is_hf_config(config):
        return ModelSpec(name=label, model_type="custom", params=params, num_layers=0, gated_mlp=False,
                         hidden_act="", norm="", source="module", extra=extra)
    try:
        spec = from_pretrained_config(config, name=label, source="module")
    except ModelSourceError:
        # No memfit layout for this model_type (or an odd config): the module's tensors are still exact.
        spec = ModelSpec(name=label, model_type=str(config.model_type), params=(), source="module",
                         gated_mlp=False, hidden_act=str(getattr(config, "hidden_act", "") or ""), norm="",
                         extra={"layout_known": False}, **_numbers_without_layout(config))
    return replace(spec, params=params, extra={**spec.extra, **extra})

"""Resolve any model reference into a ModelSpec: a catalog name, a config.json, a hub id, a config dict or object,
or a live nn.Module. The only part of memfit that reads Hugging Face configs or modules; importing it imports
neither torch nor transformers (the hub path imports transformers when it is used)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ModelSourceError, suggest
from ..model_spec import ModelSpec
from .graphs import with_graph
from .catalog import catalog_config, catalog_entry, catalog_names, catalog_spec, close_names, find_entry
from .hf_config import SUPPORTED_MODEL_TYPES, from_config_file, from_hf_config, from_hub, hub_config
from .module import from_module, from_pretrained_config, is_hf_config, is_module

__all__ = [
    "SUPPORTED_MODEL_TYPES", "catalog_config", "catalog_entry", "catalog_names", "from_config_file",
    "from_hf_config", "from_hub", "from_module", "from_pretrained_config", "hf_config_dict", "hub_config",
    "resolve_model",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", re.ASCII)
"""namespace/name, as the Hub spells repository ids (ASCII letters, digits, '-', '_', '.')."""
_MAX_HUB_ID = 96 * 2 + 1
"""The Hub caps namespace and name at 96 characters each; a longer 'id' is no id."""


def _looks_like_path(text: str) -> bool:
    return (text.endswith(".json") or text.startswith((".", "/", "~")) or "\\" in text or text.count("/") > 1
            or bool(re.match(r"^[A-Za-z]:", text)))


def _local_path(text: str) -> Path | None:
    """The existing file or folder `text` names, or None. A name the OS cannot even look up (too long, a NUL
    byte, an unknown ~user) is no local path either, and then a ModelSourceError when it looks like one."""
    try:
        path = Path(text).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError, RuntimeError) as error:  # ENAMETOOLONG, embedded NUL, unknown ~user
        if _looks_like_path(text):
            reason = getattr(error, "strerror", None) or str(error)
            raise ModelSourceError(f"cannot read the model path '{_shorten(text)}': {reason}") from None
        return None


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _resolve_text(text: str, name: str | None) -> ModelSpec:
    entry = find_entry(text)
    if entry is not None:
        spec = catalog_spec(entry["name"])
        return replace(spec, name=name) if name else spec
    path = _local_path(text)
    if path is not None:
        return with_graph(from_config_file(path, name=name), lambda: hf_config_dict(str(path)))
    if _looks_like_path(text):
        raise ModelSourceError(f"no config.json at '{_shorten(text)}': check the path, or use a catalog name "
                               "(`memfit models` lists them)")
    if _HUB_ID.match(text) and len(text) <= _MAX_HUB_ID:
        return from_hub(text, name=name, alternatives=close_names(text))
    raise suggest(_shorten(text), catalog_names(), "model")


def resolve_model(ref: Any, *, name: str | None = None) -> ModelSpec:
    """A ModelSpec from whatever names a model:

    - a catalog name or alias, case-insensitive ('llama-3.1-8b', 'Qwen/Qwen2.5-7B' is matched offline too);
    - a path to a config.json, or to a folder holding one;
    - a hub id 'org/name' (transformers.AutoConfig; offline or missing -> ModelSourceError naming alternatives);
    - a config dict, or a transformers PretrainedConfig;
    - an nn.Module or PreTrainedModel (its exact tensors; architecture numbers from model.config when it has one).

    `name` overrides the name the spec is shown under. An unknown plain name raises UnknownNameError listing the
    closest catalog names.
    """
    if isinstance(ref, ModelSpec):
        return replace(ref, name=name) if name else ref
    if isinstance(ref, os.PathLike):
        return with_graph(from_config_file(ref, name=name), lambda: hf_config_dict(str(ref)))
    if isinstance(ref, str):
        text = ref.strip()
        if not text:
            raise ModelSourceError("empty model reference: give a catalog name, a config.json path or a hub id")
        return _resolve_text(text, name)
    if isinstance(ref, Mapping):
        label = name or ref.get("_name_or_path") or ref.get("model_type") or "model"
        return with_graph(from_hf_config(ref, name=str(label), source="config dict"), ref)
    if is_module(ref):
        return from_module(ref, name=name)
    if is_hf_config(ref):
        return from_pretrained_config(ref, name=name)
    raise ModelSourceError(f"cannot read a model from a {type(ref).__name__}: give a catalog name, a config.json "
                           "path, a hub id, a config dict or an nn.Module")


def hf_config_dict(ref: str | os.PathLike | Mapping) -> dict[str, Any]:
    """The HF config values behind a model reference, to build the real model (trace, measure): a catalog entry's
    config, a config.json's contents, or a hub id's config through transformers."""
    if isinstance(ref, Mapping):
        return dict(ref)
    text = str(ref).strip()
    entry = find_entry(text) if isinstance(ref, str) else None
    if entry is not None:
        return catalog_config(entry["name"])
    path = _local_path(text)
    if path is not None:
        if path.is_dir():
            path = path / "config.json"
        import json

        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ModelSourceError(f"cannot read {path}: {error}") from None
    spec = _resolve_text(text, None)  # raises the usual one-line errors for unknown names and bad paths
    return hub_config(spec.extra.get("hub_id", text))

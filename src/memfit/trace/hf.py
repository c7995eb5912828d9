"""Transformers models for the tracer: a model reference to its HF config dict, and the layers FSDP shards."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from .. import sources
from .._torch.blocks import find_blocks
from ..errors import ModelSourceError


def resolve_config(model_ref: str | Mapping) -> tuple[dict, str]:
    """(HF config dict, display name) for a catalog name, a config.json path, a hub id or a config dict."""
    if isinstance(model_ref, Mapping):
        config = dict(model_ref)
        return config, str(config.get("_name_or_path") or config.get("model_type") or "model")
    spec = sources.resolve_model(model_ref)  # raises the sources' own clear errors (unknown name, offline hub)
    text = model_ref.strip()
    if spec.source == "catalog":
        return sources.catalog_config(text), spec.name
    path = Path(text).expanduser()
    if path.exists():
        return _read_config(path), spec.name
    return sources.hub_config(text), spec.name


def _read_config(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot read '{file}': {error}") from None


def block_finder(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one at a time: memfit._torch.blocks.find_blocks, the one finder (HF's repeated
    `_no_split_modules` classes, else repeated children of a ModuleList / Sequential)."""
    return find_blocks(model)

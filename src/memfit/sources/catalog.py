"""The built-in, offline model catalog (data/models.json): names, aliases and hub ids -> real config.json values."""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import replace
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import suggest
from ..model_spec import ModelSpec
from .graphs import with_graph
from .hf_config import from_hf_config


@lru_cache(maxsize=1)
def _entries() -> tuple[dict[str, Any], ...]:
    raw = json.loads(resources.files("memfit").joinpath("data/models.json").read_text(encoding="utf-8"))
    return tuple(raw["models"])


def _key(text: str) -> str:
    return text.strip().lower().replace(" ", "-").replace("_", "-")


@lru_cache(maxsize=1)
def _index() -> dict[str, dict[str, Any]]:
    """Every spelling that names an entry (canonical name, aliases, hub id), normalised -> entry."""
    index: dict[str, dict[str, Any]] = {}
    for entry in _entries():
        for spelling in (entry["name"], entry["hub_id"], *entry.get("aliases", ())):
            index[_key(spelling)] = entry
    for entry in _entries():  # a listed hub id also answers to its repository name alone ('Meta-Llama-3-8B-Instruct')
        namespace = entry["hub_id"].split("/", 1)[0].lower()
        for spelling in (entry["hub_id"], *entry.get("aliases", ())):
            owner, _, repo = spelling.partition("/")
            if repo and owner.lower() == namespace:  # a hub id of the entry's own org, not 'vit-b/16'
                index.setdefault(_key(repo), entry)
    return index


def find_entry(ref: str) -> dict[str, Any] | None:
    """The catalog entry `ref` names (case-insensitive name, alias or hub id), or None."""
    return _index().get(_key(ref))


def catalog_names() -> list[str]:
    """Canonical names of the built-in models, in catalog order (grouped by family)."""
    return [entry["name"] for entry in _entries()]


def close_names(text: str, limit: int = 3) -> list[str]:
    """Catalog names closest to `text` (or to the part after a hub namespace, 'org/Name-Instruct' -> 'name')."""
    index = _index()
    candidates = [_key(text), _key(text.rsplit("/", 1)[-1])]
    found: list[str] = []
    for candidate in candidates:
        for match in difflib.get_close_matches(candidate, list(index), n=limit * 2, cutoff=0.6):
            name = index[match]["name"]
            if name not in found:
                found.append(name)
    return found[:limit]


def _entry_or_raise(name: str) -> dict[str, Any]:
    entry = find_entry(name)
    if entry is None:
        raise suggest(name, catalog_names(), "model")
    return entry


def catalog_spec(name: str) -> ModelSpec:
    """The ModelSpec of a catalog model; UnknownNameError listing close names when there is none."""
    entry = _entry_or_raise(name)
    spec = from_hf_config(entry["config"], name=entry["name"], source="catalog")
    return with_graph(replace(spec, extra={**spec.extra, "hub_id": entry["hub_id"]}), entry["config"])


def catalog_entry(name: str) -> dict[str, Any]:
    """One catalog model summarised for `memfit models`: identity, size and shape."""
    entry = _entry_or_raise(name)
    spec = catalog_spec(entry["name"])
    return {
        "name": entry["name"],
        "hub_id": entry["hub_id"],
        "family": entry["family"],
        "model_type": spec.model_type,
        "num_params": spec.num_params,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_kv_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "aliases": list(entry.get("aliases", ())),
        "note": entry.get("note", ""),
    }


def catalog_config(name: str) -> dict[str, Any]:
    """A copy of the catalog's config.json values for `name` (to build the real model in tests or traces)."""
    return copy.deepcopy(_entry_or_raise(name)["config"])

"""The catalog's derived families on a fresh machine: `memfit plan NAME` reads the derivations memfit ships
(memfit/data/derived) and traces nothing; every derived catalog entry has its files there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.derive import cache as derive_cache
from memfit.derive.spec import PARAMS_KIND
from memfit.sources import catalog_config, catalog_entry, catalog_names
from memfit.sources.hf_config import SUPPORTED_MODEL_TYPES

SHIPPED_KINDS = ("amp-bf16/sdpa/cuda", "bf16/sdpa/cuda")
NO_SDPA = {"gpt_oss"}
"""transformers builds these with eager attention only: their eager kinds are shipped."""


def _derived_names() -> list[str]:
    """The catalog entries whose activations memfit.derive sizes (their graph has nodes no formula sizes)."""
    from memfit.sources import resolve_model

    return [n for n in catalog_names() if resolve_model(n).derived is not None]


def _memfit(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEMFIT_CACHE_DIR=str(cache))
    return subprocess.run([str(Path(sys.executable).parent / "memfit"), *args], capture_output=True, text=True,
                          timeout=300, env=env)


STACKED_SHIPPED = {"t5-large", "vit-large-patch16-224", "vit-base-patch16-224", "vit-huge-patch14-224-in21k", "dinov2-small",
                   "dinov2-base", "dinov2-large"}
"""Encoder-decoder / vision entries (memfit.derive.stacks) whose fits are shipped; the others ship their parameter
tensors and derive a kind on first use (about a minute), until `python scripts/ship_derived.py` is run for them."""


@pytest.mark.parametrize("name", _derived_names())
def test_every_derived_catalog_entry_ships_its_derivations(name):
    from memfit.derive.stacks import STACK_KEYS

    config = catalog_config(name)
    if config["model_type"] in STACK_KEYS:
        kinds = tuple(f"{k}/{c}" for k in SHIPPED_KINDS for c in ("nockpt", "ckpt")) if name in STACKED_SHIPPED else ()
        for kind in (PARAMS_KIND, *kinds):
            data = derive_cache.shipped_data(config, kind)
            assert data is not None and data["kind"] == kind, (name, kind, derive_cache.shipped_name(config, kind))
        return
    kinds = SHIPPED_KINDS
    if config["model_type"] in NO_SDPA:
        kinds = tuple(k.replace("/sdpa/", "/eager/") for k in kinds)
    layout = config["model_type"] in SUPPORTED_MODEL_TYPES  # parameters by arithmetic (qwen3), activations derived
    for kind in (*(() if layout else (PARAMS_KIND,)), *kinds):
        data = derive_cache.shipped_data(config, kind)
        assert data is not None, (name, kind, derive_cache.shipped_name(config, kind))
        assert data["config_hash"] == derive_cache.config_hash(config) and data["kind"] == kind
        if kind != PARAMS_KIND:  # derived under today's memfit.derive.fit (else it would be derived again)
            assert data.get("format") == derive_cache.FIT_FORMAT, (name, kind, "python scripts/ship_derived.py")


def test_shipped_derivations_are_small_and_all_belong_to_the_catalog():
    import memfit

    folder = Path(memfit.__file__).parent / "data" / "derived"
    files = sorted(folder.glob("*.json"))
    assert sum(f.stat().st_size for f in files) < 2 * 1024 * 1024
    hashes = {derive_cache.config_hash(catalog_config(n)) for n in catalog_names()}
    assert {f.name.split("-", 1)[0] for f in files} <= hashes


@pytest.mark.parametrize("name, extra", [
    ("mixtral-8x7b", ()),  # MoE
    ("deepseek-v3", ()),  # MoE with multi-head latent attention and a dense prefix, 671B
    ("gemma-3-1b", ()),  # sliding-window / global layers
    ("gpt-oss-20b", ("--attention", "eager")),  # attention sinks: transformers has no sdpa path
])
@pytest.mark.processes
def test_plan_runs_from_the_shipped_derivations(name, extra, tmp_path):
    cache = tmp_path / "cache"
    done = _memfit("plan", name, "--gpu", "H100", "--json", *extra, cache=cache)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["num_params"] == catalog_entry(name)["num_params"]
    assert "memfit/data/derived (shipped)" in done.stdout
    assert not list(cache.glob("*.json")), "a shipped catalog model was derived again"


@pytest.mark.processes
def test_gpt_oss_plans_with_eager_attention_by_default(tmp_path):
    done = _memfit("plan", "gpt-oss-20b", "--gpu", "H100", "--json", cache=tmp_path / "cache")
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert json.loads(done.stdout)["initial_setup"]["attention"] == "eager"
    assert "no sdpa attention for gpt_oss" in done.stdout
    assert not list((tmp_path / "cache").glob("*.json"))

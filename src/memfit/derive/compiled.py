"""torch.compile's fits, where memfit.estimate.compiled gets them (registered in memfit.estimate.fits by this
package's __init__): a compiled block's saved bytes by group, from this process, the shipped data, the disk cache
(memfit.derive.cache, kind `compile-<dtype>/<attention>/<kernels>`), or traced now on fake tensors
(memfit._torch.compiled: AOTAutograd's min-cut partition of one block) at memfit.derive's shapes and fitted like
its eager fits, linear in (tokens, tokens x seq, seq, 1) per group, checked on its held-out shape."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, ModelSourceError
from ..estimate import compiled as compiled_estimate  # KIND_PREFIX, read when called (it imports this package)
from ..sources import hf_config_dict
from .cache import cache_key, cache_path, config_hash, library_versions, read_json, shipped_data, write_json
from .fit import CHECK_SHAPE, FIT_SHAPES, TOLERANCE, _basis, _solve
from .model import GROUPS, Linear, kind_setup

_FITS: dict[str, dict[str, Linear]] = {}


def model_config(spec) -> dict[str, Any]:
    """The HF config the block is built from: the derived model's, the catalog's, a config.json's or the hub's."""
    derived = getattr(spec, "derived", None)
    if derived is not None:
        return dict(derived.config)
    if spec.source == "catalog":
        return hf_config_dict(spec.name)
    if spec.source.startswith("hub:"):
        return hf_config_dict(spec.source[len("hub:"):])
    if spec.source not in ("config dict", "module", "config"):
        return hf_config_dict(spec.source)
    raise ConfigError(f"tracing a compiled block needs the model's config: give '{spec.name}' as a catalog name, "
                      "a config.json path or a hub id")


def fit_ready(config: dict[str, Any], kind: str) -> bool:
    """Whether the fit of `kind` is at hand without a trace: in this process, shipped or cached on disk."""
    key = cache_key(config, kind)
    return key in _FITS or any(_from_payload(data) is not None for data in (
        shipped_data(config, kind), read_json(cache_path(config, kind), key)))


def block_fit(config: dict[str, Any], kind: str) -> dict[str, Linear]:
    """The fitted lines of `kind` for `config`: from this process, the shipped data, the disk cache or traced now."""
    key = cache_key(config, kind)
    if key in _FITS:
        return _FITS[key]
    for data in (shipped_data(config, kind), read_json(cache_path(config, kind), key)):
        fit = _from_payload(data)
        if fit is not None:
            _FITS[key] = fit
            return fit
    fit, error = fit_kind(config, kind)
    _FITS[key] = fit
    payload = {"key": key, "format": 1, "kind": kind, "architecture": config.get("model_type"),
               "config_hash": config_hash(config), "versions": library_versions(), "fit_error": error,
               "fit": {g: line.to_list() for g, line in fit.items()}}
    write_json(cache_path(config, kind), payload)
    return fit


def fit_kind(config: dict[str, Any], kind: str) -> tuple[dict[str, Linear], float]:
    """Partition one block at memfit.derive's FIT_SHAPES, fit each group exactly, check on CHECK_SHAPE."""
    from .._torch.compiled import traced_saved_bytes  # torch

    base, kernels = kind_setup(kind[len(compiled_estimate.KIND_PREFIX):])
    traced = traced_saved_bytes(config, base, kernels, list(FIT_SHAPES) + [CHECK_SHAPE])
    rows = [_basis(b, t) for b, t in FIT_SHAPES]
    fit = {g: _solve(rows, [s[g] for s in traced[:len(FIT_SHAPES)]]) for g in (*GROUPS, "shared")}
    held, (batch, seq) = traced[-1], CHECK_SHAPE
    scale = max(1, sum(held[g] for g in GROUPS))
    worst = 0.0
    for group, line in fit.items():
        error = abs(line(batch * seq, seq) - held[group])
        if error > TOLERANCE * scale + 512:
            raise ModelSourceError(f"architecture '{config.get('model_type')}': what a compiled block saves is not "
                                   f"linear in batch and sequence ({group}: fit {line(batch * seq, seq):,} B vs "
                                   f"traced {held[group]:,} B); use `memfit trace`")
        worst = max(worst, error / scale)
    return fit, worst


def _from_payload(data: dict[str, Any] | None) -> dict[str, Linear] | None:
    try:
        return {g: Linear.from_list(v) for g, v in data["fit"].items()} if data is not None else None
    except (KeyError, TypeError, ValueError):
        return None

"""The denoiser's step fitted per block: a full-size Flux or SD3 transformer sized in seconds instead of minutes.

The step of a transformer denoiser is its stem (embedders, final norm and projection, the loss, the optimizer's
fixed part) plus, per block kind, the same bytes for every block of that kind: each block keeps its own saved
tensors (or, checkpointed, its input), its own weights, gradients and optimizer states. So copies of the denoiser
with one block of each kind and with one more block of one kind, traced on fake tensors at the real shape and
setup (memfit.diffusion.model.trace_denoiser, every allocation counted), give every term of the full step:
term(full) = term(base) + sum over kinds of (blocks of that kind - 1) x (term(one more) - term(base)). The fit is
checked on a copy with two blocks of every kind (three for a one-kind stack): beyond TOLERANCE, or with the peak in
another phase in some copy, the whole model is traced instead. An fp8 base under checkpointing is never fitted
(memfit.diffusion.api): the compute-dtype copies alive at the peak depend on which block's backward it falls in,
and at Flux-dev 512 px the 2-block check passes while the full-depth figure is 1.5 GiB off. `exact=True` (CLI
`--exact`) always traces the whole model.

Which copies: Flux's double-stream (`num_layers`) and single-stream (`num_single_layers`) blocks, diffusers
FluxTransformer2DModel; SD3's joint blocks (`num_layers`; the last one is context_pre_only at every depth, so the
copies differ by a regular block). Not fitted: an SD3 with dual-attention layers (SD3.5 Medium: its blocks are of
two kinds at fixed indices) and SDXL's UNet, whose down / mid / up stages differ in width and resolution (no
repeated block to count): both are traced whole, as before.

Fits are cached on disk as memfit.derive caches its fits (memfit.derive.cache: one JSON file per key, written
atomically), keyed by the denoiser's config, the shape, the setup and the library versions."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ..derive.cache import FORMAT, cache_dir, config_hash, library_versions, read_json, write_json
from ..errors import ConfigError
from ..estimate.result import MemoryEstimate, Phase, Term
from ..estimate.terms import Category, TermKey
from ..setup import TrainingSetup
from .latents import Shapes
from .model import trace_denoiser
from .presets import DiffusionModel

BLOCK_KEYS = {"flux": ("num_layers", "num_single_layers"), "sd3": ("num_layers",)}
"""The config keys of each family's repeated blocks, in forward order."""
TOLERANCE = 1e-3
"""Relative error allowed on the check copy."""


def fittable(model: DiffusionModel) -> bool:
    """Whether the denoiser's step is fitted per block (see the module docstring)."""
    config = model.denoiser.config
    if model.family not in BLOCK_KEYS or any(int(config.get(k, 0) or 0) < 1 for k in BLOCK_KEYS[model.family]):
        return False
    return not (model.family == "sd3" and config.get("dual_attention_layers"))


@dataclasses.dataclass(frozen=True)
class FittedStep:
    memory: MemoryEstimate
    params: int
    """The denoiser's parameters without the adapters."""
    trainable: int
    fitted: bool = True
    """False: the fit missed its check and the whole model was traced (cached all the same)."""


def _copy(model: DiffusionModel, blocks: dict[str, int]) -> DiffusionModel:
    config = {**copy.deepcopy(model.denoiser.config), **blocks}
    return dataclasses.replace(model, denoiser=dataclasses.replace(model.denoiser, config=config))


def _traced(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, traced: dict) -> dict[str, Any]:
    """One copy's step as plain numbers: {"terms": {(name, category): bytes}, "peak": phase, "phases": {...},
    "params", "trainable", "total"}."""
    keep: dict = {}
    memory = trace_denoiser(model, shp, setup, keep=keep, **traced)
    net = keep["model"]
    names = {id(p): n for n, p in net.named_parameters()}
    return {"terms": {(str(t.name), t.category.value): t.num_bytes for t in memory.terms},
            "sources": {str(t.name): t.source for t in memory.terms},
            "peak": memory.peak_phase.value, "phases": {p.value: b for p, b in memory.phase_peaks.items()},
            "params": sum(p.numel() for p in net.parameters() if "lora_" not in names.get(id(p), "")),
            "trainable": sum(p.numel() for p in net.parameters() if p.requires_grad),
            "total": memory.tensor_bytes, "notes": list(memory.notes)}


def _extrapolate(base: dict, more: dict[str, dict], depth: dict[str, int], field: str) -> dict:
    keys = set(base[field]).union(*(set(m[field]) for m in more.values()))
    return {k: base[field].get(k, 0) + sum((depth[kind] - 1) * (more[kind][field].get(k, 0) - base[field].get(k, 0))
                                           for kind in more) for k in keys}


def _scalar(base: dict, more: dict[str, dict], depth: dict[str, int], field: str) -> int:
    return base[field] + sum((depth[kind] - 1) * (more[kind][field] - base[field]) for kind in more)


def _fit(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, traced: dict) -> dict[str, Any]:
    kinds = BLOCK_KEYS[model.family]
    base_blocks = {k: 1 for k in kinds}
    base = _traced(_copy(model, base_blocks), shp, setup, traced)
    more = {k: _traced(_copy(model, {**base_blocks, k: 2}), shp, setup, traced) for k in kinds}
    check_blocks = {k: 2 if len(kinds) > 1 else 3 for k in kinds}
    check = _traced(_copy(model, check_blocks), shp, setup, traced)
    predicted = _scalar(base, more, check_blocks, "total")
    peaks = {base["peak"], check["peak"], *(m["peak"] for m in more.values())}
    checked = {"blocks": check_blocks, "fitted": predicted, "traced": check["total"]}
    if len(peaks) > 1 or abs(predicted - check["total"]) > TOLERANCE * check["total"]:
        # not linear in the blocks at this setup (the peak moment moves with depth): the whole model is traced
        whole = _traced(model, shp, setup, traced)
        return {**_payload(whole, whole["terms"], whole["phases"], whole["params"], whole["trainable"]),
                "check": checked, "fitted": False}
    depth = {k: int(model.denoiser.config[k]) for k in kinds}
    return {**_payload(base, _extrapolate(base, more, depth, "terms"), _extrapolate(base, more, depth, "phases"),
                       _scalar(base, more, depth, "params"), _scalar(base, more, depth, "trainable")),
            "check": checked, "fitted": True}


def _payload(run: dict, terms: dict, phases: dict, params: int, trainable: int) -> dict[str, Any]:
    return {"terms": [[name, category, num, run["sources"].get(name, "")]
                      for (name, category), num in sorted(terms.items())],
            "peak": run["peak"], "phases": phases, "params": params, "trainable": trainable, "notes": run["notes"]}


def _key(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, batch: int, traced: dict) -> str:
    try:
        diffusers = version("diffusers")
    except PackageNotFoundError:
        diffusers = "missing"
    text = json.dumps({"config": config_hash({"_class": model.denoiser.cls, **model.denoiser.config}),
                       "shape": [shp.height, shp.width, shp.text_tokens, batch], "setup": repr(setup),
                       "traced": traced, "versions": {**library_versions(), "diffusers": diffusers},
                       "format": FORMAT, "what": "diffusion-blocks-2"}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def fit_denoiser(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, *, batch: int = 1, kernels: str = "cuda",
                 lora_dtype: str = "fp32", base_dtype: str = "bf16", whole: bool = False) -> FittedStep:
    """The denoiser's step at full depth from traced copies with few blocks (see the module docstring); `whole`:
    the whole model traced, cached the same way (a ladder re-estimates the same step for every rung after it)."""
    if not fittable(model):
        raise ConfigError(f"{model.name}'s denoiser is not fitted per block ({model.family}): trace it whole")
    traced = {"batch": batch, "kernels": kernels, "lora_dtype": lora_dtype, "base_dtype": base_dtype}
    key = _key(model, shp, setup, batch, {**traced, "whole": whole})
    path = cache_dir() / f"diffusion-{key}.json"
    data = read_json(path, key)
    if data is None:
        if whole:
            run = _traced(model, shp, setup, traced)
            found = {**_payload(run, run["terms"], run["phases"], run["params"], run["trainable"]), "check": None,
                     "fitted": False}
        else:
            found = _fit(model, shp, setup, traced)
        data = {"key": key, "format": FORMAT, **found}
        write_json(path, data)
    return _step(data, setup, batch)


def _step(data: dict[str, Any], setup: TrainingSetup, batch: int) -> FittedStep:
    check = data["check"]
    if check is None:
        source = "traced whole (an fp8 base under checkpointing is not fitted per block)"
    elif data["fitted"]:
        source = (f"fitted per block: copies with 1 and 2 blocks traced, extrapolated per block kind (checked on "
                  f"{check['blocks']}: {check['fitted']:,} B fitted, {check['traced']:,} B traced)")
    else:
        source = (f"traced whole: the per-block fit missed its check ({check['blocks']}: {check['fitted']:,} B "
                  f"fitted, {check['traced']:,} B traced)")
    terms = tuple(Term(TermKey(name), Category(category), num, source=f"{src}; {source}" if src else source)
                  for name, category, num, src in data["terms"])
    memory = MemoryEstimate(terms=terms, peak_phase=Phase(data["peak"]), method="traced",
                            setup=setup.replace(micro_batch_size=batch),
                            phase_peaks={Phase(p): b for p, b in data["phases"].items()},
                            notes=(*data["notes"], source))
    return FittedStep(memory, int(data["params"]), int(data["trainable"]), bool(data["fitted"]))

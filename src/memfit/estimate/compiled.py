"""torch.compile: what a compiled transformer block keeps for backward, as the real partitioner decides it.

The bytes come from AOTAutograd's `min_cut_rematerialization_partition` (torch/_functorch/partitioners.py, inductor's
default) run on one block of the model on fake tensors (memfit._torch.compiled): the forward graph's saved outputs,
views resolved to their storage. They are traced at memfit.derive's shapes and fitted like its eager fits, linear in
(tokens, tokens x seq, seq, 1) per group, checked on its held-out shape, and cached with memfit.derive's cache under
the kind `compile-<dtype>/<attention>/<kernels>`.

What memfit assumes: each block compiled on its own (torchtune `training.compile_model`, torchtitan `apply_compile`).
What compile does not change here: parameters, gradients, optimizer state; the embedding, final norm, LM head and
the loss stay eager (but torchtune's chunked loss, which torchtune compiles with the model: memfit.estimate.
compiled_loss); the backward temporaries of a block are eager's (a compiled
backward recomputes the pointwise chains it did not save, into fused kernels: measured on CPU, no more than eager's).
Under autocast the compiled graph casts each weight itself: the casts it saves are in the block's bytes, so the
autocast cache term only holds the LM head's copy.
"""

from __future__ import annotations

from typing import Any

from ..derive.model import GROUPS, Linear, setup_kind
from ..errors import ConfigError, ModelSourceError
from ..setup import TrainingSetup

SOURCE = "torch/_functorch/partitioners.py min_cut_rematerialization_partition, traced on fake tensors"
KIND_PREFIX = "compile-"
NOTE = ("torch.compile per block: each block keeps what AOTAutograd's min-cut partitioner saves (traced on fake "
        "tensors); embedding, LM head and loss eager (torchtune's chunked loss compiled with the model: "
        "memfit.estimate.compiled_loss); backward temporaries sized as eager's")

_FITS: dict[str, dict[str, Linear]] = {}


def compiled_kind(setup: TrainingSetup, on_cpu: bool) -> str:
    return KIND_PREFIX + setup_kind(setup, on_cpu)


def layer_saved_bytes(spec, setup: TrainingSetup, tokens: int, seq_len: int, on_cpu: bool) -> dict[str, int]:
    """Bytes one compiled block keeps for backward, by group (attention / mlp / norms, see _torch.compiled); eager's
    where the block is not traced (`unsized`): the partitioner saves no more than eager autograd in every block
    bench/compile.py measures, so eager's bytes are an upper bound there."""
    from . import activations as act

    if unsized(spec, setup):
        return act.layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    fit = block_fit(model_config(spec), compiled_kind(setup, on_cpu))
    return {g: max(0, fit[g](tokens, seq_len)) for g in GROUPS}


def unsized(spec, setup: TrainingSetup) -> str:
    """Why a compiled block is sized as eager ('' when it is traced)."""
    from . import moe

    if setup.finetune.adapters:
        return "the traced block carries no LoRA adapters"
    if moe.has_experts(spec):  # the graph's, not the MoE formulas' applicability (a bf16 Mixtral is derived)
        return "routed experts are not traced compiled"
    if setup.tp > 1:
        return "the traced block is unsharded (tp 1)"
    try:
        model_config(spec)
    except ConfigError as error:
        return str(error)
    return ""


def model_config(spec) -> dict[str, Any]:
    """The HF config the block is built from: the derived model's, the catalog's, a config.json's or the hub's."""
    derived = getattr(spec, "derived", None)
    if derived is not None:
        return dict(derived.config)
    from ..sources import hf_config_dict

    if spec.source == "catalog":
        return hf_config_dict(spec.name)
    if spec.source.startswith("hub:"):
        return hf_config_dict(spec.source[len("hub:"):])
    if spec.source not in ("config dict", "module", "config"):
        return hf_config_dict(spec.source)
    raise ConfigError(f"tracing a compiled block needs the model's config: give '{spec.name}' as a catalog name, "
                      "a config.json path or a hub id")


def fit_ready(spec, setup: TrainingSetup, on_cpu: bool) -> bool:
    """Whether sizing `setup` compiled needs no trace now (shipped, cached on disk or in this process): the ladder
    proposes compile only then, so `memfit plan` never starts a compile trace the user did not ask for."""
    from ..derive.cache import cache_key, cache_path, read_json, shipped_data

    if unsized(spec, setup):
        return True
    config, kind = model_config(spec), compiled_kind(setup, on_cpu)
    key = cache_key(config, kind)
    return key in _FITS or any(_from_payload(data) is not None for data in (
        shipped_data(config, kind), read_json(cache_path(config, kind), key)))


def block_fit(config: dict[str, Any], kind: str) -> dict[str, Linear]:
    """The fitted lines of `kind` for `config`: from this process, the shipped data, the disk cache or traced now."""
    from ..derive.cache import cache_key, cache_path, config_hash, library_versions, read_json, shipped_data, \
        write_json

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
    from .._torch.compiled import traced_saved_bytes
    from ..derive.fit import CHECK_SHAPE, FIT_SHAPES, TOLERANCE, _basis, _solve
    from ..derive.model import kind_setup

    base, kernels = kind_setup(kind[len(KIND_PREFIX):])
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


def notes(spec, setup: TrainingSetup) -> tuple[str, ...]:
    if not setup.compile:
        return ()
    why = unsized(spec, setup)
    return (f"torch.compile sized as eager ({why}): an upper bound",) if why else (NOTE,)

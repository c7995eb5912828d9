"""memfit.derive: a per-block memory model for any architecture transformers can build, derived by tracing a 1- and
a 2-block copy on fake tensors at a few small shapes, fitted linearly in (tokens, tokens x seq, seq) and cached.

The estimator sizes a ModelSpec that carries `derived` (families without a recipe) from the fits (memfit.estimate.
derived); importing this package registers where they come from (memfit.estimate.fits: this cache, this tracer) and
imports neither torch nor transformers: a derivation imports them when it runs.
"""

from __future__ import annotations

from typing import Any

from ..estimate import fits as _fits
from ..estimate.derived import (block_temporaries, embedding_saved_bytes, head_saved_bytes,  # noqa: F401
                                layer_saved_bytes, notes)
from ..setup import TrainingSetup
from . import cache as _cache, compiled as _compiled, stacks_estimate as _stacks_estimate
from .model import DerivedModel, KindFit, Linear, setup_kind
from .spec import derived_spec

_fits.provide(derived=_cache.load_or_derive, compiled=_compiled,  # the estimator's fits: this cache, this tracer
              stacked=_stacks_estimate)

__all__ = ["DerivedModel", "KindFit", "Linear", "derive_model", "derived_spec", "setup_kind"]


def derive_model(config: dict[str, Any], setup=None, *, on_cpu: bool = False) -> DerivedModel:
    """The derived model of an HF config dict, with the kind `setup` needs fitted (or loaded from the cache)."""
    model = DerivedModel(dict(config))
    model.fit(setup or TrainingSetup(), on_cpu)
    return model

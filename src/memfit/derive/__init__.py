"""memfit.derive: a per-block memory model for any architecture transformers can build, derived by tracing a 1- and
a 2-block copy on fake tensors at a few small shapes, fitted linearly in (tokens, tokens x seq, seq) and cached.

The estimator's activation functions dispatch here when a ModelSpec carries `derived` (families without a recipe);
importing this package imports neither torch nor transformers: a derivation imports them when it runs.
"""

from __future__ import annotations

from typing import Any

from .model import DerivedModel, KindFit, Linear, setup_kind

__all__ = ["DerivedModel", "KindFit", "Linear", "derive_model", "derived_spec", "setup_kind"]


def derive_model(config: dict[str, Any], setup=None, *, on_cpu: bool = False) -> DerivedModel:
    """The derived model of an HF config dict, with the kind `setup` needs fitted (or loaded from the cache)."""
    from ..setup import TrainingSetup

    model = DerivedModel(dict(config))
    model.fit(setup or TrainingSetup(), on_cpu)
    return model


def derived_spec(config: dict[str, Any], *, name: str, source: str, base=None):
    from .spec import derived_spec as build

    return build(config, name=name, source=source, base=base)


# ---- what the estimator calls (memfit.estimate.activations / analytic dispatch here) ---------------------------

def layer_saved_bytes(spec, setup, tokens: int, seq_len: int, on_cpu: bool = False) -> dict[str, int]:
    return spec.derived.fit(setup, on_cpu).block_bytes(tokens, seq_len)


def head_saved_bytes(spec, setup, tokens: int, on_cpu: bool | None = None) -> dict[str, int]:
    fit = spec.derived.fit(setup, on_cpu).at(setup.seq_len)
    return {"head": max(0, fit.head(tokens, setup.seq_len, constant=False))}


def embedding_saved_bytes(spec, setup, tokens: int, seq_len: int, on_cpu: bool = False) -> int:
    return max(0, spec.derived.fit(setup, on_cpu).at(seq_len).embedding(tokens, seq_len, constant=False))


def lora_bytes(spec, setup, what: str, tokens: int, seq_len: int, on_cpu: bool | None = None) -> int:
    """Under LoRA: what block 0 keeps less than the others ('first'), the embedding leaf apart from block 0's
    input ('leaf'): KindFit.lora."""
    return spec.derived.fit(setup, on_cpu).lora_bytes(what, tokens, seq_len)


def block_temporaries(spec, setup, tokens: int, seq_len: int, on_cpu: bool = False) -> int:
    return spec.derived.fit(setup, on_cpu).temporaries_bytes(tokens, seq_len)


def notes(spec) -> tuple[str, ...]:
    derived = getattr(spec, "derived", None)
    return (derived.note(),) if derived is not None else ()

"""A derived model's bytes as the estimator reads them (memfit.estimate.activations / analytic dispatch here when
a ModelSpec carries `derived`, a family without formulas): the fitted lines of memfit.derive.model.DerivedModel,
whose fits come from memfit.estimate.fits' registered source."""

from __future__ import annotations


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

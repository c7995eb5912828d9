"""What a derivation produces: per setup kind, linear models of what a block, the head and the embedding keep for
backward, and of one block's backward temporaries, in (tokens, sequence length); and the model's parameter tensors.

Every coefficient is bytes. A `Linear` is `a x tokens + b x tokens x seq + c x seq + d`: tokens = micro-batch x
sequence length, the `b` term is eager attention's T x T, `c` a per-sequence table (positions, rotary cos/sin), `d`
whatever does not scale (autocast's cached weight copies, a block's own gradients while its backward runs).
Nothing here imports torch: a cached or shipped derivation is read back with json alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..estimate import fits
from ..setup import Precision, TrainingSetup

GROUPS = ("attention", "mlp", "norms")


@dataclass(frozen=True)
class Linear:
    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0

    def __call__(self, tokens: int, seq: int, *, constant: bool = True) -> int:
        value = self.a * tokens + self.b * tokens * seq + self.c * seq + (self.d if constant else 0.0)
        return int(round(value))

    def to_list(self) -> list[float]:
        return [self.a, self.b, self.c, self.d]

    @classmethod
    def from_list(cls, values) -> "Linear":
        a, b, c, d = (float(v) for v in values)
        return cls(a, b, c, d)


@dataclass(frozen=True)
class KindFit:
    """One setup kind's coefficients. `temporaries` is an upper envelope: the peak of a block's backward is the
    largest of several linear functions (the MLP's gradients at short sequences, eager attention's T x T ones at
    long ones), each the live bytes at one moment of that backward."""

    kind: str
    block: dict[str, Linear]
    head: Linear
    embedding: Linear
    temporaries: tuple[Linear, ...]
    fit_error: float = 0.0
    """Largest relative error of the fit on the held-out shape."""
    shapes: tuple[tuple[int, int], ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    window: int = 0
    beyond: KindFit | None = None
    """A sliding-window model (Gemma 3 under sdpa): the fit for sequences of `window` tokens or more, traced at
    shapes past the window. transformers builds the sliding layers' mask only from there on
    (masking_utils._ignore_causal_mask_sdpa: `kv_length >= local_attention_size`), so the memory of a block is
    linear on each side of the window, not across it."""

    def at(self, seq: int) -> KindFit:
        """The fit that holds at sequence length `seq`."""
        return self.beyond if self.beyond is not None and seq >= self.window else self

    def block_bytes(self, tokens: int, seq: int) -> dict[str, int]:
        # constants are autocast's weight copies, which the estimator adds from the parameter tensors itself
        fit = self.at(seq)
        return {g: max(0, fit.block[g](tokens, seq, constant=False)) if g in fit.block else 0 for g in GROUPS}

    def temporaries_bytes(self, tokens: int, seq: int) -> int:
        return max([0] + [t(tokens, seq) for t in self.at(seq).temporaries])

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "block": {g: v.to_list() for g, v in self.block.items()},
               "head": self.head.to_list(), "embedding": self.embedding.to_list(),
               "temporaries": [t.to_list() for t in self.temporaries], "fit_error": self.fit_error,
               "shapes": [list(s) for s in self.shapes], "versions": dict(self.versions)}
        if self.beyond is not None:
            out.update(window=self.window, beyond=self.beyond.to_dict())
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KindFit:
        beyond = data.get("beyond")
        return cls(kind=str(data["kind"]), block={g: Linear.from_list(v) for g, v in data["block"].items()},
                   head=Linear.from_list(data["head"]), embedding=Linear.from_list(data["embedding"]),
                   temporaries=tuple(Linear.from_list(t) for t in data["temporaries"]),
                   fit_error=float(data.get("fit_error", 0.0)),
                   shapes=tuple(tuple(int(x) for x in s) for s in data.get("shapes", ())),
                   versions=dict(data.get("versions", {})), window=int(data.get("window", 0)),
                   beyond=cls.from_dict(beyond) if isinstance(beyond, dict) else None)


def setup_kind(setup: TrainingSetup, on_cpu: bool = False) -> str:
    """What changes what a block saves: the dtype classes (fp32; pure 16-bit parameters; autocast), the attention
    implementation and whose kernels (CPU or CUDA). Not checkpointing, batch or sequence: those are extrapolated.
    Dropout is in the config, so in the config's key."""
    precision = setup.precision
    if precision.is_autocast:
        dtype = "amp-bf16"
    elif precision.param_dtype == "bf16":
        dtype = "bf16"
    else:
        dtype = "fp32"
    return f"{dtype}/{setup.attention}/{'cpu' if on_cpu else 'cuda'}"


def kind_setup(kind: str) -> tuple[TrainingSetup, str]:
    """The representative setup a kind is traced under, and its kernels."""
    dtype, attention, kernels = kind.split("/")
    from ..setup import Attention

    return TrainingSetup(precision=Precision(dtype), attention=Attention(attention)), kernels


class DerivedModel:
    """Attached to a ModelSpec (`spec.derived`) for an architecture without a hand-written recipe: its config, and
    the fits of the kinds asked for so far, each derived on first use (then from the cache)."""

    def __init__(self, config: dict[str, Any], *, label: str = "") -> None:
        self.config = dict(config)
        self.label = label or str(config.get("model_type", "model"))
        self._fits: dict[str, KindFit] = {}
        self.last_on_cpu = False
        self.where: dict[str, str] = {}
        """kind -> where its fit came from (a cache file, or the shipped data)."""

    def fit(self, setup: TrainingSetup, on_cpu: bool | None = None) -> KindFit:
        """`on_cpu=None`: the kernels of the last call (the head is sized without a device)."""
        on_cpu = self.last_on_cpu if on_cpu is None else bool(on_cpu)
        self.last_on_cpu = on_cpu
        kind = setup_kind(setup, on_cpu)
        found = self._fits.get(kind)
        if found is None:
            found, where = fits.derived(self.config, kind, label=self.label)  # memfit.derive.cache's, registered
            self._fits[kind] = found
            self.where[kind] = where
        return found

    def note(self) -> str:
        where = ", ".join(sorted(set(self.where.values()))) or "the derivation cache"
        return f"activations derived from a trace of a 1- and 2-block copy (memfit.derive), cached at {where}"

    def __repr__(self) -> str:
        return f"DerivedModel({self.label!r}, kinds={sorted(self._fits)})"

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
from ..finetune import BaseWeights, Finetune
from ..setup import Precision, TrainingSetup

GROUPS = ("attention", "mlp", "norms")
ALL_LINEAR_KEY = "all-linear"


@dataclass(frozen=True)
class Adapters:
    """The LoRA setup a derivation runs under, so that the fit holds what peft keeps (issue 20: the derivation runs
    under the setup's structural transforms): the adapters' own saved tensors, what a frozen Linear no longer
    keeps, peft's fp32 copy of each adapted input, and with a 4-bit base bitsandbytes' Linear4bit (FakeLinear4bit
    on fake tensors) with peft's prepare_model_for_kbit_training (fp32 norms: an fp32 residual stream). Only what
    changes activation memory is in it: the targets as module names (or 'all-linear'), the rank, whether dropout
    runs, the base's storage ('4bit' for NF4 and FP4 alike: the same transients; double quantization changes only
    the static QuantState, which the estimator sizes) and whether the k-bit preparation upcasts."""

    targets: tuple[str, ...]
    rank: int
    dropout: bool
    base: str
    """'fp32' | 'bf16' | 'fp16' | '4bit'"""
    kbit_prep: bool = True

    def key(self) -> str:
        parts = ["lora", f"r{self.rank}", "+".join(self.targets), self.base]
        if self.dropout:
            parts.append("dropout")
        if self.base == "4bit" and not self.kbit_prep:
            parts.append("no-kbit-prep")
        return ",".join(parts)  # not '-': 'all-linear' and module names may hold one

    @classmethod
    def from_key(cls, key: str) -> Adapters:
        _lora, rank, targets, base, *flags = key.split(",")
        return cls(targets=tuple(targets.split("+")), rank=int(rank[1:]), dropout="dropout" in flags, base=base,
                   kbit_prep="no-kbit-prep" not in flags)

    def finetune(self) -> Finetune:
        """The peft Finetune the copies are built with (memfit._torch.lora.apply_adapters)."""
        quantized = self.base == "4bit"
        return Finetune(method="qlora" if quantized else "lora", rank=self.rank, alpha=2 * self.rank,
                        dropout=0.1 if self.dropout else 0.0, targets=self.targets,
                        base="nf4" if quantized else self.base, double_quant=quantized,
                        kbit_prep=None if self.kbit_prep or not quantized else False)

    @classmethod
    def of(cls, ft: Finetune, compute_dtype: str, targets: tuple[str, ...]) -> Adapters:
        base = ft.base_storage(compute_dtype)
        return cls(targets=tuple(sorted(targets)) if targets != (ALL_LINEAR_KEY,) else targets, rank=ft.rank,
                   dropout=ft.dropout > 0, base="4bit" if base.four_bit else base.value,
                   kbit_prep=ft.upcasts_unquantized())

    @staticmethod
    def supported(ft: Finetune, compute_dtype: str) -> bool:
        """peft's adapters on a 16/32-bit or bitsandbytes 4-bit base, as the trace builds them. Not derived (the
        formulas stay): LLM.int8 (no fake-tensor emulation), torchtune's recipe, DoRA, modules_to_save."""
        base = ft.base_storage(compute_dtype)
        return (ft.adapters and not ft.torchtune and not ft.dora and not ft.modules_to_save
                and base is not BaseWeights.INT8)


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
    lora: dict[str, Linear] = field(default_factory=dict)
    """Under LoRA (an Adapters kind) only. 'first': what block 0 keeps less than every other block, since nothing
    before it needs a gradient (a frozen embedding): its first norm keeps no input, and with q/v-only adapters in a
    parallel-residual block (GPT-J, Phi, Falcon) its frozen MLP keeps nothing at all; traced as the 1-block copy with
    and without peft's enable_input_require_grads. 'leaf': the embedding output when it is a tensor apart from block
    0's input (learned positions added to it, OPT / GPT-2), which enable_input_require_grads makes a leaf autograd
    keeps to the end of a checkpointed backward; 0 where block 0's checkpointed input is that very tensor."""
    beyond: KindFit | None = None
    """A sliding-window model (Gemma 3 under sdpa): the fit for sequences of `window` tokens or more, traced at
    shapes past the window. transformers builds the sliding layers' mask only from there on
    (masking_utils._ignore_causal_mask_sdpa: `kv_length >= local_attention_size`), so the memory of a block is
    linear on each side of the window, not across it."""

    def at(self, seq: int) -> KindFit:
        """The fit that holds at sequence length `seq`."""
        return self.beyond if self.beyond is not None and seq >= self.window else self

    def block_bytes(self, tokens: int, seq: int) -> dict[str, int]:
        # constants are autocast's weight copies, which the estimator adds from the parameter tensors itself; under
        # LoRA they are kept: the adapters' cached casts and each frozen fp32 Linear's cast per call, saved only where
        # its input needs a gradient (not in block 0 of a q/v-only parallel block), so the trace knows them better
        fit, constant = self.at(seq), bool(self.lora)
        return {g: max(0, fit.block[g](tokens, seq, constant=constant)) if g in fit.block else 0 for g in GROUPS}

    def lora_bytes(self, what: str, tokens: int, seq: int) -> int:
        """One of the LoRA lines ('first', 'leaf'), 0 for a fit without them."""
        line = self.at(seq).lora.get(what)
        return max(0, line(tokens, seq)) if line is not None else 0

    def temporaries_bytes(self, tokens: int, seq: int) -> int:
        return max([0] + [t(tokens, seq) for t in self.at(seq).temporaries])

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "block": {g: v.to_list() for g, v in self.block.items()},
               "head": self.head.to_list(), "embedding": self.embedding.to_list(),
               "temporaries": [t.to_list() for t in self.temporaries], "fit_error": self.fit_error,
               "shapes": [list(s) for s in self.shapes], "versions": dict(self.versions)}
        if self.lora:
            out["lora"] = {k: v.to_list() for k, v in self.lora.items()}
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
                   beyond=cls.from_dict(beyond) if isinstance(beyond, dict) else None,
                   lora={k: Linear.from_list(v) for k, v in data.get("lora", {}).items()})


def setup_kind(setup: TrainingSetup, on_cpu: bool = False, adapters: Adapters | None = None) -> str:
    """What changes what a block saves: the dtype classes (fp32; pure 16-bit parameters; autocast), the attention
    implementation and whose kernels (CPU or CUDA), and the LoRA adapters the copies carry (a fourth part; none for
    a full fine-tune, whose kinds are unchanged). Not checkpointing, batch or sequence: those are extrapolated.
    Dropout is in the config, so in the config's key."""
    precision = setup.precision
    if precision.is_autocast:
        dtype = "amp-bf16"
    elif precision.param_dtype == "bf16":
        dtype = "bf16"
    else:
        dtype = "fp32"
    kind = f"{dtype}/{setup.attention}/{'cpu' if on_cpu else 'cuda'}"
    return kind if adapters is None else f"{kind}/{adapters.key()}"


def kind_setup(kind: str) -> tuple[TrainingSetup, str]:
    """The representative setup a kind is traced under, and its kernels."""
    dtype, attention, kernels, *lora = kind.split("/")
    from ..setup import Attention

    finetune = Adapters.from_key(lora[0]).finetune() if lora else Finetune()
    return TrainingSetup(precision=Precision(dtype), attention=Attention(attention), finetune=finetune), kernels


def kind_adapters(kind: str) -> Adapters | None:
    parts = kind.split("/")
    return Adapters.from_key(parts[3]) if len(parts) > 3 else None


class DerivedModel:
    """Attached to a ModelSpec (`spec.derived`) for an architecture without a hand-written recipe: its config, and
    the fits of the kinds asked for so far, each derived on first use (then from the cache)."""

    def __init__(self, config: dict[str, Any], *, label: str = "", adapters: Adapters | None = None) -> None:
        self.config = dict(config)
        self.label = label or str(config.get("model_type", "model"))
        self.adapters = adapters
        """LoRA adapters every fit of this model is derived with (estimate.lora.adapted_spec sets them)."""
        self._fits: dict[str, KindFit] = {}
        self.last_on_cpu = False
        self.where: dict[str, str] = {}
        """kind -> where its fit came from (a cache file, or the shipped data)."""

    def fit(self, setup: TrainingSetup, on_cpu: bool | None = None) -> KindFit:
        """`on_cpu=None`: the kernels of the last call (the head is sized without a device)."""
        on_cpu = self.last_on_cpu if on_cpu is None else bool(on_cpu)
        self.last_on_cpu = on_cpu
        kind = setup_kind(setup, on_cpu, self.adapters)
        found = self._fits.get(kind)
        if found is None:
            found, where = fits.derived(self.config, kind, label=self.label)  # memfit.derive.cache's, registered
            self._fits[kind] = found
            self.where[kind] = where
        return found

    def with_adapters(self, adapters: Adapters) -> DerivedModel:
        """The same model, its fits derived with `adapters` on the traced copies."""
        return DerivedModel(self.config, label=self.label, adapters=adapters)

    def note(self) -> str:
        where = ", ".join(sorted(set(self.where.values()))) or "the derivation cache"
        lora = f" carrying peft's adapters ({self.adapters.key()})" if self.adapters is not None else ""
        return f"activations derived from a trace of a 1- and 2-block copy{lora} (memfit.derive), cached at {where}"

    def __repr__(self) -> str:
        return f"DerivedModel({self.label!r}, kinds={sorted(self._fits)})"

"""What the per-family builders share: a config reader that knows each family's defaults (those of its
transformers config class, so an omitted key means what it means to transformers) and node helpers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import ModelSourceError
from ..kinds.attention import Attention, LatentKV
from ..kinds.heads import ClassificationHead, LMHead
from ..kinds.linear import Linear
from ..kinds.mlp import MLP
from ..kinds.norm import Dropout, Norm
from ..model import Block, ModelGraph, Stack

_MISSING = object()


class Cfg:
    """Reads one HF config dict with the family's `defaults`; collects every bad or missing key so one
    ModelSourceError names them all (`check()`)."""

    def __init__(self, config: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any]) -> None:
        self.config, self.model_type, self.defaults = config, model_type, defaults
        self.problems: list[str] = []

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        """The config's value (an explicit null included), else the family default, else `default`."""
        if key in self.config:
            return self.config[key]
        if key in self.defaults:
            return self.defaults[key]
        return None if default is _MISSING else default

    def int(self, key: str, default: Any = _MISSING, *, zero_ok: bool = False) -> int:
        value = self.raw(key)
        if value is None and default is not _MISSING:
            value = default
        if value is None:
            self.problems.append(f"'{key}' is missing")
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
            self.problems.append(f"'{key}' must be a {'whole' if zero_ok else 'positive whole'} number, got {value!r}")
            return 0
        return value

    def first_int(self, *keys: str, default: Any = _MISSING) -> int:
        """The first of `keys` the config or defaults give (GPT-2's n_embd before hidden_size...)."""
        for key in keys:
            if self.raw(key) is not None:
                return self.int(key)
        return self.int(keys[0], default)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.raw(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problems.append(f"'{key}' must be true or false, got {value!r}")
            return default
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.raw(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problems.append(f"'{key}' must be a number, got {value!r}")
            return default
        return float(value)

    def text(self, key: str, default: str = "") -> str:
        value = self.raw(key, default)
        return value if isinstance(value, str) else default

    def rotary_fraction(self, default: float = 1.0) -> float:
        """partial_rotary_factor (transformers 5, maybe inside rope_parameters) or the older rotary_pct."""
        rope = self.config.get("rope_parameters")
        rope = rope if isinstance(rope, Mapping) else {}
        for value in (rope.get("partial_rotary_factor"), self.config.get("partial_rotary_factor"),
                      self.config.get("rotary_pct"), self.defaults.get("partial_rotary_factor")):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
                return float(value)
        return default

    def divides(self, small_key: str, small: int, big_key: str, big: int) -> None:
        if small and big and big % small:
            self.problems.append(f"'{small_key}' ({small}) must divide '{big_key}' ({big})")

    def check(self, source: str) -> None:
        if self.problems:
            raise ModelSourceError(f"{source}: {self.model_type} config: " + "; ".join(self.problems) + ".")


def dropouts(**where_p: float | None) -> tuple[Dropout, ...]:
    """Dropout nodes for the probabilities that are > 0 (where=p)."""
    return tuple(Dropout(float(p), where) for where, p in where_p.items() if p)


def attention(hidden: int, heads: int, kv_heads: int, head_dim: int, *, qkv_bias: bool = False,
              out_bias: bool = False, names: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
              fused: str | None = None, out_in: int | None = None, norms: tuple[Norm, ...] = (),
              name: str = "self_attn", **numbers: Any) -> Attention:
    """Separate q/k/v (or one `fused` qkv) and an output projection. `out_in`: the output projection's input
    size where it is not heads * head_dim (StableLM)."""
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    if fused:
        qkv = (Linear(fused, hidden, q_dim + 2 * kv_dim, qkv_bias),)
        out_name = names[-1]
    else:
        q, k, v, out_name = names
        qkv = (Linear(q, hidden, q_dim, qkv_bias), Linear(k, hidden, kv_dim, qkv_bias),
               Linear(v, hidden, kv_dim, qkv_bias))
    out = Linear(out_name, out_in or q_dim, hidden, out_bias)
    return Attention(heads, kv_heads, head_dim, hidden, qkv, out, norms=norms, name=name, **numbers)


def mla_attention(hidden: int, heads: int, latent: LatentKV, *, bias: bool, norm: str = "rms",
                  name: str = "self_attn", **numbers: Any) -> Attention:
    """DeepSeek-V2/V3 multi-head latent attention (modeling_deepseek_v2.DeepseekV2Attention)."""
    qk_head = latent.nope_head_dim + latent.rope_head_dim
    down: list[Linear] = []
    norms: list[Norm] = []
    if latent.q_lora_rank:
        down.append(Linear("q_a_proj", hidden, latent.q_lora_rank, bias))
        norms.append(Norm(norm, latent.q_lora_rank, name="q_a_layernorm"))
        qkv = [Linear("q_b_proj", latent.q_lora_rank, heads * qk_head)]
    else:
        qkv = [Linear("q_proj", hidden, heads * qk_head)]
    down.append(Linear("kv_a_proj_with_mqa", hidden, latent.kv_lora_rank + latent.rope_head_dim, bias))
    norms.append(Norm(norm, latent.kv_lora_rank, name="kv_a_layernorm"))
    qkv.append(Linear("kv_b_proj", latent.kv_lora_rank, heads * (latent.nope_head_dim + latent.v_head_dim)))
    out = Linear("o_proj", heads * latent.v_head_dim, hidden, bias)
    return Attention(heads, heads, qk_head, hidden, tuple(qkv), out, latent_kv=latent, down=tuple(down),
                     norms=tuple(norms), name=name, **numbers)


def gated_mlp(hidden: int, intermediate: int, act: str, *, bias: bool = False,
              names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"), fused: str | None = None,
              name: str = "mlp") -> MLP:
    """act(gate(x)) * up(x) -> down; `fused`: one gate_up projection (Phi-3, stacked experts)."""
    if fused:
        up: tuple[Linear, ...] = (Linear(fused, hidden, 2 * intermediate, bias),)
        down_name = names[-1]
    else:
        gate, up_name, down_name = names
        up = (Linear(gate, hidden, intermediate, bias), Linear(up_name, hidden, intermediate, bias))
    return MLP(hidden, intermediate, True, act, up, Linear(down_name, intermediate, hidden, bias), name=name)


def plain_mlp(hidden: int, intermediate: int, act: str, *, bias: bool = True,
              names: Sequence[str] = ("fc1", "fc2"), name: str = "mlp") -> MLP:
    """act(fc1(x)) -> fc2."""
    return MLP(hidden, intermediate, False, act, (Linear(names[0], hidden, intermediate, bias),),
               Linear(names[1], intermediate, hidden, bias), name=name)


def lm_head(hidden: int, vocab: int, tied: bool, *, bias: bool = False, name: str = "lm_head",
            softcap: float | None = None) -> LMHead:
    return LMHead(Linear(name, hidden, vocab, bias), tied=tied, softcap=softcap)


def stacks(name: str, blocks: Sequence[Block], seq_axis: str = "tokens") -> tuple[Stack, ...]:
    """One Stack per run of equal consecutive blocks of the ModuleList `name` (usually a single Stack)."""
    out: list[Stack] = []
    for index, block in enumerate(blocks):
        if out and out[-1].block == block:
            last = out[-1]
            out[-1] = Stack(last.name, last.count + 1, block, seq_axis, last.first)
        else:
            out.append(Stack(name, 1, block, seq_axis, index))
    return tuple(out)


def decoder_dims(c: Cfg) -> tuple[int, int, int, int, int, int, int]:
    """(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab) of a llama-style config; head_dim falls
    back to the family default (Gemma 256, Qwen3 128), then hidden / heads."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", heads or 1)
    c.divides("num_key_value_heads", kv_heads, "num_attention_heads", heads)
    fallback = c.defaults.get("head_dim") or (hidden // heads if heads else 0)
    if c.raw("head_dim") is None and not c.defaults.get("head_dim"):
        c.divides("num_attention_heads", heads, "hidden_size", hidden)  # head_dim = hidden / heads must be whole
    head_dim = c.int("head_dim", fallback)
    return hidden, layers, heads, kv_heads, head_dim, c.int("intermediate_size"), c.int("vocab_size")


def window(c: Cfg, *, gated_by: str | None = None) -> int | None:
    """The sliding window, where the family uses one (`gated_by`: the flag that turns it on, Qwen's
    use_sliding_window)."""
    if gated_by is not None and not c.flag(gated_by, False):
        return None
    value = c.raw("sliding_window")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


SEQUENCE_CLASSIFIERS = {"bert": "BertForSequenceClassification", "llama": "LlamaForSequenceClassification",
                        "mistral": "MistralForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
                        "qwen3": "Qwen3ForSequenceClassification"}
"""The transformers sequence classifiers a graph is built for (config `architectures`), by model_type."""


def num_labels(c: Cfg) -> int:
    """The config's num_labels, else the size of its id2label, else transformers' default 2."""
    labels = c.raw("num_labels")
    if isinstance(labels, int) and not isinstance(labels, bool) and labels >= 0:
        return labels
    id2label = c.raw("id2label")
    return len(id2label) if isinstance(id2label, (dict, list)) and id2label else 2


def sequence_labels(c: Cfg) -> int | None:
    """num_labels when the config's `architectures` names a ...ForSequenceClassification class (what a fine-tuned
    classifier's config.json says, and what memfit.sources.with_task writes), else None."""
    archs = c.config.get("architectures")
    if isinstance(archs, (list, tuple)) and any(str(a).endswith("ForSequenceClassification") for a in archs):
        return num_labels(c)
    return None


def score_head(c: Cfg, hidden: int, labels: int) -> ClassificationHead:
    """GenericForSequenceClassification (transformers modeling_layers): `score`, a Linear without bias over every
    token; the last non-pad token's logits are the sequence's."""
    return ClassificationHead(Linear("score", hidden, labels, False), pool="last")


# ---- the registry: each family module registers its builders (memfit.graph.builders reads it) ----------------

Builder = Callable[[Cfg, str], ModelGraph]
_BUILDERS: dict[str, tuple[Builder, dict[str, Any]]] = {}


def builder(*model_types: str, defaults: Mapping[str, Any] | None = None,
            per_type: Mapping[str, Mapping[str, Any]] | None = None) -> Callable[[Builder], Builder]:
    """Register fn(cfg, name) -> ModelGraph for `model_types`, reading configs with `defaults` (the transformers
    config class's defaults for the keys the builder reads), overridden per type by `per_type`."""

    def register(fn: Builder) -> Builder:
        for model_type in model_types:
            if model_type in _BUILDERS:
                raise TypeError(f"model_type '{model_type}' already has a graph builder")
            _BUILDERS[model_type] = (fn, {**(defaults or {}), **(per_type or {}).get(model_type, {})})
        return fn

    return register

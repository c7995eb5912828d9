"""Parameter layouts: every parameter tensor a Hugging Face model of a given `model_type` owns, from numbers alone.

One row per distinct tensor; a row inside the repeated block has `count=num_layers` and a '*' where the layer index
goes, so names read like the module's own ('model.layers.*.self_attn.q_proj.weight'). Tied weights appear once.
Each layout mirrors the transformers modeling file named next to it; tests rebuild the real module on the meta
device and compare every tensor, so a layout that drifts from transformers fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..model_spec import ParamTensor


@dataclass(frozen=True)
class Arch:
    """The numbers a layout needs, already validated and defaulted (see hf_config.parse_arch)."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    """Bias on q/k/v/o (llama, gemma, qwen3) or on query_key_value/dense (gpt_neox)."""
    mlp_bias: bool = False
    type_vocab_size: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


class _Rows:
    """Collects ParamTensor rows; `layer()` rows repeat num_layers times under a '*'-indexed prefix."""

    def __init__(self, arch: Arch, layer_prefix: str) -> None:
        self.arch = arch
        self.layer_prefix = layer_prefix
        self.rows: list[ParamTensor] = []

    def add(self, name: str, numel: int) -> None:
        self.rows.append(ParamTensor(name, numel, 1))

    def layer(self, name: str, numel: int) -> None:
        self.rows.append(ParamTensor(f"{self.layer_prefix}.*.{name}", numel, self.arch.num_layers))

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> None:
        """An nn.Linear (or GPT-2 Conv1D) inside the repeated block."""
        self.layer(f"{name}.weight", in_features * out_features)
        if bias:
            self.layer(f"{name}.bias", out_features)

    def norm(self, name: str, with_bias: bool, *, in_layer: bool = True) -> None:
        add = self.layer if in_layer else self.add
        add(f"{name}.weight", self.arch.hidden_size)
        if with_bias:
            add(f"{name}.bias", self.arch.hidden_size)

    def lm_head(self, name: str = "lm_head.weight") -> None:
        if not self.arch.tie_word_embeddings:
            self.add(name, self.arch.vocab_size * self.arch.hidden_size)


# Which bias flags each llama-like family honours (from each modeling_<type>.py in transformers 5.x):
# llama: attention_bias on q/k/v/o, mlp_bias on gate/up/down; qwen2: q/k/v bias always, o never;
# gemma, gemma2, qwen3: attention_bias on q/k/v/o; mistral: no biases at all.
_QKV_ALWAYS_BIASED = {"qwen2"}
_HONOURS_ATTENTION_BIAS = {"llama", "gemma", "gemma2", "qwen3"}
_HONOURS_MLP_BIAS = {"llama"}


def llama_layout(arch: Arch) -> tuple[ParamTensor, ...]:
    """LlamaForCausalLM and its relatives (mistral, qwen2, qwen3, gemma, gemma2): separate q/k/v/o and a SwiGLU
    (GeGLU for gemma) gate/up/down MLP, RMSNorm weights only."""
    rows = _Rows(arch, "model.layers")
    h, t = arch.hidden_size, arch.model_type
    qkv_bias = t in _QKV_ALWAYS_BIASED or (t in _HONOURS_ATTENTION_BIAS and arch.attention_bias)
    o_bias = t in _HONOURS_ATTENTION_BIAS and arch.attention_bias
    mlp_bias = t in _HONOURS_MLP_BIAS and arch.mlp_bias
    rows.add("model.embed_tokens.weight", arch.vocab_size * h)
    rows.linear("self_attn.q_proj", h, arch.q_dim, qkv_bias)
    rows.linear("self_attn.k_proj", h, arch.kv_dim, qkv_bias)
    rows.linear("self_attn.v_proj", h, arch.kv_dim, qkv_bias)
    rows.linear("self_attn.o_proj", arch.q_dim, h, o_bias)
    if t == "qwen3":  # per-head RMSNorm on queries and keys (modeling_qwen3.Qwen3Attention)
        rows.layer("self_attn.q_norm.weight", arch.head_dim)
        rows.layer("self_attn.k_norm.weight", arch.head_dim)
    rows.linear("mlp.gate_proj", h, arch.intermediate_size, mlp_bias)
    rows.linear("mlp.up_proj", h, arch.intermediate_size, mlp_bias)
    rows.linear("mlp.down_proj", arch.intermediate_size, h, mlp_bias)
    rows.norm("input_layernorm", False)
    rows.norm("post_attention_layernorm", False)
    if t == "gemma2":  # sandwich norms around the MLP (modeling_gemma2.Gemma2DecoderLayer)
        rows.norm("pre_feedforward_layernorm", False)
        rows.norm("post_feedforward_layernorm", False)
    rows.norm("model.norm", False, in_layer=False)
    rows.lm_head()
    return tuple(rows.rows)


def phi3_layout(arch: Arch) -> tuple[ParamTensor, ...]:
    """Phi3ForCausalLM: one fused qkv_proj and one fused gate_up_proj, no biases (modeling_phi3)."""
    rows = _Rows(arch, "model.layers")
    h = arch.hidden_size
    rows.add("model.embed_tokens.weight", arch.vocab_size * h)
    rows.linear("self_attn.qkv_proj", h, arch.q_dim + 2 * arch.kv_dim, False)
    rows.linear("self_attn.o_proj", arch.q_dim, h, False)
    rows.linear("mlp.gate_up_proj", h, 2 * arch.intermediate_size, False)
    rows.linear("mlp.down_proj", arch.intermediate_size, h, False)
    rows.norm("input_layernorm", False)
    rows.norm("post_attention_layernorm", False)
    rows.norm("model.norm", False, in_layer=False)
    rows.lm_head()
    return tuple(rows.rows)


def gpt2_layout(arch: Arch) -> tuple[ParamTensor, ...]:
    """GPT2LMHeadModel: learned positions, Conv1D projections with biases, LayerNorm with bias (modeling_gpt2)."""
    rows = _Rows(arch, "transformer.h")
    h = arch.hidden_size
    rows.add("transformer.wte.weight", arch.vocab_size * h)
    rows.add("transformer.wpe.weight", arch.max_positions * h)
    rows.norm("ln_1", True)
    rows.linear("attn.c_attn", h, 3 * h, True)
    rows.linear("attn.c_proj", h, h, True)
    rows.norm("ln_2", True)
    rows.linear("mlp.c_fc", h, arch.intermediate_size, True)
    rows.linear("mlp.c_proj", arch.intermediate_size, h, True)
    rows.norm("transformer.ln_f", True, in_layer=False)
    rows.lm_head()
    return tuple(rows.rows)


def gpt_neox_layout(arch: Arch) -> tuple[ParamTensor, ...]:
    """GPTNeoXForCausalLM (Pythia): fused query_key_value, biased MLP, LayerNorm with bias (modeling_gpt_neox)."""
    rows = _Rows(arch, "gpt_neox.layers")
    h = arch.hidden_size
    rows.add("gpt_neox.embed_in.weight", arch.vocab_size * h)
    rows.norm("input_layernorm", True)
    rows.norm("post_attention_layernorm", True)
    rows.linear("attention.query_key_value", h, 3 * h, arch.attention_bias)
    rows.linear("attention.dense", h, h, arch.attention_bias)
    rows.linear("mlp.dense_h_to_4h", h, arch.intermediate_size, True)
    rows.linear("mlp.dense_4h_to_h", arch.intermediate_size, h, True)
    rows.norm("gpt_neox.final_layer_norm", True, in_layer=False)
    rows.lm_head()
    return tuple(rows.rows)


def bert_mlm_layout(arch: Arch) -> tuple[ParamTensor, ...]:
    """BertForMaskedLM: embeddings (word, position, token type), post-LN encoder, MLM head transform and output
    bias; the decoder weight is tied to the word embeddings and there is no pooler (modeling_bert)."""
    rows = _Rows(arch, "bert.encoder.layer")
    h = arch.hidden_size
    rows.add("bert.embeddings.word_embeddings.weight", arch.vocab_size * h)
    rows.add("bert.embeddings.position_embeddings.weight", arch.max_positions * h)
    rows.add("bert.embeddings.token_type_embeddings.weight", arch.type_vocab_size * h)
    rows.norm("bert.embeddings.LayerNorm", True, in_layer=False)
    for name in ("query", "key", "value"):
        rows.linear(f"attention.self.{name}", h, h, True)
    rows.linear("attention.output.dense", h, h, True)
    rows.norm("attention.output.LayerNorm", True)
    rows.linear("intermediate.dense", h, arch.intermediate_size, True)
    rows.linear("output.dense", arch.intermediate_size, h, True)
    rows.norm("output.LayerNorm", True)
    rows.add("cls.predictions.bias", arch.vocab_size)
    rows.add("cls.predictions.transform.dense.weight", h * h)
    rows.add("cls.predictions.transform.dense.bias", h)
    rows.norm("cls.predictions.transform.LayerNorm", True, in_layer=False)
    if not arch.tie_word_embeddings:  # untied, the decoder keeps its own weight and bias
        rows.add("cls.predictions.decoder.weight", arch.vocab_size * h)
        rows.add("cls.predictions.decoder.bias", arch.vocab_size)
    return tuple(rows.rows)


LAYOUTS: dict[str, Callable[[Arch], tuple[ParamTensor, ...]]] = {
    "llama": llama_layout,
    "mistral": llama_layout,
    "qwen2": llama_layout,
    "qwen3": llama_layout,
    "gemma": llama_layout,
    "gemma2": llama_layout,
    "phi3": phi3_layout,
    "gpt2": gpt2_layout,
    "gpt_neox": gpt_neox_layout,
    "bert": bert_mlm_layout,
}
"""model_type -> layout. Adding a family means adding a function here and its defaults in hf_config."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(LAYOUTS)


def param_layout(arch: Arch) -> tuple[ParamTensor, ...]:
    return LAYOUTS[arch.model_type](arch)

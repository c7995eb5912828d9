"""Mixture-of-experts decoders: mixtral, qwen2_moe, olmoe, deepseek_v2 (transformers 5 keeps each expert
projection of a layer as one stacked 3-D parameter: mlp.experts.gate_up_proj, mlp.experts.down_proj)."""

from __future__ import annotations

from ..kinds.attention import LatentKV
from ..kinds.linear import Linear
from ..kinds.mlp import MLP, Experts
from ..kinds.norm import Norm
from ..model import ModelGraph
from .common import Cfg, attention, builder, decoder_dims, gated_mlp, mla_attention, window
from .decoders import llama_like

_MOE = dict(hidden_act="silu", tie_word_embeddings=False, attention_bias=False)


def router(hidden: int, experts: int) -> Linear:
    """The router's weight: transformers 5 keeps it in a <Family>TopKRouter, an nn.Module with its own Parameter,
    not an nn.Linear, so the bitsandbytes loader does not pack it."""
    return Linear("gate", hidden, experts, bnb_quantized=False)


def _experts(c: Cfg, hidden: int, inter: int, experts_key: str, *, shared: MLP | None = None,
             shared_gate: Linear | None = None, normalize: bool | None = None, scores_dtype: str = "cmp") -> Experts:
    """`normalize`: None reads norm_topk_prob; `scores_dtype`: 'cmp' where the router casts the top-k weights back
    to the logits' dtype (Qwen2-MoE, OLMoE), 'f32' where it keeps them fp32 (Mixtral)."""
    experts = c.int(experts_key)
    expert = gated_mlp(hidden, inter, c.text("hidden_act", "silu"), fused="gate_up_proj", names=("down_proj",),
                       name="")
    impl = c.raw("experts_implementation", None) or c.raw("_experts_implementation", None) or "grouped_mm"
    return Experts(experts, c.int("num_experts_per_tok"), expert, router(hidden, experts),
                   shared_experts=shared, shared_gate=shared_gate,
                   normalize_topk=c.flag("norm_topk_prob", False) if normalize is None else normalize,
                   scores_dtype=scores_dtype, implementation=str(impl), aux_loss=c.flag("output_router_logits"))


@builder("mixtral", defaults={**_MOE, "num_experts_per_tok": 2, "num_local_experts": 8})
def mixtral(c: Cfg, name: str) -> ModelGraph:
    hidden, _, heads, kv_heads, head_dim, inter, _ = decoder_dims(c)
    att = attention(hidden, heads, kv_heads, head_dim, rotary_fraction=c.rotary_fraction(), window=window(c))
    moe = _experts(c, hidden, inter, "num_local_experts", normalize=True, scores_dtype="f32")
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: moe)


@builder("olmoe", defaults={**_MOE, "num_experts_per_tok": 8, "num_experts": 64})
def olmoe(c: Cfg, name: str) -> ModelGraph:
    """OLMoE: q_norm over all query features (hidden_size), k_norm over all key features."""
    hidden, _, heads, kv_heads, head_dim, inter, _ = decoder_dims(c)
    bias = c.flag("attention_bias")
    norms = (Norm("rms", hidden, name="q_norm"), Norm("rms", (hidden // heads if heads else 0) * kv_heads,
                                                       name="k_norm"))
    att = attention(hidden, heads, kv_heads, head_dim, qkv_bias=bias, out_bias=bias, norms=norms,
                    rotary_fraction=c.rotary_fraction())
    moe = _experts(c, hidden, inter, "num_experts")
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: moe)


@builder("qwen2_moe", defaults={**_MOE, "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True,
                                "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                                "shared_expert_intermediate_size": 5632})
def qwen2_moe(c: Cfg, name: str) -> ModelGraph:
    """Qwen2-MoE: qwen2 attention (q/k/v bias per qkv_bias), MoE layers every decoder_sparse_step outside
    mlp_only_layers (dense MLPs of intermediate_size there), a sigmoid-gated shared expert."""
    hidden, _, heads, kv_heads, head_dim, inter, _ = decoder_dims(c)
    act = c.text("hidden_act", "silu")
    att = attention(hidden, heads, kv_heads, head_dim, qkv_bias=c.flag("qkv_bias", True),
                    rotary_fraction=c.rotary_fraction(), window=window(c, gated_by="use_sliding_window"))
    shared = gated_mlp(hidden, c.int("shared_expert_intermediate_size"), act, name="shared_expert")
    moe = _experts(c, hidden, c.int("moe_intermediate_size"), "num_experts", shared=shared,
                   shared_gate=Linear("shared_expert_gate", hidden, 1))
    dense = gated_mlp(hidden, inter, act)
    only = c.raw("mlp_only_layers") or ()
    step = c.int("decoder_sparse_step")
    experts = c.int("num_experts", zero_ok=True)

    def mlp(i: int) -> object:
        sparse = i not in only and experts > 0 and step > 0 and (i + 1) % step == 0
        return moe if sparse else dense

    return llama_like(c, name, attn=lambda i: att, mlp=mlp)


@builder("deepseek_v2", defaults={**_MOE, "mlp_bias": False, "first_k_dense_replace": 0, "kv_lora_rank": 512,
                                  "q_lora_rank": 1536, "n_routed_experts": 64, "n_shared_experts": 2,
                                  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                  "moe_intermediate_size": 1407})
def deepseek_v2(c: Cfg, name: str) -> ModelGraph:
    """DeepSeek-V2: multi-head latent attention; dense MLPs in the first first_k_dense_replace layers, then
    routed experts plus n_shared_experts merged into one shared MLP (modeling_deepseek_v2)."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    inter, act, bias = c.int("intermediate_size"), c.text("hidden_act", "silu"), c.flag("mlp_bias")
    q_rank = c.raw("q_lora_rank")
    latent = LatentKV(c.int("kv_lora_rank"), q_rank if isinstance(q_rank, int) and q_rank > 0 else 0,
                      c.int("qk_rope_head_dim"), c.int("qk_nope_head_dim"), c.int("v_head_dim"))
    att = mla_attention(hidden, heads, latent, bias=c.flag("attention_bias"), rotary_fraction=1.0)
    moe_inter = c.int("moe_intermediate_size")
    expert = gated_mlp(hidden, moe_inter, act, fused="gate_up_proj", names=("down_proj",), name="")
    routed = c.int("n_routed_experts")
    shared = gated_mlp(hidden, moe_inter * c.int("n_shared_experts"), act, bias=bias, name="shared_experts")
    moe = Experts(routed, c.int("num_experts_per_tok", 1), expert, router(hidden, routed),
                  shared_experts=shared)
    dense = gated_mlp(hidden, inter, act, bias=bias)
    first_dense = c.int("first_k_dense_replace", zero_ok=True)
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: dense if i < first_dense else moe)

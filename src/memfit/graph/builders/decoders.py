"""Decoder-only families laid out like Llama (model.embed_tokens, model.layers.*, model.norm, lm_head): llama,
mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3, stablelm, phi. Each mirrors its modeling_<type>.py in
transformers 5."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..kinds.attention import Attention
from ..kinds.embedding import Embedding
from ..kinds.norm import Norm
from ..model import Block, ModelGraph
from .common import (Cfg, attention, builder, decoder_dims, dropouts, gated_mlp, lm_head, plain_mlp, score_head,
                     sequence_labels, stacks, window)


def llama_like(c: Cfg, name: str, *, attn: Callable[[int], Attention], mlp: Callable[[int], Any],
               norm: str = "rms", norm_bias: bool = False, sandwich: bool = False, parallel: bool = False,
               final_norm: str = "model.norm", head_bias: bool = False, softcap: float | None = None,
               embed_dropout: float | None = None, resid_dropout: float | None = None,
               norm_fp32: bool = False) -> ModelGraph:
    """Embedding, num_hidden_layers pre-norm blocks, final norm, LM head (tied per tie_word_embeddings).
    `attn(i)` / `mlp(i)`: layer i's attention and MLP (or Experts); equal consecutive layers share a Stack.
    `norm_fp32`: the norms keep their normalised value in fp32 (Gemma's RMSNorm)."""
    hidden, layers, *_, vocab = decoder_dims(c)

    def n(label: str) -> Norm:
        return Norm(norm, hidden, norm_bias, name=label, fp32_output=norm_fp32)

    drops = dropouts(attention=c.number("attention_dropout", 0.0), residual=resid_dropout)

    def block(i: int) -> Block:
        if parallel:  # one norm feeds attention and MLP (Phi-1/2, StableLM's use_parallel_residual)
            nodes = (n("input_layernorm"), attn(i), mlp(i), *drops)
        elif sandwich:
            nodes = (n("input_layernorm"), attn(i), n("post_attention_layernorm"), n("pre_feedforward_layernorm"),
                     mlp(i), n("post_feedforward_layernorm"), *drops)
        else:
            nodes = (n("input_layernorm"), attn(i), n("post_attention_layernorm"), mlp(i), *drops)
        return Block(nodes, parallel_residual=parallel, sandwich_norms=sandwich)

    layer_stacks = stacks("model.layers", [block(i) for i in range(layers)])
    if embed_dropout:
        layer_stacks = (replace(layer_stacks[0], before=dropouts(embedding=embed_dropout)), *layer_stacks[1:])
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, hidden, name="model.embed_tokens"),
        stacks=layer_stacks,
        final_norm=n(final_norm),
        head=(score_head(c, hidden, labels) if (labels := sequence_labels(c)) is not None
              else lm_head(hidden, vocab, c.flag("tie_word_embeddings"), bias=head_bias, softcap=softcap)),
    )


def _act(c: Cfg) -> str:
    return c.text("hidden_activation") or c.text("hidden_act", "silu")


def _standard(c: Cfg, name: str, *, qkv_bias: bool, out_bias: bool, mlp_bias: bool = False,
              qk_norm: bool = False, sliding: int | None = None, **layout: Any) -> ModelGraph:
    hidden, _, heads, kv_heads, head_dim, inter, _ = decoder_dims(c)
    norms = (Norm("rms", head_dim, name="q_norm"), Norm("rms", head_dim, name="k_norm")) if qk_norm else ()
    att = attention(hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, out_bias=out_bias, norms=norms,
                    rotary_fraction=c.rotary_fraction(), window=sliding, softcap=c.number("attn_logit_softcapping"))
    ffn = gated_mlp(hidden, inter, _act(c), bias=mlp_bias)
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: ffn, **layout)


_LLAMA = dict(hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
              max_position_embeddings=2048)
_GEMMA = dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, attention_bias=False, head_dim=256,
              max_position_embeddings=8192)


@builder("llama", defaults=_LLAMA)
def llama(c: Cfg, name: str) -> ModelGraph:
    bias = c.flag("attention_bias")
    return _standard(c, name, qkv_bias=bias, out_bias=bias, mlp_bias=c.flag("mlp_bias"))


@builder("mistral", defaults={**_LLAMA, "sliding_window": 4096, "max_position_embeddings": 131072})
def mistral(c: Cfg, name: str) -> ModelGraph:
    return _standard(c, name, qkv_bias=False, out_bias=False, sliding=window(c))


@builder("qwen2", defaults={**_LLAMA, "max_position_embeddings": 32768})
def qwen2(c: Cfg, name: str) -> ModelGraph:
    return _standard(c, name, qkv_bias=True, out_bias=False, sliding=window(c, gated_by="use_sliding_window"))


@builder("qwen3", defaults={**_LLAMA, "head_dim": 128, "max_position_embeddings": 32768})
def qwen3(c: Cfg, name: str) -> ModelGraph:
    bias = c.flag("attention_bias")
    return _standard(c, name, qkv_bias=bias, out_bias=bias, qk_norm=True,
                     sliding=window(c, gated_by="use_sliding_window"))


@builder("gemma", defaults=_GEMMA)
def gemma(c: Cfg, name: str) -> ModelGraph:
    bias = c.flag("attention_bias")
    return _standard(c, name, qkv_bias=bias, out_bias=bias, norm_fp32=True)


@builder("gemma2", defaults={**_GEMMA, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                             "final_logit_softcapping": 30.0})
def gemma2(c: Cfg, name: str) -> ModelGraph:
    bias = c.flag("attention_bias")
    return _standard(c, name, qkv_bias=bias, out_bias=bias, sliding=window(c), sandwich=True,
                     softcap=c.number("final_logit_softcapping"), norm_fp32=True)


@builder("gemma3_text", defaults={**_GEMMA, "sliding_window": 4096})
def gemma3_text(c: Cfg, name: str) -> ModelGraph:
    bias = c.flag("attention_bias")
    return _standard(c, name, qkv_bias=bias, out_bias=bias, qk_norm=True, sliding=window(c), sandwich=True,
                     softcap=c.number("final_logit_softcapping"), norm_fp32=True)


@builder("phi3", defaults={"hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 4096})
def phi3(c: Cfg, name: str) -> ModelGraph:
    """Fused qkv_proj and gate_up_proj, no biases (modeling_phi3)."""
    hidden, _, heads, kv_heads, head_dim, inter, _ = decoder_dims(c)
    att = attention(hidden, heads, kv_heads, head_dim, fused="qkv_proj", rotary_fraction=c.rotary_fraction(),
                    window=window(c), contiguous_out=True)
    ffn = gated_mlp(hidden, inter, _act(c), fused="gate_up_proj", names=("down_proj",))
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: ffn,
                      embed_dropout=c.number("embd_pdrop"), resid_dropout=c.number("resid_pdrop"))


@builder("stablelm", defaults={"hidden_act": "silu", "tie_word_embeddings": False, "partial_rotary_factor": 0.25})
def stablelm(c: Cfg, name: str) -> ModelGraph:
    """LayerNorms with bias, optional q/k/v bias, optional per-head q/k LayerNorms (one module per head), o_proj
    from hidden_size; use_parallel_residual drops post_attention_layernorm (modeling_stablelm)."""
    hidden, _, heads, kv_heads, _, inter, _ = decoder_dims(c)
    head_dim = hidden // heads if heads else 0  # StableLmAttention ignores head_dim
    norms = ()
    if c.flag("qk_layernorm"):
        norms = (Norm("layer", head_dim, name="q_layernorm", copies=heads),
                 Norm("layer", head_dim, name="k_layernorm", copies=kv_heads))
    att = attention(hidden, heads, kv_heads, head_dim, qkv_bias=c.flag("use_qkv_bias"), out_in=hidden,
                    norms=norms, rotary_fraction=c.rotary_fraction(0.25))
    ffn = gated_mlp(hidden, inter, _act(c))
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: ffn, norm="layer", norm_bias=True,
                      parallel=c.flag("use_parallel_residual"), resid_dropout=c.number("hidden_dropout"))


@builder("phi", defaults={"hidden_act": "gelu_new", "tie_word_embeddings": False, "partial_rotary_factor": 0.5})
def phi(c: Cfg, name: str) -> ModelGraph:
    """Phi-1/1.5/2: biased q/k/v/dense and fc1/fc2, one LayerNorm feeding attention and MLP in parallel, a
    biased lm_head (modeling_phi)."""
    hidden, _, heads, kv_heads, _, inter, _ = decoder_dims(c)
    head_dim = c.int("head_dim", hidden // heads if heads else 0)
    norms = ()
    if c.flag("qk_layernorm"):
        norms = (Norm("layer", hidden // heads, True, name="q_layernorm"),
                 Norm("layer", hidden // heads, True, name="k_layernorm"))
    att = attention(hidden, heads, kv_heads, head_dim, qkv_bias=True, out_bias=True,
                    names=("q_proj", "k_proj", "v_proj", "dense"), norms=norms, rotary_fraction=c.rotary_fraction(0.5))
    ffn = plain_mlp(hidden, inter, c.text("hidden_act", "gelu_new"))
    return llama_like(c, name, attn=lambda i: att, mlp=lambda i: ffn, norm="layer", norm_bias=True, parallel=True,
                      final_norm="model.final_layernorm", head_bias=True, embed_dropout=c.number("embd_pdrop"),
                      resid_dropout=c.number("resid_pdrop"))

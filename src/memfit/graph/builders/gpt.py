"""GPT-style decoders with their own module names: gpt2, gptj, gpt_neox, opt, falcon (modeling_<type>.py in
transformers 5)."""

from __future__ import annotations

from dataclasses import replace

from ..kinds.embedding import Embedding
from ..kinds.linear import Linear
from ..kinds.norm import Norm
from ..model import Block, ModelGraph, Stack
from ..transforms import rewrite
from .common import Cfg, attention, builder, dropouts, lm_head, plain_mlp


def _subclassed_linears(node):
    """`node` with every Linear in it marked as an nn.Linear subclass (not packed by bitsandbytes' loader)."""
    return rewrite(node, lambda n, path, parents: replace(n, bnb_quantized=False) if isinstance(n, Linear) else n)


def _layer_norm(dim: int, name: str, *, affine: bool = True) -> Norm:
    return Norm("layer", dim, bias=affine, name=name, affine=affine)


@builder("gpt2", defaults=dict(activation_function="gelu_new", tie_word_embeddings=True, n_positions=1024,
                               attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1))
def gpt2(c: Cfg, name: str) -> ModelGraph:
    """GPT2LMHeadModel: learned positions, Conv1D c_attn / c_proj / c_fc with biases, LayerNorms with bias."""
    hidden, layers = c.first_int("n_embd", "hidden_size"), c.first_int("n_layer", "num_hidden_layers")
    heads, vocab = c.first_int("n_head", "num_attention_heads"), c.int("vocab_size")
    positions = c.first_int("n_positions", "max_position_embeddings")
    c.divides("n_head", heads, "n_embd", hidden)
    if c.flag("add_cross_attention"):
        c.problems.append("'add_cross_attention' (GPT-2 with cross-attention) has no graph builder yet")
    att = attention(hidden, heads, heads, hidden // heads if heads else 0, qkv_bias=True, out_bias=True,
                    fused="c_attn", names=("c_proj",), name="attn", rotary_fraction=0.0, position="learned",
                    softmax_fp32=False)
    mlp = plain_mlp(hidden, c.int("n_inner", 4 * hidden), c.text("activation_function", "gelu_new"),
                    names=("c_fc", "c_proj"))
    att = replace(att, qkv=tuple(replace(n, conv1d=True) for n in att.qkv), out=replace(att.out, conv1d=True))
    mlp = replace(mlp, up=tuple(replace(n, conv1d=True) for n in mlp.up), down=replace(mlp.down, conv1d=True))
    block = Block((_layer_norm(hidden, "ln_1"), att, _layer_norm(hidden, "ln_2"), mlp,
                   *dropouts(attention=c.number("attn_pdrop"), residual=c.number("resid_pdrop"))))
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, hidden, name="transformer.wte"),
        extra_params=(Embedding(positions, hidden, name="transformer.wpe", lookup="positions"),),
        stacks=(Stack("transformer.h", layers, block, before=dropouts(embedding=c.number("embd_pdrop"))),),
        final_norm=_layer_norm(hidden, "transformer.ln_f"),
        head=lm_head(hidden, vocab, c.flag("tie_word_embeddings", True)),
    )


@builder("gptj", defaults=dict(activation_function="gelu_new", tie_word_embeddings=False, rotary_dim=64))
def gptj(c: Cfg, name: str) -> ModelGraph:
    """GPTJForCausalLM: bias-free q/k/v/out_proj, biased fc_in / fc_out, one ln_1 feeding attention and MLP in
    parallel, partial rotary (rotary_dim), a biased lm_head."""
    hidden, layers = c.first_int("n_embd", "hidden_size"), c.first_int("n_layer", "num_hidden_layers")
    heads, vocab = c.first_int("n_head", "num_attention_heads"), c.int("vocab_size")
    c.divides("n_head", heads, "n_embd", hidden)
    head_dim = hidden // heads if heads else 0
    rotary = c.raw("rotary_dim")
    fraction = min(rotary / head_dim, 1.0) if isinstance(rotary, int) and rotary > 0 and head_dim else 1.0
    att = attention(hidden, heads, heads, head_dim, names=("q_proj", "k_proj", "v_proj", "out_proj"), name="attn",
                    rotary_fraction=fraction)
    mlp = plain_mlp(hidden, c.int("n_inner", 4 * hidden), c.text("activation_function", "gelu_new"),
                    names=("fc_in", "fc_out"))
    drops = dropouts(attention=c.number("attn_pdrop"), residual=c.number("resid_pdrop"))
    block = Block((_layer_norm(hidden, "ln_1"), att, mlp, *drops), parallel_residual=True)
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, hidden, name="transformer.wte"),
        stacks=(Stack("transformer.h", layers, block, before=dropouts(embedding=c.number("embd_pdrop"))),),
        final_norm=_layer_norm(hidden, "transformer.ln_f"),
        head=lm_head(hidden, vocab, c.flag("tie_word_embeddings"), bias=True),
    )


@builder("gpt_neox", defaults=dict(hidden_act="gelu", tie_word_embeddings=False, attention_bias=True,
                                   max_position_embeddings=2048,
                                   use_parallel_residual=True, partial_rotary_factor=0.25))
def gpt_neox(c: Cfg, name: str) -> ModelGraph:
    """GPTNeoXForCausalLM (Pythia): fused query_key_value, biased MLP, two LayerNorms per layer (both kept with
    the parallel residual), partial rotary."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    vocab, inter = c.int("vocab_size"), c.int("intermediate_size")
    c.divides("num_attention_heads", heads, "hidden_size", hidden)
    bias = c.flag("attention_bias", True)
    att = attention(hidden, heads, heads, hidden // heads if heads else 0, qkv_bias=bias, out_bias=bias,
                    fused="query_key_value", names=("dense",), name="attention",
                    rotary_fraction=c.rotary_fraction(0.25), contiguous_out=True)
    mlp = plain_mlp(hidden, inter, c.text("hidden_act", "gelu"), names=("dense_h_to_4h", "dense_4h_to_h"))
    parallel = c.flag("use_parallel_residual", True)
    drops = dropouts(attention=c.number("attention_dropout"), residual=c.number("hidden_dropout"))
    block = Block((_layer_norm(hidden, "input_layernorm"), att, _layer_norm(hidden, "post_attention_layernorm"),
                   mlp, *drops), parallel_residual=parallel)
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, hidden, name="gpt_neox.embed_in"),
        stacks=(Stack("gpt_neox.layers", layers, block),),
        final_norm=_layer_norm(hidden, "gpt_neox.final_layer_norm"),
        head=lm_head(hidden, vocab, c.flag("tie_word_embeddings")),
    )


@builder("opt", defaults=dict(activation_function="relu", tie_word_embeddings=True, max_position_embeddings=2048,
                              do_layer_norm_before=True, enable_bias=True, layer_norm_elementwise_affine=True,
                              dropout=0.1, attention_dropout=0.0))
def opt(c: Cfg, name: str) -> ModelGraph:
    """OPTForCausalLM: learned positions (offset 2), optional project_in / project_out around the layers when
    word_embed_proj_dim differs from hidden_size, pre- or post-norm (do_layer_norm_before)."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    vocab, ffn, positions = c.int("vocab_size"), c.int("ffn_dim"), c.int("max_position_embeddings")
    proj = c.int("word_embed_proj_dim", hidden)
    c.divides("num_attention_heads", heads, "hidden_size", hidden)
    bias, affine, pre = c.flag("enable_bias", True), c.flag("layer_norm_elementwise_affine", True), \
        c.flag("do_layer_norm_before", True)
    att = attention(hidden, heads, heads, hidden // heads if heads else 0, qkv_bias=bias, out_bias=bias,
                    names=("q_proj", "k_proj", "v_proj", "out_proj"), rotary_fraction=0.0, position="learned")
    mlp = plain_mlp(hidden, ffn, c.text("activation_function", "relu"), bias=bias, name="")
    attn_norm = _layer_norm(hidden, "self_attn_layer_norm", affine=affine)
    mlp_norm = _layer_norm(hidden, "final_layer_norm", affine=affine)
    drops = dropouts(attention=c.number("attention_dropout"), residual=c.number("dropout"))
    nodes = (attn_norm, att, mlp_norm, mlp) if pre else (att, attn_norm, mlp, mlp_norm)
    before = (Linear("model.decoder.project_in", proj, hidden),) if proj != hidden else ()
    after = ()
    if pre and not c.flag("_remove_final_layer_norm"):
        after += (_layer_norm(hidden, "model.decoder.final_layer_norm", affine=affine),)
    if proj != hidden:
        after += (Linear("model.decoder.project_out", hidden, proj),)
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, proj, name="model.decoder.embed_tokens"),
        extra_params=(Embedding(positions + 2, hidden, name="model.decoder.embed_positions", lookup="positions"),),
        stacks=(Stack("model.decoder.layers", layers, Block((*nodes, *drops)), before=before, after=after),),
        head=lm_head(proj, vocab, c.flag("tie_word_embeddings", True)),
    )


@builder("falcon", defaults=dict(activation="gelu", tie_word_embeddings=True, new_decoder_architecture=False,
                                 multi_query=True, parallel_attn=True, bias=False, alibi=False))
def falcon(c: Cfg, name: str) -> ModelGraph:
    """FalconForCausalLM: one fused query_key_value whose key/value heads are 1 (multi_query), num_kv_heads
    (new_decoder_architecture) or all heads; parallel attention with one or two LayerNorms (ln_attn, ln_mlp),
    or sequential with two; ALiBi or rotary positions."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    vocab = c.int("vocab_size")
    c.divides("num_attention_heads", heads, "hidden_size", hidden)
    new_arch, bias, parallel = c.flag("new_decoder_architecture"), c.flag("bias"), c.flag("parallel_attn", True)
    if new_arch:
        kv_heads = c.int("num_kv_heads", heads or 1)
    elif c.flag("multi_query", True):
        kv_heads = 1
    else:
        kv_heads = heads
    alibi = c.flag("alibi")
    att = attention(hidden, heads, kv_heads, hidden // heads if heads else 0, qkv_bias=bias, out_bias=bias,
                    fused="query_key_value", names=("dense",), name="self_attention",
                    rotary_fraction=0.0 if alibi else 1.0, position="alibi" if alibi else "rope")
    mlp = plain_mlp(hidden, c.int("ffn_hidden_size", 4 * hidden), c.text("activation", "gelu"), bias=bias,
                    names=("dense_h_to_4h", "dense_4h_to_h"))
    n_ln = c.raw("num_ln_in_parallel_attn")
    if n_ln is None and new_arch:
        n_ln = 2
    drops = dropouts(attention=c.number("attention_dropout"), residual=c.number("hidden_dropout"))
    if not parallel:
        nodes = (_layer_norm(hidden, "input_layernorm"), att, _layer_norm(hidden, "post_attention_layernorm"), mlp)
    elif n_ln == 2:
        nodes = (_layer_norm(hidden, "ln_attn"), _layer_norm(hidden, "ln_mlp"), att, mlp)
    else:
        nodes = (_layer_norm(hidden, "input_layernorm"), att, mlp)
    # every projection of a block is a FalconLinear (modeling_falcon.py), an nn.Linear subclass that transformers'
    # bitsandbytes loader leaves 16-bit
    nodes = tuple(_subclassed_linears(n) for n in nodes)
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, hidden, name="transformer.word_embeddings"),
        stacks=(Stack("transformer.h", layers, Block((*nodes, *drops), parallel_residual=parallel)),),
        final_norm=_layer_norm(hidden, "transformer.ln_f"),
        head=lm_head(hidden, vocab, c.flag("tie_word_embeddings", True)),
    )

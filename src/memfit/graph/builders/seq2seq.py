"""Encoder-decoder families: t5 (T5ForConditionalGeneration) and bart (BartForConditionalGeneration), as in
transformers 5: an encoder Stack over the source, a decoder Stack over the target with cross-attention."""

from __future__ import annotations

from dataclasses import replace

from ..kinds.embedding import Embedding
from ..kinds.heads import Seq2SeqLMHead
from ..kinds.linear import Linear
from ..kinds.norm import Norm
from ..model import Block, ModelGraph, Stack
from .common import Cfg, attention, builder, dropouts, gated_mlp, plain_mlp


@builder("t5", defaults=dict(d_kv=64, d_ff=2048, num_heads=8, relative_attention_num_buckets=32,
                             dropout_rate=0.1, feed_forward_proj="relu"))
def t5(c: Cfg, name: str) -> ModelGraph:
    """Pre-norm T5 blocks (RMS 'T5LayerNorm'), bias-free q/k/v/o of num_heads x d_kv, relative-position buckets in
    block 0 of each stack only, DenseReluDense (wi, wo) or gated (wi_0, wi_1, wo). transformers 5 always ties
    lm_head to `shared` (T5Config forces tie_word_embeddings=True)."""
    d, heads, d_kv, d_ff = c.int("d_model"), c.int("num_heads"), c.int("d_kv"), c.int("d_ff")
    enc_layers, vocab = c.int("num_layers"), c.int("vocab_size")
    dec_layers = c.int("num_decoder_layers", enc_layers or None)
    buckets = c.int("relative_attention_num_buckets")
    proj = c.text("feed_forward_proj", "relu")
    gated, act = proj.startswith("gated-"), proj.split("-")[-1]
    if proj == "gated-gelu":
        act = "gelu_new"

    def ff(label: str) -> object:
        # T5PreTrainedModel._keep_in_fp32_modules = ["wo"]: transformers' bitsandbytes quantizer passes it to
        # modules_to_not_convert (quantizer_bnb_4bit.py / _8bit.py _process_model_before_weight_loading), so a 4-bit
        # or 8-bit T5 keeps every wo unpacked, in the load dtype (fp32 only under fp16)
        mlp = (gated_mlp(d, d_ff, act, names=("wi_0", "wi_1", "wo"), name=label) if gated else
               plain_mlp(d, d_ff, act, bias=False, names=("wi", "wo"), name=label))
        return replace(mlp, down=replace(mlp.down, bnb_quantized=False))

    drops = dropouts(residual=c.number("dropout_rate"))

    def attn(label: str, kind: str) -> object:
        return attention(d, heads, heads, d_kv, names=("q", "k", "v", "o"), name=label, kind=kind,
                         rotary_fraction=0.0, position="relative")

    def norm(label: str) -> Norm:
        return Norm("rms", d, name=label)

    encoder = Block((norm("layer.0.layer_norm"), attn("layer.0.SelfAttention", "bidirectional"),
                     norm("layer.1.layer_norm"), ff("layer.1.DenseReluDense"), *drops))
    decoder = Block((norm("layer.0.layer_norm"), attn("layer.0.SelfAttention", "causal"),
                     norm("layer.1.layer_norm"), attn("layer.1.EncDecAttention", "cross"),
                     norm("layer.2.layer_norm"), ff("layer.2.DenseReluDense"), *drops))
    embed_drop = dropouts(embedding=c.number("dropout_rate"))
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, d, name="shared"),
        extra_params=tuple(Embedding(buckets, heads, name=f"{s}.block.0.layer.0.SelfAttention.relative_attention_bias")
                           for s in ("encoder", "decoder")),
        stacks=(Stack("encoder.block", enc_layers, encoder, "source", before=embed_drop,
                      after=(norm("encoder.final_layer_norm"),)),
                Stack("decoder.block", dec_layers, decoder, "target", before=embed_drop)),
        final_norm=norm("decoder.final_layer_norm"),
        head=Seq2SeqLMHead(Linear("lm_head", d, vocab), tied=True),
    )


@builder("bart", defaults=dict(activation_function="gelu", tie_word_embeddings=True, max_position_embeddings=1024,
                               dropout=0.1, attention_dropout=0.0, activation_dropout=0.0))
def bart(c: Cfg, name: str) -> ModelGraph:
    """Post-norm BART layers with biased q/k/v/out_proj and fc1/fc2, learned positions (offset 2) and a
    layernorm_embedding per stack. Untied (tie_word_embeddings false), transformers 5 also unties each stack's
    embed_tokens from `shared`."""
    d, vocab, positions = c.int("d_model"), c.int("vocab_size"), c.int("max_position_embeddings")
    act = c.text("activation_function", "gelu")
    tied = c.flag("tie_word_embeddings", True)
    drops = dropouts(attention=c.number("attention_dropout"), mlp=c.number("activation_dropout"),
                     residual=c.number("dropout"))

    def ln(label: str) -> Norm:
        return Norm("layer", d, True, name=label)

    def attn(heads: int, label: str, kind: str) -> object:
        c.divides(f"{label} heads", heads, "d_model", d)
        return attention(d, heads, heads, d // heads if heads else 0, qkv_bias=True, out_bias=True,
                         names=("q_proj", "k_proj", "v_proj", "out_proj"), name=label, kind=kind,
                         rotary_fraction=0.0, position="learned")

    def stack(side: str, axis: str) -> Stack:
        layers, heads = c.int(f"{side}_layers"), c.int(f"{side}_attention_heads")
        ffn = plain_mlp(d, c.int(f"{side}_ffn_dim"), act, name="")
        nodes = [attn(heads, "self_attn", "bidirectional" if side == "encoder" else "causal"),
                 ln("self_attn_layer_norm")]
        if side == "decoder":
            nodes += [attn(heads, "encoder_attn", "cross"), ln("encoder_attn_layer_norm")]
        nodes += [ffn, ln("final_layer_norm"), *drops]
        prefix = f"model.{side}"
        own_embed = () if tied else (Embedding(vocab, d, name=f"{prefix}.embed_tokens"),)
        before = (*own_embed, Embedding(positions + 2, d, name=f"{prefix}.embed_positions"),
                  ln(f"{prefix}.layernorm_embedding"), *dropouts(embedding=c.number("dropout")))
        return Stack(f"{prefix}.layers", layers, Block(tuple(nodes)), axis, before=before)

    return ModelGraph(
        name=name,
        embed=Embedding(vocab, d, name="model.shared"),
        stacks=(stack("encoder", "source"), stack("decoder", "target")),
        head=Seq2SeqLMHead(Linear("lm_head", d, vocab), tied=tied),
    )

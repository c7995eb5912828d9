"""Encoder-only families: bert (BertForMaskedLM, or BertForSequenceClassification) and vit
(ViTForImageClassification), as in transformers 5."""

from __future__ import annotations

from collections.abc import Sequence

from ..kinds.embedding import Embedding, Param, PatchEmbedding
from ..kinds.heads import ClassificationHead, MaskedLMHead
from ..kinds.linear import Linear
from ..kinds.mlp import MLP
from ..kinds.norm import Norm
from ..model import Block, ModelGraph, Stack
from .common import Cfg, attention, builder, dropouts, num_labels, plain_mlp, sequence_labels


def _ln(dim: int, name: str) -> Norm:
    return Norm("layer", dim, True, name=name)


@builder("bert", defaults=dict(hidden_act="gelu", tie_word_embeddings=True, max_position_embeddings=512,
                               type_vocab_size=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
def bert(c: Cfg, name: str) -> ModelGraph:
    """BertForMaskedLM: word + position + token-type embeddings and a LayerNorm, post-norm encoder layers, the MLM
    head (transform, LayerNorm, decoder tied to the word embeddings, its bias in cls.predictions.bias); no
    pooler. BertForSequenceClassification when the config's architectures name it: the pooler and a classifier
    over num_labels instead of the MLM head."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    vocab, inter, act = c.int("vocab_size"), c.int("intermediate_size"), c.text("hidden_act", "gelu")
    c.divides("num_attention_heads", heads, "hidden_size", hidden)
    att = attention(hidden, heads, heads, hidden // heads if heads else 0, qkv_bias=True, out_bias=True,
                    names=("self.query", "self.key", "self.value", "output.dense"), name="attention",
                    kind="bidirectional", rotary_fraction=0.0, position="learned", softmax_fp32=False)
    mlp = MLP(hidden, inter, False, act, (Linear("intermediate.dense", hidden, inter, True),),
              Linear("output.dense", inter, hidden, True), name="")
    drops = dropouts(attention=c.number("attention_probs_dropout_prob"), residual=c.number("hidden_dropout_prob"))
    block = Block((att, _ln(hidden, "attention.output.LayerNorm"), mlp, _ln(hidden, "output.LayerNorm"), *drops))
    labels = sequence_labels(c)
    if labels is not None:  # BertForSequenceClassification: BertPooler (dense + tanh), dropout, classifier
        drop = c.number("classifier_dropout")
        head = ClassificationHead(Linear("classifier", hidden, labels, True),
                                  Linear("bert.pooler.dense", hidden, hidden, True), pool="first",
                                  dropout=drop if drop is not None else (c.number("hidden_dropout_prob") or 0.0))
    else:
        head = MaskedLMHead(Linear("transform.dense", hidden, hidden, True), _ln(hidden, "transform.LayerNorm"),
                            Linear("decoder", hidden, vocab, True), Param("bias", (vocab,)),
                            tied=c.flag("tie_word_embeddings", True), act=act)
    return ModelGraph(
        name=name,
        embed=Embedding(vocab, hidden, name="bert.embeddings.word_embeddings"),
        extra_params=(Embedding(c.int("max_position_embeddings"), hidden, name="bert.embeddings.position_embeddings",
                                lookup="positions"),
                      Embedding(c.int("type_vocab_size"), hidden, name="bert.embeddings.token_type_embeddings")),
        stacks=(Stack("bert.encoder.layer", layers, block, before=(
            _ln(hidden, "bert.embeddings.LayerNorm"), *dropouts(embedding=c.number("hidden_dropout_prob")))),),
        head=head,
    )


def _pair(value: object) -> tuple[int, int] | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    return None


@builder("vit", defaults=dict(hidden_act="gelu", image_size=224, patch_size=16, num_channels=3, qkv_bias=True))
def vit(c: Cfg, name: str) -> ModelGraph:
    """ViTForImageClassification: Conv2d patch embedding, CLS token and learned positions (Parameters), pre-norm
    layers, final LayerNorm, a classifier over num_labels (no pooler)."""
    hidden, layers, heads = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    inter, act = c.int("intermediate_size"), c.text("hidden_act", "gelu")
    c.divides("num_attention_heads", heads, "hidden_size", hidden)
    image, patch = _pair(c.raw("image_size")), _pair(c.raw("patch_size"))
    if image is None or patch is None:
        c.problems.append("'image_size' and 'patch_size' must be positive whole numbers or pairs of them")
        image = patch = (1, 1)
    patches = (image[0] // patch[0]) * (image[1] // patch[1])
    att = attention(hidden, heads, heads, hidden // heads if heads else 0, qkv_bias=c.flag("qkv_bias", True),
                    out_bias=True, name="attention", kind="bidirectional", rotary_fraction=0.0, position="learned")
    drops = dropouts(attention=c.number("attention_probs_dropout_prob"), residual=c.number("hidden_dropout_prob"))
    block = Block((_ln(hidden, "layernorm_before"), att, _ln(hidden, "layernorm_after"),
                   plain_mlp(hidden, inter, act), *drops))
    labels = num_labels(c)
    return ModelGraph(
        name=name,
        embed=PatchEmbedding(c.int("num_channels"), patch, hidden, name="vit.embeddings.patch_embeddings.projection"),
        extra_params=(Param("vit.embeddings.cls_token", (1, 1, hidden)),
                      Param("vit.embeddings.position_embeddings", (1, patches + 1, hidden))),
        stacks=(Stack("vit.layers", layers, block, seq_axis="patches",
                      before=dropouts(embedding=c.number("hidden_dropout_prob"))),),
        final_norm=_ln(hidden, "vit.layernorm"),
        head=ClassificationHead(Linear("classifier", hidden, labels, True)) if labels else None,
    )

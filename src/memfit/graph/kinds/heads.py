"""Output heads: LMHead (causal LM logits), Seq2SeqLMHead (decoder logits of an encoder-decoder), MaskedLMHead
(BERT's transform + LayerNorm + decoder) and ClassificationHead (an optional pooler + a classifier)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..registry import (GraphTensor, Node, children_params, children_tensors, field_children, handler, join,
                        tensors_of)
from ..saved import NotModelledError, Saved, SavedCtx, saved_by
from .embedding import Param
from .linear import Linear, LoraLinear, linear_rows
from .norm import Norm


@dataclass(frozen=True)
class LMHead(Node):
    """`proj`: hidden -> vocabulary. `tied`: its weight is the input embedding's (counted there once; only a bias,
    if any, is the head's own). `softcap`: final-logit soft-capping (Gemma 2)."""

    proj: Linear | LoraLinear
    tied: bool = False
    softcap: float | None = None
    name: str = field(default="", kw_only=True)
    logits_upcast: bool = field(default=True, kw_only=True)
    """The loss upcasts the logits to fp32 (transformers' ForCausalLMLoss: `logits.float()`)."""

    @property
    def vocab_size(self) -> int:
        return self.proj.out_features


@handler("saved", LMHead)
def _lm_head_saved(node: LMHead, ctx: SavedCtx) -> list[Saved]:
    """The projection's input (for its weight gradient)."""
    return [Saved("norms", node.proj.in_features, "lin", role="head")]


@dataclass(frozen=True)
class Seq2SeqLMHead(Node):
    """The decoder's LM head of an encoder-decoder (T5, BART): as LMHead, over the target sequence."""

    proj: Linear | LoraLinear
    tied: bool = True
    softcap: float | None = None
    name: str = field(default="", kw_only=True)

    @property
    def vocab_size(self) -> int:
        return self.proj.out_features


@handler("children", LMHead, Seq2SeqLMHead)
def _head_children(node: LMHead | Seq2SeqLMHead, path: str):
    return field_children(node, path, ("proj",))


@handler("params", LMHead, Seq2SeqLMHead)
def _head_params(node: LMHead | Seq2SeqLMHead) -> int:
    return sum(t.total for t in _head_tensors(node, ""))


@handler("tensors", LMHead, Seq2SeqLMHead)
def _head_tensors(node: LMHead | Seq2SeqLMHead, path: str) -> Iterator[GraphTensor]:
    if not node.tied:
        return children_tensors(node, path)
    if isinstance(node.proj, LoraLinear):
        raise TypeError("a tied LM head shares the embedding's weight: LoRA on it is not modelled")
    # the weight is the input embedding's (counted there); only a bias is the head's own
    proj_path = join(path, node.proj.name)
    return (GraphTensor(join(proj_path, suffix), numel, 1, node.proj.trainable, local)
            for suffix, numel, local in linear_rows(node.proj) if suffix == "bias")


@dataclass(frozen=True)
class MaskedLMHead(Node):
    """BERT's MLM head: `transform` (hidden -> hidden) + act + `norm`, then `decoder` (hidden -> vocabulary) whose
    weight is tied to the word embeddings and whose bias is `bias` when `tied`."""

    transform: Linear | LoraLinear
    norm: Norm
    decoder: Linear | LoraLinear
    bias: Param
    tied: bool = True
    act: str = "gelu"
    name: str = field(default="cls.predictions", kw_only=True)
    logits_upcast: bool = field(default=False, kw_only=True)
    """BERT's MLM loss (CrossEntropyLoss on the logits) stays in the logits' dtype (log_softmax runs in fp32
    only under autocast)."""

    @property
    def vocab_size(self) -> int:
        return self.decoder.out_features


@handler("children", MaskedLMHead)
def _mlm_children(node: MaskedLMHead, path: str):
    return field_children(node, path, ("transform", "norm", "decoder", "bias"))


@handler("tensors", MaskedLMHead)
def _mlm_tensors(node: MaskedLMHead, path: str) -> Iterator[GraphTensor]:
    for field_name, _, child, child_path in _mlm_children(node, path):
        if field_name == "decoder" and node.tied:
            continue  # weight = word embeddings, bias = `bias`
        yield from tensors_of(child, child_path)


@handler("saved", MaskedLMHead)
def _mlm_saved(node: MaskedLMHead, ctx: SavedCtx) -> list[Saved]:
    """The transform's input, its activation's input, the LayerNorm's tensors and the decoder's input
    (BertPredictionHeadTransform then the decoder, modeling_bert)."""
    h = node.transform.in_features
    return ([Saved("norms", h, "lin", role="head"), Saved("norms", node.transform.out_features, "cmp")]
            + saved_by(node.norm, ctx) + [Saved("norms", node.decoder.in_features, "lin", role="head")])


@handler("params", MaskedLMHead)
def _mlm_params(node: MaskedLMHead) -> int:
    return sum(t.total for t in _mlm_tensors(node, ""))


@dataclass(frozen=True)
class ClassificationHead(Node):
    """`pooler` (hidden -> hidden, optional) then `proj` (hidden -> num_labels). `pool`: which positions the head
    reads: 'first' (BertForSequenceClassification: BertPooler's dense + tanh on the CLS token, dropout, classifier),
    'last' (transformers' GenericForSequenceClassification, the Llama family: `score` on every token, then the last
    non-pad token's logits picked), '' (not measured: ViT's, sized by memfit.derive). `dropout`: the classifier
    dropout's probability (BERT's classifier_dropout, else hidden_dropout_prob)."""

    proj: Linear | LoraLinear
    pooler: Linear | LoraLinear | None = None
    pool: str = ""
    dropout: float = 0.0
    name: str = field(default="", kw_only=True)
    logits_upcast: bool = field(default=False, kw_only=True)
    """The classification losses (CrossEntropyLoss, transformers' fixed_cross_entropy) keep the logits' dtype."""

    @property
    def num_labels(self) -> int:
        return self.proj.out_features


@handler("children", ClassificationHead)
def _cls_children(node: ClassificationHead, path: str):
    return field_children(node, path, ("pooler", "proj"))


handler("params", ClassificationHead)(children_params)
handler("tensors", ClassificationHead)(children_tensors)


@handler("saved", ClassificationHead)
def _cls_saved(node: ClassificationHead, ctx: SavedCtx) -> list[Saved]:
    """Per token, though most of it is per sequence (elements / seq_len). 'last' (GenericForSequenceClassification,
    transformers modeling_layers): `score` keeps its input, the final norm's B x T x h output, as an LM head would;
    its B x T x num_labels logits are indexed at one token per sequence (IndexBackward keeps the B indices), so
    only the B x num_labels pick lives on. 'first' (BertPooler, modeling_bert): `hidden_states[:, 0]` is a view, so
    without autocast the dense layer's saved input keeps the whole B x T x h last hidden state alive (under
    autocast it saves its own B x h bf16 cast); tanh keeps its B x h output, dropout its mask, the classifier its
    B x h input."""
    per_sequence = 1 / max(ctx.seq_len, 1)
    h = node.proj.in_features
    if node.pool == "last":
        return [Saved("norms", h, "lin", role="head")]
    if node.pool != "first" or node.pooler is None:
        raise NotModelledError(f"a classification head pooling '{node.pool or 'unknown'}' has no measured formula")
    if ctx.d.autocast:
        rows = [Saved("norms", h * per_sequence, "c16", role="head")]
    else:
        rows = [Saved("norms", h, "res", role="head")]  # the view keeps the whole last hidden state
    rows.append(Saved("norms", node.pooler.out_features * per_sequence, "cmp"))  # tanh's output
    if node.dropout <= 0:  # the classifier reads tanh's output, kept once
        return rows
    return rows + [Saved("norms", h * per_sequence, ctx.d.mask),  # the mask, then the classifier's input
                   Saved("norms", h * per_sequence, "cmp", role="head")]

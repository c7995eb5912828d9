"""What the head hands the loss, by head kind: an LM head's B x T x V logits, or a sequence classifier's
B x num_labels (ClassificationHead: BertForSequenceClassification's pooled CLS token, the Llama family's last
non-pad token). The analytic estimator sizes logits, log-softmax, their gradients and the head weight's gradient
through these functions, so one formula serves both."""

from __future__ import annotations

from ..errors import ConfigError
from ..model_spec import ModelSpec
from ..setup import Loss, TrainingSetup


def classifier(spec: ModelSpec):
    """The spec's sequence-classification head (memfit.graph ClassificationHead with a measured pooling), or None."""
    return spec.graph.head if spec.num_labels else None


def logit_rows(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Rows of logits the loss reads: every token (LM), one per sequence (a classifier: transformers'
    ForSequenceClassificationLoss / CrossEntropyLoss on B x num_labels)."""
    return setup.micro_batch_size if classifier(spec) is not None else setup.tokens_per_micro_step


def logit_width(spec: ModelSpec) -> int:
    """Columns of the logits: the vocabulary, or the classifier's labels."""
    head = classifier(spec)
    return head.num_labels if head is not None else spec.vocab_size


def logits_elems(spec: ModelSpec, setup: TrainingSetup) -> int:
    return logit_rows(spec, setup) * logit_width(spec)


def label_elems(spec: ModelSpec, setup: TrainingSetup) -> int:
    """int64 labels: one per token (the shifted copy of a causal LM's), one per sequence (a classifier's)."""
    return logit_rows(spec, setup)


def head_weight_elems(spec: ModelSpec) -> int:
    """Elements of the head's weights, the first gradients backward makes: vocabulary x hidden (LM), or the
    classifier's (and BERT's pooler's) weight matrices."""
    head = classifier(spec)
    if head is None:
        return spec.vocab_size * spec.hidden_size
    return sum(p.in_features * p.out_features for p in (head.pooler, head.proj) if p is not None)


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    """A classifier is sized for a plain step: full fine-tune, the standard loss, one pipeline stage, no tensor
    parallelism, no compile, no technique section whose `classifier_sized` is False (activation offload): none of
    them measured with a classification head."""
    if classifier(spec) is None:
        return
    unsized = [what for what, on in (
        ("LoRA / QLoRA", bool(setup.finetune.adapters)), (f"loss {setup.loss}", setup.loss is not Loss.STANDARD),
        ("tensor parallelism", setup.tp > 1), ("pipeline parallelism", setup.pp > 1),
        *((section.describe().removeprefix(", "), not section.classifier_sized) for section in setup.techniques),
        ("torch.compile", setup.compile),
        ("optimizer in backward", setup.optimizer_in_backward), ("float8", setup.float8.is_on)) if on]
    if unsized:
        raise ConfigError(f"a sequence classifier is not sized with {', '.join(unsized)} yet: drop "
                          f"{'it' if len(unsized) == 1 else 'them'}, or trace the step (memfit trace)")

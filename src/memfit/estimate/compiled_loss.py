"""The cross-entropy loss under torch.compile: torchtitan compiles it with its model under `training.compile`
(components/loss.py `build_cross_entropy_loss`: torch.compile of `cross_entropy(pred.flatten(0, 1).float(),
labels)`; releases before it, whose train.py left the compile commented out "compiling loss function causes CUDA
errors", ran it eager). Inductor fuses the fp32 upcast, log-softmax and nll, forward and backward:

- forward keeps the B x T x V logits in their compute dtype (the compiled graph's input, saved for its backward;
  the eager loss lets them go) and two fp32 statistics per token (the row max and the log of the exponentials'
  sum): no fp32 copy, no log-softmax;
- backward writes the logits' gradient once, in the compute dtype (softmax - one-hot, scaled, cast: one kernel).

Measured on CPU with inductor (memfit._torch.step.compiled_loss; tests/test_compiled_loss.py): forward 8 B per
token, backward 2 B per logit, where the eager loss holds 8 B per logit in each. A whole CPU step of the tiny Llama
peaks later, in the LM head's backward, where oneDNN's bf16 matmul adds a scratch buffer (821 KB there) that CUDA's
fixed cuBLAS workspace does not: that step measures 6.7% above the estimate, which sizes the CUDA side.
"""

from __future__ import annotations

from ..model_spec import ModelSpec
from ..setup import TrainingSetup
from .result import Category, Term

SOURCE = ("torchtitan components/loss.py build_cross_entropy_loss (torch.compile of the fp32 cross-entropy); "
          "inductor's fused log-softmax / nll, measured on CPU")
STATS_BYTES = 8
"""Two fp32 statistics per token that the compiled forward keeps for its backward."""


def forward_terms(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> list[Term]:
    tokens = setup.tokens_per_micro_step
    return [Term("activations/logits", Category.ACTIVATIONS, spec.vocab_size * tokens * compute_bytes,
                 f"B x T x V x {compute_bytes} B: the logits, saved by the compiled loss for its backward", SOURCE),
            Term("activations/loss", Category.ACTIVATIONS, (STATS_BYTES + 8) * tokens,
                 "B x T x (2 fp32 row statistics + the shifted int64 label)", SOURCE)]


def backward_term(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> Term:
    return Term("temporaries/loss_backward", Category.TEMPORARIES,
                spec.vocab_size * setup.tokens_per_micro_step * compute_bytes,
                f"B x T x V x {compute_bytes} B: the logits' gradient, written by one fused kernel", SOURCE)

"""The cross-entropy under torch.compile, in its two shapes: torchtune's chunked loss (`compile: True` with
CEWithChunkedOutputLoss: `training.compile_loss` compiles each chunk's cross-entropy, `chunks(setup)`) and
torchtitan's whole loss (`--loss compiled`: components/loss.py `build_cross_entropy_loss`, torch.compile of
`cross_entropy(pred.flatten(0, 1).float(), labels)`, what torchtitan's 2025 releases run under `training.compile`;
the Dec 2024 train.py left it commented out, "compiling loss function causes CUDA errors", and ran it eager).

One mechanism for both: inductor decomposes log-softmax (torch/_inductor/decomposition.py, select_decomp_table) into
amax / sub / exp / sum / log before AOTAutograd's min-cut partition, so the compiled graph keeps (memfit._torch.
compiled.cross_entropy_saved, on fake tensors):

- the logits themselves (its input, in the compute dtype; eager frees them once the loss is computed), the labels
  and two fp32 statistics per row (amax, log-sum-exp): no fp32 copy, no fp32 log-softmax (eager: 4 B x V a token);
- in forward nothing V-sized is made: the upcast is read inside the fused reduction kernels;
- in backward one fused kernel writes the logits' gradient in the compute dtype (the softmax recomputed from the
  kept logits and statistics; nll_loss_backward's scatter into zeros becomes a `where` by inductor's post-grad
  pass scatter_upon_const_tensor), then the kept logits are released and the LM head's matmul backward runs as in
  eager.

Measured on CPU with inductor (gcc): bench/compile.py's compiled-loss rows, tests/estimate/test_compile.py (chunked) and
tests/estimate/test_compiled_loss.py (whole: forward 8 B per token, backward 2 B per logit, where the eager loss holds 8 B per
logit in each). On a CPU with native bf16, oneDNN's matmul adds a scratch buffer in the LM head's backward (821 KB
in a whole-loss step of the tiny Llama) that CUDA's fixed cuBLAS workspace does not: the measurement keeps it out of
the tensor figures as its own overhead term (memfit._torch.measure_cpu).
"""

from __future__ import annotations

from dataclasses import replace

from ..model_spec import ModelSpec
from ..setup import Loss, TrainingSetup
from .result import Category, Term
from .terms import TermKey

SOURCE = ("torchtune training.compile_loss (torch.compile of CEWithChunkedOutputLoss.compute_cross_entropy); "
          "inductor's log-softmax decomposition + min-cut partition (memfit._torch.compiled.cross_entropy_saved)")
WHOLE_SOURCE = ("torchtitan components/loss.py build_cross_entropy_loss (torch.compile of the fp32 cross-entropy); "
                "inductor's fused log-softmax / nll, measured on CPU")
STATS_BYTES_PER_TOKEN = 2 * 4
"""amax and log-sum-exp, one fp32 value each per row (the partition's saved outputs besides the chunk and labels)."""


def chunks(setup: TrainingSetup) -> bool:
    """torchtune compiles the loss with the model: chunked loss + compile (memfit's compile is per block, the
    recipe's; the standard HF loss stays eager)."""
    return setup.compile and setup.loss is Loss.CHUNKED


def whole(setup: TrainingSetup) -> bool:
    """torchtitan's compiled cross-entropy over all the logits at once (`--loss compiled`)."""
    return setup.loss is Loss.COMPILED


def applies(setup: TrainingSetup) -> bool:
    """Either shape: the fp32 upcast is never written."""
    return chunks(setup) or whole(setup)


def saved_term(tokens: int) -> Term:
    """What the compiled chunks keep beyond their logits (which activations/logits counts): labels + statistics."""
    return Term(TermKey.LOSS, Category.ACTIVATIONS, tokens * (8 + STATS_BYTES_PER_TOKEN),
                "B x T x (8 B shifted labels + 2 x 4 B amax and log-sum-exp per row): the compiled chunks keep their "
                "logits (counted above), no fp32 log-softmax", SOURCE)


def backward_terms(base: list[Term], logits: Term, saved: Term, chunk_tokens: list[int], vocab: int, hidden: int,
                   compute_bytes: int, residual_bytes: int, head_grad: int) -> list[Term]:
    """The compiled chunked loss's backward. Autograd runs the nodes made last first: every chunk's compiled
    cross-entropy backward (made after all the head matmuls), then the head matmuls' backward, each from the last
    chunk (measured on CPU: all the chunks' logits gradients are alive when the head's backward starts).

    1. each chunk's fused backward kernel writes its logits gradient (chunk x V, compute dtype), then its kept logits
       are released: the gradients of the chunks done and the kept logits of the others, one chunk twice;
    2. each chunk's LM-head matmul backward: the logits gradients not yet consumed, a chunk x h input gradient, and a
       V x h weight gradient added into autograd's buffer for the head weight (the first contribution is a
       transposed view, TBackward of F.linear's weight, so the second is added out of place, InputBuffer::accumulate:
       three V x h at once, after that chunk's logits gradient is released with its node; later ones in place).
       The finished chunks' input gradients wait for tensor_split's backward (as in eager)."""
    tokens = sum(chunk_tokens)
    rows = tokens * vocab * compute_bytes
    largest = max(chunk_tokens, default=0)
    moments = [(rows, largest * vocab * compute_bytes, 0, 0, tokens * STATS_BYTES_PER_TOKEN,
                f"the largest chunk's logits gradient beside its kept logits (chunk x V x {compute_bytes} B)")]
    done = 0
    for index, n in enumerate(chunk_tokens):
        moments.append(((tokens - done) * vocab * compute_bytes, n * hidden * compute_bytes,
                        head_grad * (1 if index == 0 else 2), done * hidden * residual_bytes, 0,
                        "the chunk x h input gradient its head matmul makes"))
        if index == 1:  # the out-of-place add runs once the node is done: its logits gradient is already released
            moments.append(((tokens - done - n) * vocab * compute_bytes, 0, 3 * head_grad,
                            (done + n) * hidden * residual_bytes, 0, "none: the head weight's gradients are added"))
        done += n
    kept, temp, head, finished, stats, what = max(moments, key=lambda m: sum(m[:5]))
    return base + [
        replace(logits, num_bytes=kept, formula=f"the chunks' kept logits and logits gradients, together B x T x V x "
                                                f"{compute_bytes} B (one becomes the other chunk by chunk)"),
        replace(saved, num_bytes=8 * tokens + stats),  # the statistics go with their chunks' backward
        Term(TermKey.LOSS_BACKWARD, Category.TEMPORARIES, temp, what, SOURCE),
        Term(TermKey.HEAD_GRADIENT, Category.TEMPORARIES, head,
             "V x h gradients of the head weight in autograd's input buffer (the second added out of place: three "
             "at once)", "autograd InputBuffer::accumulate"),
        Term(TermKey.HIDDEN_GRADIENTS, Category.TEMPORARIES, finished,
             "the finished chunks' B x chunk x h input gradients, until tensor_split's backward",
             "autograd InputBuffer of SplitBackward")]


def forward_terms(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> list[Term]:
    tokens = setup.tokens_per_micro_step
    return [Term(TermKey.LOGITS, Category.ACTIVATIONS, spec.vocab_size * tokens * compute_bytes,
                 f"B x T x V x {compute_bytes} B: the logits, saved by the compiled loss for its backward",
                 WHOLE_SOURCE),
            Term(TermKey.LOSS, Category.ACTIVATIONS, (STATS_BYTES_PER_TOKEN + 8) * tokens,
                 "B x T x (2 fp32 row statistics + the shifted int64 label)", WHOLE_SOURCE)]


def backward_term(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> Term:
    return Term(TermKey.LOSS_BACKWARD, Category.TEMPORARIES,
                spec.vocab_size * setup.tokens_per_micro_step * compute_bytes,
                f"B x T x V x {compute_bytes} B: the logits' gradient, written by one fused kernel", WHOLE_SOURCE)

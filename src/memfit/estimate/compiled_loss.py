"""torch.compile of torchtune's chunked loss: what the compiled chunk cross-entropy keeps and makes.

torchtune compiles its loss together with the model: its recipes call `training.compile_loss(loss_fn)` when
`compile=True`, which torch.compile's CEWithChunkedOutputLoss.compute_cross_entropy (one chunk's
`F.cross_entropy(chunk.float(), labels, reduction="sum")`) with inductor. Inductor decomposes log-softmax
(torch/_inductor/decomposition.py, select_decomp_table) into amax / sub / exp / sum / log before AOTAutograd's
min-cut partition, so the partition keeps (memfit._torch.compiled.cross_entropy_saved, on fake tensors):

- the chunk's logits themselves (its input, the compute dtype; eager frees them once the loss is computed),
  its labels and two fp32 statistics per row (amax, log-sum-exp): no fp32 log-softmax (eager: 4 B x V a token);
- in forward nothing chunk-sized is made: the upcast is read inside the fused reduction kernels;
- in backward one fused kernel writes the logits' gradient in the compute dtype (the softmax recomputed from the
  kept chunk and statistics; nll_loss_backward's scatter into zeros becomes a `where` by inductor's post-grad
  pass scatter_upon_const_tensor), then the chunk's kept logits are released, then the LM head's matmul backward
  runs as in eager.

Measured on CPU with inductor (gcc): bench/compile.py's compiled-loss rows, tests/test_compile.py.
"""

from __future__ import annotations

from dataclasses import replace

from ..setup import Loss, TrainingSetup
from .result import Category, Term

SOURCE = ("torchtune training.compile_loss (torch.compile of CEWithChunkedOutputLoss.compute_cross_entropy); "
          "inductor's log-softmax decomposition + min-cut partition (memfit._torch.compiled.cross_entropy_saved)")
STATS_BYTES_PER_TOKEN = 2 * 4
"""amax and log-sum-exp, one fp32 value each per row (the partition's saved outputs besides the chunk and labels)."""


def applies(setup: TrainingSetup) -> bool:
    """torchtune compiles the loss with the model: chunked loss + compile (memfit's compile is per block, the
    recipe's; the standard HF loss stays eager)."""
    return setup.compile and setup.loss is Loss.CHUNKED


def saved_term(tokens: int) -> Term:
    """What the compiled chunks keep beyond their logits (which activations/logits counts): labels + statistics."""
    return Term("activations/loss", Category.ACTIVATIONS, tokens * (8 + STATS_BYTES_PER_TOKEN),
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
       three V x h at once; later ones in place). The finished chunks' input gradients wait for tensor_split's
       backward (as in eager)."""
    tokens = sum(chunk_tokens)
    rows = tokens * vocab * compute_bytes
    largest = max(chunk_tokens, default=0)
    moments = [(rows, largest * vocab * compute_bytes, 0, 0, tokens * STATS_BYTES_PER_TOKEN,
                f"the largest chunk's logits gradient beside its kept logits (chunk x V x {compute_bytes} B)")]
    done = 0
    for index, n in enumerate(chunk_tokens):
        head = head_grad * (1 if index == 0 else 3 if index == 1 else 2)
        moments.append(((tokens - done) * vocab * compute_bytes, n * hidden * compute_bytes, head,
                        done * hidden * residual_bytes, 0, "the chunk x h input gradient its head matmul makes"))
        done += n
    kept, temp, head, finished, stats, what = max(moments, key=lambda m: sum(m[:5]))
    return base + [
        replace(logits, num_bytes=kept, formula=f"the chunks' kept logits and logits gradients, together B x T x V x "
                                                f"{compute_bytes} B (one becomes the other chunk by chunk)"),
        replace(saved, num_bytes=8 * tokens + stats),  # the statistics go with their chunks' backward
        Term("temporaries/loss_backward", Category.TEMPORARIES, temp, what, SOURCE),
        Term("temporaries/head_gradient", Category.TEMPORARIES, head,
             "V x h gradients of the head weight in autograd's input buffer (the second added out of place: three "
             "at once)", "autograd InputBuffer::accumulate"),
        Term("temporaries/hidden_gradients", Category.TEMPORARIES, finished,
             "the finished chunks' B x chunk x h input gradients, until tensor_split's backward",
             "autograd InputBuffer of SplitBackward")]

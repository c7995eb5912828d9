"""The moments around the loss: inside its forward (the logits' fp32 upcast, the fused loss's chunk), its backward
(log-softmax's gradients; the chunked loss chunk by chunk) and, without a B x T x V logits gradient, the final norm's
backward."""

from __future__ import annotations

from dataclasses import replace

from ..setup import LOSS_CHUNKS, Loss, TrainingSetup
from . import activations as act
from . import compiled_loss, heads, litgpt
from .forward_terms import CHUNKED_SOURCE, FUSED_SOURCE, fused_chunk_rows, linear_weight_elems, loss_elem_bytes
from .result import Category, Term
from .step_model import StepModel, head_grads
from .terms import TermKey


def _chunk_tokens(setup: TrainingSetup) -> list[int]:
    """Tokens of each of the chunked loss's chunks, in the order backward meets them (the last chunk first):
    torch.tensor_split along the sequence gives the first T mod K chunks one position more."""
    quotient, remainder = divmod(setup.seq_len, LOSS_CHUNKS)
    sizes = [setup.micro_batch_size * (quotient + (i < remainder)) for i in range(LOSS_CHUNKS)]
    return [n for n in reversed(sizes) if n]


def loss_forward(step: StepModel, forward: list[Term]) -> list[Term]:
    """Inside the loss, still under autocast: ForCausalLMLoss upcasts the logits (`logits.float()`, a new fp32 tensor
    beside the log-softmax it feeds), and autocast's cache still holds every Linear weight's cast: under checkpointing
    these are not saved for backward, but live until the autocast region (forward and loss) exits. The chunked loss
    upcasts one chunk at a time (the last, once every other chunk's log-softmax is saved); the fused loss holds one
    chunk of logits (and, under autocast, the reference's fp32 copy of it for the head-weight gradient)."""
    spec, setup = step.spec, step.setup
    if setup.loss is Loss.FUSED:
        return _fused_loss_forward(step, forward)
    if litgpt.applies(setup) and spec.is_decoder:
        return litgpt.loss_forward(forward, spec, step.tokens)
    if not spec.is_decoder or step.dtypes.compute == 4 or heads.classifier(spec) is not None:
        return []  # only ForCausalLMLoss upcasts the logits
    upcast = spec.vocab_size * (max(_chunk_tokens(setup)) if setup.loss is Loss.CHUNKED else step.tokens) * 4
    if compiled_loss.applies(setup):
        upcast = 0  # read inside inductor's fused reduction kernels, never written (memfit.estimate.compiled_loss)
    what = "one chunk of the logits" if setup.loss is Loss.CHUNKED else "B x T x V x 4 B: the logits"
    terms = list(forward) + [Term(TermKey.LOGITS_FP32, Category.TEMPORARIES, upcast,
                                  f"{what} upcast for the loss, until log-softmax has run",
                                  CHUNKED_SOURCE if setup.loss is Loss.CHUNKED else
                                  "transformers loss_utils.ForCausalLMLoss (logits.float())")]
    if setup.precision.is_autocast and setup.checkpointing.checkpointed_blocks(spec.num_layers):
        cached = 2 * linear_weight_elems(spec, setup)
        terms = [replace(t, num_bytes=cached, formula="2 B x Linear weights: autocast's cast cache, until it exits")
                 if t.name == TermKey.AUTOCAST_WEIGHT_COPIES else t for t in terms]
    return terms


def _fused_loss_forward(step: StepModel, forward: list[Term]) -> list[Term]:
    spec, setup, d = step.spec, step.setup, step.dtypes
    rows = fused_chunk_rows(spec, step.tokens)
    extra = 4 if setup.precision.is_autocast else 0
    terms = list(forward) + [Term(
        TermKey.LOSS_CHUNK, Category.TEMPORARIES, rows * spec.vocab_size * (d.compute + extra),
        f"{rows} tokens x V x {d.compute} B: one chunk's logits, overwritten by their gradient"
        + (" + its fp32 copy for the head-weight gradient (the reference; Liger's CUDA addmm(out_dtype=fp32) "
           "makes none)" if extra else ""), FUSED_SOURCE)]
    if setup.precision.is_autocast:  # autocast's cache holds every Linear weight's cast, the head's too
        cached = 2 * linear_weight_elems(spec, setup)
        terms = [replace(t, num_bytes=cached, formula="2 B x Linear weights: autocast's cast cache, until it exits")
                 if t.name == TermKey.AUTOCAST_WEIGHT_COPIES else t for t in terms]
    return terms


def loss_backward(step: StepModel, forward: list[Term]) -> list[Term]:
    """Log-softmax backward: its output and two B x T x V gradients. The Trainer keeps only the loss, so the logits
    are gone by then (a loop that holds `outputs` through backward adds B x T x V x dtype here). The fused loss
    makes nothing here (its gradients exist already); the chunked one runs chunk by chunk (`_chunked_backward`)."""
    if step.setup.loss is Loss.FUSED:
        return []
    if litgpt.applies(step.setup) and step.spec.is_decoder:
        return litgpt.loss_backward(forward, step.spec, step.setup, step.tokens)
    if step.setup.loss is Loss.CHUNKED:
        return _chunked_loss_backward(step, forward)
    if compiled_loss.whole(step.setup):  # the kept logits and their one gradient (memfit.estimate.compiled_loss)
        return list(forward) + [compiled_loss.backward_term(step.spec, step.setup, step.dtypes.compute)]
    loss_bytes = loss_elem_bytes(step.spec, step.setup)
    if step.setup.tp > 1:
        # torch.distributed.tensor.parallel.loss_parallel fuses nll and log-softmax backward as
        # (zeros_like(x) with -1 at the targets + exp(x)) * grad: three vocab-sharded tensors at once
        loss_tmp = Term(TermKey.LOSS_BACKWARD, Category.TEMPORARIES,
                        3 * step.spec.vocab_size * step.tokens * loss_bytes,
                        f"3 x B x T x V/tp x {loss_bytes} B: loss_parallel's one-hot gradient, exp(log-softmax), "
                        "their sum times the loss gradient", "torch.distributed.tensor.parallel.loss "
                        "_nll_loss_and_log_softmax_backward (torch 2.13), measured on 2 gloo ranks")
        return [t for t in forward if t.name != TermKey.LOGITS] + [loss_tmp]
    loss_tmp = Term(TermKey.LOSS_BACKWARD, Category.TEMPORARIES,
                    2 * heads.logits_elems(step.spec, step.setup) * loss_bytes,
                    f"2 x B x T x V x {loss_bytes} B: gradients of log-softmax and of the logits"
                    if heads.classifier(step.spec) is None else
                    f"2 x B x num_labels x {loss_bytes} B: gradients of log-softmax and of the logits",
                    "aten log_softmax_backward")
    return [t for t in forward if t.name != TermKey.LOGITS] + [loss_tmp]


def _chunked_loss_backward(step: StepModel, forward: list[Term]) -> list[Term]:
    """The chunked loss's backward, one chunk at a time from the last: its log-softmax backward (two chunk x V fp32
    gradients beside every log-softmax output not yet consumed), then its LM-head matmul backward (the logits'
    gradient in the compute dtype, a V x h weight gradient added into autograd's buffer for the head weight, and a
    chunk x h input gradient that waits, with the others, for tensor_split's backward). The worst of these."""
    spec, setup, d = step.spec, step.setup, step.dtypes
    vocab, h = spec.vocab_size, spec.hidden_size
    head_grad = vocab * h * (d.compute if setup.precision.param_dtype == "fp32" else 2)
    if not setup.precision.is_autocast and setup.precision.param_dtype == "fp32":
        head_grad = vocab * h * 4
    if spec.frozen and not any(p.name.endswith("lm_head.modules_to_save.weight") for p in spec.params):
        head_grad = 0  # LoRA: the frozen head has no weight gradient to accumulate (measured, tests/lora/test_lora.py)
    base = [t for t in forward if t.name not in (TermKey.LOGITS, TermKey.LOSS)]
    saved_total = next(t for t in forward if t.name == TermKey.LOSS)
    if compiled_loss.chunks(setup):
        logits = next(t for t in forward if t.name == TermKey.LOGITS)
        return compiled_loss.backward_terms(base, logits, saved_total, _chunk_tokens(setup), vocab, h, d.compute,
                                            d.residual, 0 if spec.frozen else head_grad)  # a frozen head: none
    labels = 8 * step.tokens
    best: tuple[int, list[Term]] | None = None
    done = 0
    for index, n in enumerate(_chunk_tokens(setup)):
        buffered = head_grad if index else 0
        hidden = done * h * d.residual
        saved = saved_total.num_bytes - labels - 4 * vocab * done
        candidates = [
            (saved, 2 * 4 * vocab * n, "2 x chunk x V x 4 B: gradients of log-softmax and of the chunk's logits",
             buffered, hidden),
            (saved - 4 * vocab * n, vocab * n * d.compute + n * h * d.compute,
             f"chunk x V x {d.compute} B logits gradient + chunk x h input gradient", buffered + head_grad, hidden)]
        if d.compute != 4:
            candidates.append((saved - 4 * vocab * n, vocab * n * (4 + d.compute),
                               f"chunk x V x 4 B gradient and its {d.compute} B cast", buffered, hidden))
        for saved_now, temp, what, grads, hidden_now in candidates:
            terms = base + [
                replace(saved_total, num_bytes=saved_now + labels,
                        formula="the log-softmax outputs of the chunks whose backward has not run + labels"),
                Term(TermKey.LOSS_BACKWARD, Category.TEMPORARIES, temp, what, CHUNKED_SOURCE),
                Term(TermKey.HEAD_GRADIENT, Category.TEMPORARIES, grads,
                     "V x h gradient of the head weight, summed over the chunks in autograd's input buffer "
                     "(while one more is added)", "autograd InputBuffer accumulation"),
                Term(TermKey.HIDDEN_GRADIENTS, Category.TEMPORARIES, hidden_now,
                     "the finished chunks' B x chunk x h input gradients, until tensor_split's backward",
                     "autograd InputBuffer of SplitBackward")]
            total = sum(t.num_bytes for t in terms)
            if best is None or total > best[0]:
                best = (total, terms)
        done += n
    return best[1] if best else []


def final_norm_backward(step: StepModel, early_grads: int) -> list[Term]:
    """Fused loss: with no logits gradient before it, the peak moves to the final norm's backward, every block's
    activations still alive: the norm's saved tensors, the head's gradient (unless stepped in backward) and the
    B x T x h gradients of RMSNorm's chain (the incoming one, of weight * x, of x * rsqrt, of the fp32 input and
    their sum: 5, measured on the tiny llama / qwen2; LayerNorm's fused backward: 3)."""
    spec, static = step.spec, step.static
    head = 0 if step.setup.optimizer_in_backward and not spec.tie_word_embeddings else head_grads(spec, static)
    count = 5 if spec.norm != "layernorm" else 3
    # a classifier's `score` has run its backward: its saved input is gone (the fused loss never saved one)
    head_saved = act.head_saved_bytes(spec, step.setup, step.tokens, head_input=False)["head"]
    acts = [replace(t, num_bytes=head_saved - step.tokens * spec.hidden_size * step.dtypes.residual,
                    formula="final norm's saved tensors, once `weight * x` has run its backward")
            if t.name == TermKey.HEAD else t
            for t in step.acts_except(TermKey.LOGITS, TermKey.LOSS, TermKey.FUSED_HEAD)]
    return (step.static_terms(max(early_grads, head)) + acts
            + [Term(TermKey.NORM_BACKWARD, Category.TEMPORARIES, count * step.tokens * spec.hidden_size * 4,
                    f"{count} x B x T x h x 4 B: the final norm's backward chain", "autograd of the final norm")])

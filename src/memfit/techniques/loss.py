"""The loss and the optimizer step, moved so that memory they hold never exists in full: a chunked or fused loss
(the B x T x V logits, the largest activation of a large-vocabulary model) and the optimizer step run inside
backward (the gradients)."""

from __future__ import annotations

from ..errors import ConfigError
from ..setup import Loss, TrainingSetup
from .base import Context, Proposal, Skip, Technique, register
from .costs import chunked_loss_cost, fused_loss_cost, optimizer_in_backward_cost


@register
class ChunkedOrFusedLoss(Technique):
    """After FlashAttention on the activations ladders: FlashAttention is free and everywhere; the chunked loss
    costs a little compute and the fused one an extra package, and both only touch the head's B x T x V share."""

    key = "fused_loss"
    cuts_static = False
    title = "chunked / fused cross-entropy"

    def search_values(self, setup, hardware) -> dict[str, list]:
        return {"loss": list(Loss)}

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.loss is Loss.FUSED:
            return Skip("already fused: the logits never exist in full")
        if not ctx.spec.is_decoder or ctx.spec.logit_softcap:
            return Skip("sized for causal LMs without final logit softcapping")
        candidates = []
        for loss in ((Loss.CHUNKED, Loss.FUSED) if ctx.setup.loss is Loss.STANDARD else (Loss.FUSED,)):
            try:
                candidates.append(ctx.setup.replace(loss=loss))
            except ConfigError as error:
                return Skip(str(error))
        chosen = ctx.pick(candidates)
        if isinstance(chosen, Skip):
            return chosen
        if chosen.loss is Loss.FUSED:
            return Proposal(chosen, "TrainingArguments(use_liger_kernel=True)  # pip install liger-kernel; or "
                                    "Apple's cut-cross-entropy",
                            fused_loss_cost(),
                            "head, loss and their gradients chunk by chunk in forward: no B x T x V logits, no "
                            "fp32 log-softmax, only the B x T x h and V x h gradients kept")
        return Proposal(chosen, "torchtune loss: torchtune.modules.loss.CEWithChunkedOutputLoss (num_output_chunks=8)",
                        chunked_loss_cost(),
                        "upcasts and back-propagates the logits one sequence chunk at a time: the fp32 copy and the "
                        "log-softmax gradients shrink to an eighth")


@register
class OptimizerInBackward(Technique):
    """On the static ladders after 8-bit AdamW and before ZeRO: it needs no second GPU and no communication, but it
    gives up gradient accumulation and clipping, which 8-bit states do not."""

    key = "optimizer_in_backward"
    title = "optimizer step in backward"

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.optimizer_in_backward:
            return Skip("already stepping in backward")
        if ctx.setup.finetune.adapters:
            return Skip(f"{ctx.setup.finetune.method} gradients are the adapters' only: nothing to free")
        try:
            setup = ctx.setup.replace(optimizer_in_backward=True)
        except ConfigError as error:
            return Skip(str(error))
        if ctx.pinned_changes(setup):
            return Skip("it would change a pinned field")
        if not ctx.fits(setup):
            # alone it does not fit, and it would block what comes next (ZeRO, accumulation)
            return Skip("does not fit on its own, and it rules out ZeRO and gradient accumulation")
        chosen = setup
        return Proposal(chosen, "torchtune: optimizer_in_bwd: True  # per-parameter register_post_accumulate_grad_hook",
                        optimizer_in_backward_cost(),
                        "each parameter steps as soon as its gradient is complete and the gradient is freed: one "
                        "parameter's gradient at a time instead of all of them, and no optimizer-step peak")


def hf_trainer_fragment(setup: TrainingSetup, **_) -> tuple[dict, dict[str, str], list[str]]:
    """(TrainingArguments kwargs, their comments, notes) for the HF Trainer files (memfit.emit.hf_trainer).
    The fused loss is Liger's (TrainingArguments.use_liger_kernel patches the model's forward with its fused
    linear cross-entropy); the chunked loss and the optimizer step in backward are torchtune's, said in notes."""
    content, comments, notes = {}, {}, []
    if setup.loss is Loss.FUSED:
        content["use_liger_kernel"] = True
        comments["use_liger_kernel"] = ("Liger kernels incl. the fused linear cross-entropy: no B x T x V logits "
                                        "(pip install liger-kernel; CUDA + Triton)")
    elif setup.loss is Loss.CHUNKED:
        notes.append("The chunked loss is torchtune's: `loss: _component_: torchtune.modules.loss."
                     "CEWithChunkedOutputLoss` (num_output_chunks 8; newer torchtune: LinearCrossEntropyLoss). The HF "
                     "Trainer has no chunked loss; `use_liger_kernel=True` (fused) saves more.")
    if setup.optimizer_in_backward:
        notes.append("The optimizer step in backward is torchtune's `optimizer_in_bwd: True` (with "
                     "gradient_accumulation_steps 1 and clip_grad_norm null); TrainingArguments has no such option.")
    return content, comments, notes

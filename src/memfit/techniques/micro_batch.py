from __future__ import annotations

from .base import Context, Proposal, Skip, Technique, register


@register
class MicroBatchAccumulation(Technique):
    """Smaller micro-batch, more accumulation steps: the same effective batch, less activation memory."""

    key = "micro_batch"
    title = "smaller micro-batch + gradient accumulation"

    def propose(self, ctx: Context) -> Proposal | Skip:
        b, accum = ctx.setup.micro_batch_size, ctx.setup.grad_accum_steps
        if b == 1:
            return Skip("micro-batch is already 1")
        candidates = []
        size = b
        while size > 1:
            size = _next_divisor_below(b, size)
            candidates.append(ctx.setup.replace(micro_batch_size=size, grad_accum_steps=accum * (b // size)))
        chosen = ctx.first_fitting(candidates) or candidates[-1]
        nb, na = chosen.micro_batch_size, chosen.grad_accum_steps
        return Proposal(chosen,
                        f"TrainingArguments(per_device_train_batch_size={nb}, gradient_accumulation_steps={na})",
                        f"same effective batch ({chosen.effective_batch_size}) in {na} micro-steps instead of "
                        f"{accum}; smaller matmuls use the GPU less well",
                        f"activations scale with the micro-batch: {b} -> {nb}")


def _next_divisor_below(total: int, current: int) -> int:
    """The largest divisor of `total` below `current` (so the effective batch stays exact)."""
    for size in range(current - 1, 0, -1):
        if total % size == 0:
            return size
    return 1

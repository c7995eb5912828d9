from __future__ import annotations

from ..change import Change
from .base import Context, Proposal, Skip, Technique, register
from .costs import micro_batch_cost
from .convert import Target, conversion


@register
class MicroBatchAccumulation(Technique):
    """Smaller micro-batch, more accumulation steps: the same effective batch, less activation memory."""

    key = "micro_batch"
    cuts_static = False
    title = "smaller micro-batch + gradient accumulation"

    def search_values(self, setup, hardware) -> dict[str, list]:
        """Every divisor of the micro-batch (memfit.search keeps the effective batch with the accumulation)."""
        return {"micro_batch_size": divisors(setup.micro_batch_size)}

    def propose(self, ctx: Context) -> Proposal | Skip:
        b, accum = ctx.setup.micro_batch_size, ctx.setup.grad_accum_steps
        if b == 1:
            return Skip("micro-batch is already 1")
        candidates = [ctx.setup.replace(micro_batch_size=size, grad_accum_steps=accum * (b // size))
                      for size in reversed(divisors(b)) if size < b]
        chosen = ctx.pick(candidates)
        if isinstance(chosen, Skip):
            return chosen
        nb, na = chosen.micro_batch_size, chosen.grad_accum_steps
        return Proposal(chosen,
                        f"TrainingArguments(per_device_train_batch_size={nb}, gradient_accumulation_steps={na})",
                        micro_batch_cost(chosen.effective_batch_size, na, accum),
                        f"activations scale with the micro-batch: {b} -> {nb}")


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (so the effective batch stays exact), in O(sqrt(n))."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@conversion("batching")
def convert(model, setup, target: Target):
    """Micro-batch and accumulation are the data loader's and the loop's: this says what they are."""

    return Change("batching", False,
                  f"the data loader is yours: micro-batch {setup.micro_batch_size} x {setup.grad_accum_steps} "
                  f"accumulation steps = {setup.micro_batch_size * setup.grad_accum_steps} sequences per optimizer "
                  f"step (HF: per_device_train_batch_size={setup.micro_batch_size}, "
                  f"gradient_accumulation_steps={setup.grad_accum_steps}), sequences of {setup.seq_len} tokens")

from __future__ import annotations

from ..setup import Offload, Optimizer
from .base import Context, Proposal, Skip, Technique, register, with_engine_that_can


@register
class Adam8bit(Technique):
    key = "adam_8bit"
    title = "8-bit AdamW"

    def propose(self, ctx: Context) -> Proposal | Skip:
        opt = ctx.setup.optimizer
        if opt is Optimizer.ADAMW_8BIT:
            return Skip("already 8-bit AdamW")
        if not opt.is_adam:
            return Skip(f"the optimizer is {opt}, not Adam")
        if ctx.setup.offload is not Offload.NONE:
            return Skip("optimizer states are offloaded to the CPU already")
        if ctx.setup.finetune.adapters:
            states = sum(t.num_bytes for t in ctx.estimate.terms if t.name == "optimizer/states")
            return Skip(f"{ctx.setup.finetune.method} keeps AdamW states for the adapters only "
                        f"({states / 2**20:.0f} MiB): 8-bit states save next to nothing")
        return Proposal(with_engine_that_can(ctx.setup, optimizer=Optimizer.ADAMW_8BIT),
                        "TrainingArguments(optim=\"adamw_bnb_8bit\")  # bitsandbytes.optim.AdamW8bit",
                        "negligible step time; matches 32-bit Adam on LM fine-tuning (Dettmers et al. 2022)",
                        "block-wise 8-bit states: ~2 B/param instead of 8 B/param (a quarter, not a half)")

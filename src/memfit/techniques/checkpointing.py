from __future__ import annotations

from ..setup import Checkpointing
from .base import Context, Proposal, Skip, Technique, register


@register
class GradientCheckpointing(Technique):
    key = "checkpointing"
    title = "gradient checkpointing"

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.checkpointing is Checkpointing.FULL:
            return Skip("already on")
        from ..emit.hf_trainer import legacy_checkpointing_names

        name = "gradient_checkpointing" if legacy_checkpointing_names() else "activation_checkpointing"
        return Proposal(ctx.setup.replace(checkpointing=Checkpointing.FULL),
                        f"TrainingArguments({name}=True)  # or model.{name}_enable()",
                        "+33% compute (one extra forward per step)",
                        "keeps only each block's input and recomputes the rest during backward")

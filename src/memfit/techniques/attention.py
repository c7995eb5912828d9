from __future__ import annotations

from ..setup import Attention
from .base import Context, Proposal, Skip, Technique, register


@register
class FlashAttention(Technique):
    key = "flash_attention"
    cuts_static = False
    title = "FlashAttention / SDPA"

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.attention is Attention.SDPA:
            return Skip("already a kernel that never materialises T x T (sdpa)")
        if ctx.spec.extra.get("supports_sdpa") is False:  # e.g. gpt_oss (attention sinks): eager only
            return Skip(f"transformers has no sdpa attention for {ctx.spec.model_type} (eager only)")
        return Proposal(ctx.setup.replace(attention=Attention.SDPA),
                        f"{ctx.spec.auto_class}.from_pretrained(..., attn_implementation=\"sdpa\")",
                        "none: usually faster than eager attention",
                        "drops the B x H x T x T softmax every layer keeps for backward")

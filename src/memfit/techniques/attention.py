from __future__ import annotations

from ..change import Change
from ..setup import Attention, TrainingSetup
from .base import Context, Proposal, Skip, Technique, register
from .costs import Cost, attention_cost, attention_step_cost
from .convert import Target, conversion


@register
class FlashAttention(Technique):
    key = "flash_attention"
    cuts_static = False
    title = "FlashAttention / SDPA"

    def step_cost(self, spec, setup: TrainingSetup, hardware) -> Cost:
        return attention_step_cost(setup)

    def search_values(self, setup: TrainingSetup, hardware) -> dict[str, list]:
        return {"attention": [Attention.SDPA]}  # never slower nor larger than eager where it runs

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.attention is Attention.SDPA:
            return Skip("already a kernel that never materialises T x T (sdpa)")
        if ctx.spec.extra.get("supports_sdpa") is False:  # e.g. gpt_oss (attention sinks): eager only
            return Skip(f"transformers has no sdpa attention for {ctx.spec.model_type} (eager only)")
        return Proposal(ctx.setup.replace(attention=Attention.SDPA),
                        f"{ctx.spec.auto_class}.from_pretrained(..., attn_implementation=\"sdpa\")",
                        attention_cost(),
                        "drops the B x H x T x T softmax every layer keeps for backward")


@conversion("attention")
def convert(model, setup: TrainingSetup, target: Target) -> Change:
    """HF models: `set_attn_implementation` to the setup's (memfit._torch.step.build_hf_model builds it so already);
    a plain module attends however its code does."""
    want = str(setup.attention)
    if not target.is_hf:
        return Change("attention", False, "not applicable: a plain nn.Module attends however its code does "
                                          "(torch.nn.functional.scaled_dot_product_attention is the O(T) kernel)")
    current = getattr(model.config, "_attn_implementation", None)
    if current == want:
        return Change("attention", False, f"already {want}")
    try:
        model.set_attn_implementation(want)
    except (ValueError, ImportError) as error:
        return Change("attention", False, f"could not switch {current} -> {want}: {error}")
    now = getattr(model.config, "_attn_implementation", None)
    if now != want:
        return Change("attention", False, f"{type(model).__name__} kept {now}: it cannot switch to {want}")
    return Change("attention", True, f"switched {current} -> {want}")

from __future__ import annotations

from ..setup import Attention, Checkpointing, TrainingSetup
from .base import Context, Proposal, Skip, Technique, register
from .costs import recompute_fraction

_HOW = {
    Checkpointing.ATTENTION: ("recomputes only the eager attention core (QK^T, softmax, dropout, x V) in backward: "
                              "its B x H x T x T tensors go, q, k, v stay (Megatron selective recompute, "
                              "Korthikanti et al. 2022)"),
    Checkpointing.SELECTIVE_OP: ("keeps each block's input, its 1st, 3rd, ... matmul outputs and the SDPA output; "
                                 "recomputes the rest in backward (torchtitan op-level SAC)"),
    Checkpointing.EVERY_2: "fully checkpoints every 2nd block; the others keep everything (torchtitan layer SAC)",
    Checkpointing.FULL: "keeps only each block's input and recomputes the rest during backward",
}


def _change(ctx: Context, mode: Checkpointing) -> str:
    from ..emit.hf_trainer import legacy_checkpointing_names

    if mode is Checkpointing.FULL:
        name = "gradient_checkpointing" if legacy_checkpointing_names() else "activation_checkpointing"
        return f"TrainingArguments({name}=True)  # or model.{name}_enable()"
    return (f"memfit.apply_(model, {{'checkpointing': '{mode}'}})  # TrainingArguments' checkpointing is full "
            "only: this line (or memfit_apply.json, --emit) wraps the blocks; the FSDP2 script memfit emits writes "
            "it too")


def _cost(ctx: Context, setup: TrainingSetup) -> str:
    share = recompute_fraction(ctx.spec, setup)
    what = {Checkpointing.FULL: "one extra forward per step",
            Checkpointing.SELECTIVE_OP: "every 2nd matmul of a block and its elementwise ops recomputed",
            Checkpointing.ATTENTION: "the attention core's two T x T matmuls and softmax recomputed"}.get(
        setup.checkpointing, f"one extra forward of every {setup.checkpointing.every}th block")
    return f"+{100 * share:.0f}% compute ({what})"


@register
class GradientCheckpointing(Technique):
    key = "checkpointing"
    cuts_static = False
    title = "gradient checkpointing"

    def propose(self, ctx: Context) -> Proposal | Skip:
        """The cheapest variant in compute that fits, else full (the one that saves most)."""
        current = ctx.setup.checkpointing
        if current is Checkpointing.FULL:
            return Skip("already on")
        modes = [Checkpointing.FULL]
        if not ctx.setup.finetune.adapters and ctx.spec.derived is None and ctx.spec.is_transformer:
            modes += [Checkpointing.SELECTIVE_OP, Checkpointing.EVERY_2]
            if ctx.setup.attention is Attention.EAGER:
                modes.append(Checkpointing.ATTENTION)
        candidates = sorted((ctx.setup.replace(checkpointing=m) for m in modes if m is not current),
                            key=lambda s: recompute_fraction(ctx.spec, s))
        before = ctx.estimate.total_bytes
        candidates = [c for c in candidates if c.checkpointing is Checkpointing.FULL
                      or ctx.size(c).total_bytes < before]
        picked = ctx.pick(candidates)
        if isinstance(picked, Skip):
            return picked
        mode = picked.checkpointing
        return Proposal(picked, _change(ctx, mode), _cost(ctx, picked), _HOW[mode] if mode in _HOW else _HOW[
            Checkpointing.EVERY_2].replace("2nd", f"{mode.every}th"))

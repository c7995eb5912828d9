"""Activation offloading to the CPU (torchtune enable_activation_offloading): the saved tensors of forward wait in
pinned host RAM for their backward. torchtune pairs it with activation checkpointing, which leaves only each block's
input to move: a few MiB of traffic instead of every saved tensor; offloading alone moves them all."""

from __future__ import annotations

from ..change import Change
from ..errors import ConfigError
from ..setup import Checkpointing, Loss, TrainingSetup
from ..units import format_bytes
from .base import Context, Proposal, Skip, Technique, register
from .convert import MEMFIT_LOOP, Target, conversion
from .costs import activation_offload_cost


def host_bytes(ctx: Context, setup: TrainingSetup) -> int:
    """Pinned host bytes per GPU of the setup's activation offload (the estimate's host RAM less the optimizer's)."""
    return ctx.size(setup).cpu_bytes - ctx.size(setup.replace(activation_offload=False)).cpu_bytes


@register
class ActivationOffload(Technique):
    """After the chunked / fused loss on the activation ladders: it costs host RAM and PCIe bandwidth (hidden behind
    compute only as far as the link keeps up), where the rungs before it cost a little compute or nothing."""

    key = "activation_offload"
    cuts_static = False
    title = "activation offloading to the CPU"

    def search_values(self, setup: TrainingSetup, hardware) -> dict[str, list]:
        return {"activation_offload": [False, True]}

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.activation_offload:
            return Skip("already offloading activations")
        if ctx.setup.loss is Loss.FUSED:  # setup.replace would turn the fused loss back: keep it instead
            return Skip("not sized with the fused loss, which already keeps no logits")
        modes = [ctx.setup.checkpointing]
        if not ctx.setup.checkpointing.is_on:
            modes.append(Checkpointing.FULL)  # torchtune's pairing: offload the checkpoints only
        candidates = []
        for mode in modes:
            try:
                candidates.append(ctx.setup.replace(activation_offload=True, checkpointing=mode))
            except ConfigError as error:
                return Skip(str(error))
        ram = ctx.hardware.cpu_ram_bytes
        need = {id(c): (ctx.size(c).cpu_bytes * ctx.hardware.gpus_per_node) for c in candidates}
        within = [c for c in candidates if need[id(c)] <= ram]
        if not within:
            return Skip(f"host RAM is the limit: the offloaded activations need {format_bytes(min(need.values()))} "
                        f"per node, more than the {format_bytes(ram)} given (--cpu-ram)")
        chosen = ctx.pick(within)
        if isinstance(chosen, Skip):
            return chosen
        moved = host_bytes(ctx, chosen)
        paired = chosen.checkpointing is not ctx.setup.checkpointing
        return Proposal(
            chosen,
            "torchtune: enable_activation_offloading: True" + (", enable_activation_checkpointing: True" if paired
                                                              else "") + "  # TRL SFTConfig / axolotl: "
            "activation_offloading: true; HF Trainer: memfit.apply_(model, {'activation_offload': True})",
            activation_offload_cost(moved, chosen, ctx.hardware),
            "tensors saved for backward wait in pinned host RAM and stream back block by block; the LM head's and "
            "the loss's stay on the device" + ("; with full checkpointing only each block's input moves" if
                                               chosen.checkpointing is Checkpointing.FULL else ""))


@conversion("activation_offload")
def convert(model, setup: TrainingSetup, target: Target):
    """torchtune's OffloadActivations hooks around every forward of the model (memfit._torch.offload_activations):
    for loops that call model(**batch), as the HF Trainer does. memfit's own loop wraps its forward and loss
    itself (offload_activations.context), so a model it trains gets no hooks."""
    if not setup.activation_offload:
        return None
    from .._torch import offload_activations

    if target.loop == MEMFIT_LOOP:
        return Change("activation offload", False, "memfit's training loop offloads around the forward and the loss")
    if getattr(model, "_memfit_activation_offload", None) is not None:
        return Change("activation offload", False, "already installed")
    offload_activations.install(model)
    return Change("activation offload", True, "saved tensors of >= 1 KiB (parameters aside) go to pinned host RAM in "
                                              "forward and come back in backward; the LM head's and the loss's stay")

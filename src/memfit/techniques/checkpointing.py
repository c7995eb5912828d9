from __future__ import annotations

from ..change import Change
from ..errors import ConfigError
from ..setup import Attention, Checkpointing, TrainingSetup
from .base import Context, Proposal, Skip, Technique, register
from .convert import ApplyItem, Target, apply_item, conversion
from .costs import Cost, checkpointing_cost, recompute_fraction
from ..selective_op import SELECTIVE_OP_POLICY

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
    from ..libraries import legacy_checkpointing_names

    if mode is Checkpointing.FULL:
        name = "gradient_checkpointing" if legacy_checkpointing_names() else "activation_checkpointing"
        return f"TrainingArguments({name}=True)  # or model.{name}_enable()"
    return (f"memfit.apply_(model, {{'checkpointing': '{mode}'}})  # TrainingArguments' checkpointing is full "
            "only: this line (or memfit_apply.json, --emit) wraps the blocks; the FSDP2 script memfit emits writes "
            "it too")


@register
class GradientCheckpointing(Technique):
    key = "checkpointing"
    cuts_static = False
    title = "gradient checkpointing"

    def step_cost(self, spec, setup: TrainingSetup, hardware) -> Cost:
        return Cost(recompute_fraction=recompute_fraction(spec, setup))

    def search_values(self, setup: TrainingSetup, hardware) -> dict[str, list]:
        return {"checkpointing": list(Checkpointing)}

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
        return Proposal(picked, _change(ctx, mode), checkpointing_cost(ctx.spec, picked), _HOW[mode] if mode in _HOW else _HOW[
            Checkpointing.EVERY_2].replace("2nd", f"{mode.every}th"))


# ---------------------------------------------------------------------------------------- the runtime conversion

# SELECTIVE_OP_POLICY: memfit.selective_op (import-free, so the torch side that runs it imports no technique)


NO_BLOCKS = ("not applicable: no repeated blocks found (an nn.ModuleList or nn.Sequential of 2+ modules of one "
             "class)")


@conversion("checkpointing")
def convert(model, setup: TrainingSetup, target: Target) -> Change:
    """The one 'which wrapper' decision. none / full on a transformers model: HF's own switch (non-reentrant), which
    it supports or not; full on any other module, and selective-op / every-N / attention on any model: memfit's
    block wrapper (memfit._torch.blocks) around the repeated blocks (or `target.blocks`, the engine's FSDP units),
    HF's switch turned off first. Each call puts the model in the setup's mode, undoing another."""
    mode = setup.checkpointing
    if mode not in (Checkpointing.NONE, Checkpointing.FULL):
        return _selective(model, setup, target)
    if target.is_hf:
        return _hf_switch(model, mode is Checkpointing.FULL)
    return _full_blocks(model, mode is Checkpointing.FULL, target)


def _hf_switch(model, want_on: bool) -> Change:
    from .._torch import step as torch_step

    if not getattr(model, "supports_gradient_checkpointing", False):
        return Change("checkpointing", False, f"not applicable: {type(model).__name__} does not support it")
    is_on = torch_step.hf_checkpointing_is_on(model)
    if is_on == want_on:
        return Change("checkpointing", False, f"already {'on' if is_on else 'off'}")
    (torch_step.enable_hf_checkpointing if want_on else torch_step.disable_hf_checkpointing)(model)
    how = "on (HF activation checkpointing, use_reentrant=False)" if want_on else "off, as the setup asks"
    return Change("checkpointing", True, f"turned {how}")


def _blocks_of(model, target: Target) -> tuple[list, str]:
    """(the blocks to wrap, where they are, for the report)."""
    from .._torch import blocks

    if target.blocks is not None:
        return list(target.blocks), "the blocks given"
    found = blocks.named_blocks(model)
    return [block for _, block in found], ", ".join(f"'{name}'" for name in
                                                    blocks.block_containers([name for name, _ in found]))


def _full_blocks(model, want_on: bool, target: Target) -> Change:
    from .._torch import blocks

    block_list, where = _blocks_of(model, target)
    if not block_list:
        if not want_on:
            return Change("checkpointing", False, "already off")
        return Change("checkpointing", False, f"{NO_BLOCKS}; wrap your blocks' forward in "
                                              "torch.utils.checkpoint.checkpoint yourself")
    wrapped = sum(blocks.is_checkpointed(b) for b in block_list)
    if want_on and wrapped == len(block_list):
        return Change("checkpointing", False, f"already on ({wrapped} blocks of {where})")
    if not want_on and wrapped == 0:
        return Change("checkpointing", False, "already off")
    for block in block_list:
        (blocks.checkpoint_block if want_on else blocks.uncheckpoint_block)(block)
    verb = "wrapped" if want_on else "unwrapped"
    return Change("checkpointing", True, f"{verb} the {len(block_list)} blocks of {where} "
                                         "(torch.utils.checkpoint, non-reentrant)")


def _selective(model, setup: TrainingSetup, target: Target) -> Change:
    """selective-op / every-N / attention through memfit's block wrapper (HF's switch is full only)."""
    from .._torch import blocks, step as torch_step

    block_list, where = _blocks_of(model, target)
    if not block_list:
        return Change("checkpointing", False, NO_BLOCKS)
    mode = str(setup.checkpointing)
    before = [(blocks.checkpoint_mode(b), blocks.is_core_checkpointed(b)) for b in block_list]
    hf_was_on = target.is_hf and torch_step.hf_checkpointing_is_on(model)
    if hf_was_on:
        torch_step.disable_hf_checkpointing(model)
    done = blocks.apply_checkpointing(model, mode, None if target.blocks is None else block_list)
    after = [(blocks.checkpoint_mode(b), blocks.is_core_checkpointed(b)) for b in block_list]
    if not done:
        return Change("checkpointing", False, f"not applicable: checkpointing {mode} found no eager attention core "
                                              "to wrap (transformers' eager_attention_forward)")
    if before == after and not hf_was_on:
        return Change("checkpointing", False, f"already {mode} ({done})")
    return Change("checkpointing", True, f"checkpointing {mode}: {done} of {where}")


# ---------------------------------------------------------------------------------------- the emitted fragments

def fsdp2_fragment(setup: TrainingSetup) -> str:
    """The setup's checkpointing in the FSDP2 script memfit emits (memfit.emit.fsdp): `enable_checkpointing(model,
    blocks)`, run before sharding so each fully_shard unit is the checkpointed block; '' without checkpointing."""
    mode = setup.checkpointing
    if mode is Checkpointing.NONE:
        return ""
    if mode is Checkpointing.FULL:
        return _FULL_CHECKPOINTING
    if mode is Checkpointing.SELECTIVE_OP:
        return _SELECTIVE_OP_CHECKPOINTING
    if mode is Checkpointing.ATTENTION:
        return _CORE_CHECKPOINTING
    return _EVERY_N_CHECKPOINTING.replace("EVERY_N = 2", f"EVERY_N = {mode.every}")


_FULL_CHECKPOINTING = '''
def enable_checkpointing(model: nn.Module, blocks: nn.ModuleList) -> None:
    """Recompute each block in backward (non-reentrant): only block inputs stay alive between forward and backward."""
    if getattr(model, "supports_gradient_checkpointing", False):
        # transformers models: activation_checkpointing_enable (5.x) or gradient_checkpointing_enable (4.x).
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for index, block in enumerate(blocks):
        # Wrapped before sharding, so each fully_shard unit is the checkpointed block.
        blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)'''

_SELECTIVE_OP_CHECKPOINTING = '''
''' + SELECTIVE_OP_POLICY + '''


def enable_checkpointing(model: nn.Module, blocks: nn.ModuleList) -> None:
    """Every block under non-reentrant checkpoint with the selective-op policy (transformers' own switch is full
    checkpointing only, so the blocks are wrapped here)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for index, block in enumerate(blocks):
        # Wrapped before sharding, so each fully_shard unit is the checkpointed block.
        blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                           context_fn=selective_op_context)'''

_EVERY_N_CHECKPOINTING = '''
EVERY_N = 2


def enable_checkpointing(model: nn.Module, blocks: nn.ModuleList) -> None:
    """every-N: blocks N-1, 2N-1, ... (0-based) fully checkpointed, the others keep all their activations
    (torchtitan's selective_ac_option = "N")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for index, block in enumerate(blocks):
        if (index + 1) % EVERY_N == 0:
            blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)'''

_CORE_CHECKPOINTING = '''
def enable_checkpointing(model: nn.Module, blocks: nn.ModuleList) -> None:
    """attention (Megatron's selective recompute): only the eager attention core (QK^T, softmax, dropout, x V) of
    each block runs under checkpoint, so its B x H x T x T tensors are rebuilt in backward. transformers looks up
    its modelling module's `eager_attention_forward` on every call; it is wrapped once per module, and only the
    attention modules of these blocks take the checkpointed path. Under SDPA / flash nothing changes: their
    kernels keep no T x T."""
    import sys

    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        for module in block.modules():
            source = sys.modules.get(type(module).__module__)
            original = getattr(source, "eager_attention_forward", None)
            if original is None or not type(module).__name__.endswith("Attention"):
                continue
            if not hasattr(original, "plain_core"):
                def core(attn, *args, _plain=original, **kwargs):
                    if getattr(attn, "recompute_core", False) and attn.training and torch.is_grad_enabled():
                        return checkpoint(_plain, attn, *args, use_reentrant=False, **kwargs)
                    return _plain(attn, *args, **kwargs)

                core.plain_core = original
                source.eager_attention_forward = core
            module.recompute_core = True'''


def _apply_value(setup: TrainingSetup) -> str | None:
    """TrainingArguments checkpoints whole blocks only: any other mode goes to memfit_apply.json."""
    return None if setup.checkpointing in (Checkpointing.NONE, Checkpointing.FULL) else str(setup.checkpointing)


def _apply_parse(value) -> Checkpointing:
    try:
        return Checkpointing.parse(str(value))
    except (ConfigError, ValueError):
        raise ValueError("not a checkpointing mode memfit sizes") from None


apply_item(ApplyItem("checkpointing", _apply_value,
                     "memfit's block wrapper (memfit._torch.blocks, the one the trace and measurements use): "
                     "TrainingArguments checkpoints whole blocks only",
                     lambda value: f"checkpointing {value}", _apply_parse))

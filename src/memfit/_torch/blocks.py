"""Gradient checkpointing for plain nn.Modules: the repeated blocks (children of the largest nn.ModuleList) run
under torch.utils.checkpoint (non-reentrant) in training, the way HF's GradientCheckpointingLayer does it.

The block's class and state_dict keys stay as they are: only the instance's `forward` is replaced, so undoing it is
deleting that attribute.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

_MARK = "_memfit_checkpointed"


def repeated_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(name, ModuleList) of the list with the most children (ties: more parameters); None without one."""
    lists = [(name or "<root>", module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) > 0]
    if not lists:
        return None
    return max(lists, key=lambda item: (len(item[1]), sum(p.numel() for p in item[1].parameters())))


class _CheckpointedForward:
    """Stands in for a block's forward: its own forward under checkpoint while training with grad enabled."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.previous = block.__dict__.get("forward")  # an instance-level forward someone set before us
        self.block = weakref.ref(block)  # no reference cycle through the block's own __dict__

    def __call__(self, *args, **kwargs):
        block = self.block()
        forward = self.previous if self.previous is not None else type(block).forward.__get__(block)
        if block.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)


def checkpoint_block(block: torch.nn.Module) -> bool:
    """Wrap one block; False when it already was."""
    if is_checkpointed(block):
        return False
    block.forward = _CheckpointedForward(block)
    setattr(block, _MARK, True)
    return True


def uncheckpoint_block(block: torch.nn.Module) -> bool:
    if not is_checkpointed(block):
        return False
    wrapper = block.__dict__["forward"]
    if wrapper.previous is not None:
        block.forward = wrapper.previous
    else:
        del block.forward
    delattr(block, _MARK)
    return True


def is_checkpointed(block: torch.nn.Module) -> bool:
    return bool(getattr(block, _MARK, False)) and isinstance(block.__dict__.get("forward"), _CheckpointedForward)

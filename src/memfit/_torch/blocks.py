"""The repeated blocks of a model, and gradient checkpointing around them: one finder and one wrapper, used by
`apply_` (checkpointing a plain module), the sharded engines (FSDP2's units, checkpointing before sharding) and the
tracer (its FSDP2 units and checkpointing of plain modules).

Which blocks: on a transformers model, the modules of the classes it lists in `_no_split_modules` that occur two or
more times (its transformer layers: the unit accelerate's FSDP wrap policy and the tracer shard); otherwise the children of each nn.ModuleList or
nn.Sequential that holds two or more non-leaf modules of one class (transformer layers, stages), outermost lists only.

Checkpointing: the block's forward runs under torch.utils.checkpoint (non-reentrant) while training with grad
enabled, the way HF's GradientCheckpointingLayer does it. The block's class and state_dict keys stay as they are:
only the instance's `forward` is replaced, so undoing it is deleting that attribute. FSDP2's hooks stay on the block
itself: its pre-backward hook gathers the parameters before the recomputation reads them.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

_MARK = "_memfit_checkpointed"


def named_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, block) of every repeated block, in module order (see the module docstring)."""
    listed = set(getattr(model, "_no_split_modules", None) or ())
    if listed:
        found = [(name, module) for name, module in model.named_modules() if type(module).__name__ in listed]
        # only the classes that repeat: a model also lists one-off modules (BERT's BertEmbeddings), whose tied word
        # embedding must stay in the root unit with the head that shares it
        counts: dict[type, int] = {}
        for _, module in found:
            counts[type(module)] = counts.get(type(module), 0) + 1
        repeated = [(name, module) for name, module in found if counts[type(module)] >= 2]
        if repeated or found:
            return repeated or found  # a one-layer model's single layer is still its block
    blocks: list[tuple[str, torch.nn.Module]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside or not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) >= 2 and len({type(c) for _, c in children}) == 1 and _has_children(children[0][1]):
            blocks += [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in children]
            inside.update(id(m) for _, child in children for m in child.modules())
    return blocks


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of `model` (empty when it has none)."""
    return [block for _, block in named_blocks(model)]


def block_containers(names: list[str]) -> list[str]:
    """The modules holding the named blocks ('model.layers' for 'model.layers.0' ...), each once, in order."""
    return list(dict.fromkeys(name.rpartition(".")[0] or "<root>" for name in names))


def _has_children(module: torch.nn.Module) -> bool:
    return any(True for _ in module.children())


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


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> int:
    """Checkpoint every repeated block of `model` (or the given ones); returns how many blocks are checkpointed."""
    blocks = find_blocks(model) if blocks is None else blocks
    for block in blocks:
        checkpoint_block(block)
    return len(blocks)

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

The selective modes (memfit.setup.Checkpointing) run through the same wrapper:

- selective-op: the block runs under checkpoint with torch's selective-checkpoint contexts
  (`create_selective_checkpoint_contexts`) and torchtitan's op policy (torchtitan/distributed/activation_checkpoint.py,
  2025): the outputs of matmuls and of the SDPA kernels are kept, every second matmul of a block and everything
  else (norms, activations, rotary, elementwise ops, casts) is recomputed. torchtitan counts aten.mm only (its
  models have no biases); here aten.addmm counts too, so a biased Linear (Qwen2's q/k/v, GPT-2's Conv1D) is the
  same matmul. The CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) is on the list beside the CUDA
  ones, so CPU steps measure the same policy.
- every-N: blocks N-1, 2N-1, ... (0-based; torchtitan counts the wrapped blocks from 1 and takes count % N == 0)
  are fully checkpointed, the others keep everything.
- attention: Megatron's selective recompute (Korthikanti et al. 2022, arXiv:2205.05198 sec. 4.2): inside every
  block only the eager attention core (QK^T, softmax, dropout, x V) runs under checkpoint; the block itself does
  not. transformers' modelling modules look up their module-level `eager_attention_forward` on each call, so the
  wrapper replaces that function once per modelling module with one that checkpoints the call for attention
  modules marked here and passes every other call through unchanged.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from ..selective_op import SELECTIVE_OP_POLICY

_MARK = "_memfit_checkpointed"
_CORE_MARK = "_memfit_checkpointed_core"
FULL, SELECTIVE_OP = "full", "selective-op"


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


def selective_op_context():
    """The (forward, recompute) contexts of one checkpointed call under the selective-op policy: a fresh matmul
    count per call, one for the forward and one for the recompute, so both make the same choices. The policy is
    memfit.selective_op.SELECTIVE_OP_POLICY, the text the emitted FSDP2 script carries too."""
    return _selective_op_policy()()


@functools.cache
def _selective_op_policy():
    namespace = {"torch": torch}
    exec(compile(SELECTIVE_OP_POLICY, "memfit.selective_op.SELECTIVE_OP_POLICY", "exec"), namespace)
    return namespace["selective_op_context"]


class _CheckpointedForward:
    """Stands in for a block's forward: its own forward under checkpoint while training with grad enabled."""

    def __init__(self, block: torch.nn.Module, mode: str = FULL) -> None:
        self.previous = block.__dict__.get("forward")  # an instance-level forward someone set before us
        self.block = weakref.ref(block)  # no reference cycle through the block's own __dict__
        self.mode = mode

    def __call__(self, *args, **kwargs):
        block = self.block()
        forward = self.previous if self.previous is not None else type(block).forward.__get__(block)
        if block.training and torch.is_grad_enabled():
            if self.mode == SELECTIVE_OP:
                return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_op_context, **kwargs)
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)


def checkpoint_block(block: torch.nn.Module, mode: str = FULL) -> bool:
    """Wrap one block (mode 'full' or 'selective-op'); False when it already was, in that mode."""
    if is_checkpointed(block):
        if block.__dict__["forward"].mode == mode:
            return False
        uncheckpoint_block(block)
    block.forward = _CheckpointedForward(block, mode)
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


def checkpoint_mode(block: torch.nn.Module) -> str | None:
    """'full' / 'selective-op' for a wrapped block, None otherwise."""
    return block.__dict__["forward"].mode if is_checkpointed(block) else None


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> int:
    """Checkpoint every repeated block of `model` (or the given ones); returns how many blocks are checkpointed."""
    blocks = find_blocks(model) if blocks is None else blocks
    for block in blocks:
        checkpoint_block(block)
    return len(blocks)


# ---- the attention core (Megatron's selective recompute) -------------------------------------------------------------

def _core_forward(original):
    def eager_attention_forward(module, *args, **kwargs):
        if getattr(module, _CORE_MARK, False) and module.training and torch.is_grad_enabled():
            return checkpoint(original, module, *args, use_reentrant=False, **kwargs)
        return original(module, *args, **kwargs)

    eager_attention_forward.memfit_original = original
    return eager_attention_forward


def attention_modules(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules inside `block` whose modelling module defines transformers' `eager_attention_forward` and whose
    class is an attention (the callers of that function)."""
    found = []
    for module in block.modules():
        source = sys.modules.get(type(module).__module__)
        if source is not None and callable(getattr(source, "eager_attention_forward", None)) \
                and type(module).__name__.endswith("Attention"):
            found.append(module)
    return found


def checkpoint_attention_core(block: torch.nn.Module) -> int:
    """Mark the block's attention modules so their eager core runs under checkpoint; returns how many."""
    modules = attention_modules(block)
    for module in modules:
        source = sys.modules[type(module).__module__]
        current = source.eager_attention_forward
        if getattr(current, "memfit_original", None) is None:
            source.eager_attention_forward = _core_forward(current)
        setattr(module, _CORE_MARK, True)
    return len(modules)


def uncheckpoint_attention_core(block: torch.nn.Module) -> int:
    """Unmark them (the patched module-level function passes unmarked calls through)."""
    modules = [m for m in block.modules() if getattr(m, _CORE_MARK, False)]
    for module in modules:
        delattr(module, _CORE_MARK)
    return len(modules)


def is_core_checkpointed(block: torch.nn.Module) -> bool:
    return any(getattr(m, _CORE_MARK, False) for m in block.modules())


# ---- one entry point for every mode ----------------------------------------------------------------------------------

def apply_checkpointing(model: torch.nn.Module, mode: str, blocks: list[torch.nn.Module] | None = None) -> str:
    """Put `model`'s repeated blocks (or the given ones) into checkpointing `mode` (memfit.setup.Checkpointing's
    value: none, full, selective-op, every-N, attention), undoing any other mode first. Returns what it did, in
    words ('' when there were no blocks)."""
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        return ""
    wrapped = cores = 0
    every = int(mode.split("-")[1]) if mode.startswith("every-") else None
    for index, block in enumerate(blocks):
        if mode == "attention":
            uncheckpoint_block(block)
            cores += checkpoint_attention_core(block)
            continue
        uncheckpoint_attention_core(block)
        if mode in (FULL, SELECTIVE_OP) or (every is not None and (index + 1) % every == 0):
            checkpoint_block(block, SELECTIVE_OP if mode == SELECTIVE_OP else FULL)
            wrapped += 1
        else:
            uncheckpoint_block(block)
    if mode == "attention":
        return (f"the eager attention core of {cores} attention modules in {len(blocks)} blocks under "
                "torch.utils.checkpoint (Megatron-style selective recompute)" if cores else "")
    if mode == "none":
        return "no block checkpointed"
    how = {SELECTIVE_OP: " with the selective-op policy (matmul and SDPA outputs kept)"}.get(mode, "")
    return f"{wrapped} of {len(blocks)} blocks under torch.utils.checkpoint (non-reentrant){how}"

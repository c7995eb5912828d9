"""torch.compile per block: AOTAutograd's min-cut partitioner saves fewer, cheaper tensors than eager autograd
(pointwise chains recomputed in backward, fused kernels materialise no intermediates). Sized by
memfit.estimate.compiled from the partition of one real block on fake tensors; this rung only proposes it."""

from __future__ import annotations

from ..change import Change
from ..errors import MemfitError
from ..setup import TrainingSetup
from .base import Context, Proposal, Skip, Technique, pin_reason, register
from .costs import compile_cost
from .convert import Target, conversion

CHANGE = ("HF: TrainingArguments(torch_compile=True); torchtune: compile: True; torchtitan: [compile] enable = true "
          "(each block compiled)")
WHY = ("each block keeps what AOTAutograd's min-cut partitioner saves: norm internals, activations and rotary "
       "products recomputed in backward, matmul and attention outputs kept; embedding, LM head and loss stay eager")


@register
class Compile(Technique):
    """Last on the activations ladder: it saves a fifth to a third of a block's activations in the tiny models
    bench/compile.py measures, less than checkpointing, and its cost is compile time and the risk of graph breaks."""

    key = "compile"
    cuts_static = False
    title = "torch.compile (per block)"

    def search_values(self, setup, hardware) -> dict[str, list]:
        return {"compile": [False, True]}

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.compile:
            return Skip("already compiled")
        from ..estimate import compiled

        setup = ctx.setup.replace(compile=True)
        why = compiled.unsized(ctx.spec, setup)
        if why:
            return Skip(f"not sized compiled: {why}")
        if ctx.pinned_changes(setup):
            return Skip(pin_reason(ctx.pinned_changes(setup)))
        if not compiled.fit_ready(ctx.spec, setup, ctx.hardware.is_cpu):
            return Skip("no compiled fit shipped or cached for this model: `memfit plan ... --compile` traces one "
                        "block compiled (seconds) and caches it, then the ladder can weigh it")
        try:
            ctx.size(setup)
        except (MemfitError, RuntimeError) as error:  # the block could not be traced compiled
            return Skip(f"the compiled block could not be traced: {error}")
        return Proposal(setup, CHANGE, compile_cost(), WHY)


@conversion("compile")
def convert(model, setup, target: Target):
    """Each repeated block torch.compile'd in place (memfit._torch.compiled.compile_blocks, as torchtune and
    torchtitan compile), last: over the checkpoint wrappers and adapters. On fake tensors (a trace) the backend is
    AOTAutograd's partition without codegen, the same saved tensors."""
    if not setup.compile:
        return None
    from .._torch import blocks
    from .._torch.compiled import compile_blocks

    found = blocks.find_blocks(model)
    if found and all(getattr(block, "_compiled_call_impl", None) is not None for block in found):
        return Change("compile", False, f"already compiled ({len(found)} blocks)")
    compiled = compile_blocks(model, target.compile_backend)
    if not compiled:
        return Change("compile", False, "not applicable: no repeated blocks to compile")
    return Change("compile", True, f"{compiled} blocks compiled in place (nn.Module.compile, backend "
                                   f"{target.compile_backend})")


def hf_trainer_fragment(setup: TrainingSetup, **_) -> tuple[dict, dict[str, str], list[str]]:
    """(TrainingArguments kwargs, their comments, notes) for the HF Trainer files (memfit.emit.hf_trainer).
    torch.compile: the Trainer compiles the whole model; torchtune and torchtitan compile each block, as memfit
    sizes it (memfit.estimate.compiled)."""
    if not setup.compile:
        return {}, {}, []
    return ({"torch_compile": True},
            {"torch_compile": "torch.compile (inductor): blocks keep what AOTAutograd's min-cut partitioner saves"},
            ["torch.compile is sized per block (torchtune `compile: True`, torchtitan `[compile] enable = true`); "
             "the Trainer's torch_compile compiles the whole model, head and loss included, which memfit sizes "
             "eager. First steps are slow (compilation); a new sequence length recompiles."])

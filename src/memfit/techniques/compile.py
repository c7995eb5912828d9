"""torch.compile per block: AOTAutograd's min-cut partitioner saves fewer, cheaper tensors than eager autograd
(pointwise chains recomputed in backward, fused kernels materialise no intermediates). Sized by
memfit.estimate.compiled from the partition of one real block on fake tensors; this rung only proposes it."""

from __future__ import annotations

from ..errors import MemfitError
from .base import Context, Proposal, Skip, Technique, pin_reason, register

CHANGE = ("HF: TrainingArguments(torch_compile=True); torchtune: compile: True; torchtitan: [compile] enable = true "
          "(each block compiled)")
COST = ("compile time before the first step (tens of seconds to minutes per distinct block, again after each "
        "recompile); dynamic shapes (a new sequence length) recompile unless marked dynamic, and past "
        "torch._dynamo.config.recompile_limit the block runs eager; a graph break splits the block and keeps what "
        "eager keeps at the break. Usually faster per step once compiled")
WHY = ("each block keeps what AOTAutograd's min-cut partitioner saves: norm internals, activations and rotary "
       "products recomputed in backward, matmul and attention outputs kept; embedding, LM head and loss stay eager")


@register
class Compile(Technique):
    """Last on the activations ladder: it saves a fifth to a third of a block's activations in the tiny models
    bench/compile.py measures, less than checkpointing, and its cost is compile time and the risk of graph breaks."""

    key = "compile"
    cuts_static = False
    title = "torch.compile (per block)"

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
        return Proposal(setup, CHANGE, COST, WHY)

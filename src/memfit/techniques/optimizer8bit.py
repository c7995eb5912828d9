"""The low-bit optimizer rung: bitsandbytes 8-bit AdamW, then torchao 4-bit AdamW when 8-bit is not enough.

Paged optimizers (bitsandbytes PagedAdamW8bit, QLoRA's recipe) are not proposed: their states are still device memory
while resident (memfit counts them outside the allocator) and only leave the device when the driver evicts them under
pressure, which costs a host round trip of the states every step. For LoRA / QLoRA the adapters' states are a few
hundred MiB at most, so paging them cannot make a step fit that does not; the rung says so, unless static memory alone
is over the budget by less than the 8-bit states would save (70B QLoRA on a 48 GB card).
"""

from __future__ import annotations

from ..change import Change
from ..setup import Offload, Optimizer
from .base import Context, Proposal, Skip, Technique, register, static_over_budget, with_engine_that_can
from .costs import LOW_BIT_STEP_FACTOR, Cost, low_bit_optimizer_cost
from .convert import Target, conversion


@register
class Adam8bit(Technique):
    key = "adam_8bit"
    title = "8-bit AdamW"

    def step_cost(self, spec, setup, hardware) -> Cost:
        return Cost(step_time_factor=LOW_BIT_STEP_FACTOR if setup.optimizer.state_bits < 32 else 1.0)

    def search_values(self, setup, hardware) -> dict[str, list]:
        """For an Adam: bitsandbytes' 8-bit AdamW and torch's fused AdamW beside the setup's."""
        optimizers = {setup.optimizer}
        if setup.optimizer.is_adam:
            optimizers |= {Optimizer.ADAMW_8BIT, Optimizer.ADAMW_FUSED}
        return {"optimizer": sorted(optimizers)}

    def propose(self, ctx: Context) -> Proposal | Skip:
        opt = ctx.setup.optimizer
        if opt.state_bits < 32:
            return Skip(f"already low-bit states ({opt})")
        if not opt.is_adam:
            return Skip(f"the optimizer is {opt}, not Adam")
        if ctx.setup.offload is not Offload.NONE:
            return Skip("optimizer states are offloaded to the CPU already")
        if ctx.setup.finetune.adapters and not _brings_static_under(ctx):
            states = sum(t.num_bytes for t in ctx.estimate.terms if t.name.startswith("optimizer/"))
            return Skip(f"{ctx.setup.finetune.method} keeps AdamW states for the adapters only "
                        f"({states / 2**20:.0f} MiB): 8-bit or paged states (QLoRA's paged_adamw_8bit, "
                        "--optimizer paged-adamw-8bit) save next to nothing")
        eight = with_engine_that_can(ctx.setup, optimizer=Optimizer.ADAMW_8BIT)
        four = with_engine_that_can(ctx.setup, optimizer=Optimizer.ADAMW_4BIT)
        chosen = ctx.pick([eight])
        if isinstance(chosen, Skip):
            return chosen
        # 4-bit only where it makes the step fit and 8-bit does not: else the least change (the rungs after this
        # one go on from 8-bit)
        if not ctx.fits(chosen) and ctx.fits(four) and not ctx.pinned_changes(four):
            chosen = four
        if chosen.optimizer is Optimizer.ADAMW_4BIT:
            return Proposal(chosen, "TrainingArguments(optim=\"adamw_torch_4bit\")  # torchao.optim.AdamW4bit",
                            low_bit_optimizer_cost(4),
                            "8-bit states are not enough: block-wise 4-bit states, ~1.06 B/param instead of 8 B/param "
                            "(an eighth)")
        return Proposal(chosen, "TrainingArguments(optim=\"adamw_bnb_8bit\")  # bitsandbytes.optim.AdamW8bit",
                        low_bit_optimizer_cost(8),
                        "block-wise 8-bit states: ~2 B/param instead of 8 B/param (a quarter, not a half)")


def _brings_static_under(ctx: Context) -> bool:
    """Whether the adapters' 8-bit states (three quarters of their 32-bit states saved) can bring static memory under
    the budget while it alone is over: then every byte of it counts (70B QLoRA on a 48 GB card, whose 128k-vocabulary
    embeddings peft keeps in fp32), and the walk sizes the real saving."""
    if not static_over_budget(ctx.estimate, ctx.diagnosis):
        return False
    states = sum(t.num_bytes for t in ctx.estimate.terms if t.name.startswith("optimizer/"))
    return states * 3 // 4 >= ctx.diagnosis.static_bytes - ctx.diagnosis.budget_bytes


@conversion("optimizer")
def convert(model, setup, target: Target):
    """The optimizer is the loop's to build (apply_'s `make_optimizer`, memfit._torch.step.make_optimizer): this
    says which, and whether its library is installed."""

    detail = f"build it with applied.make_optimizer(model): {setup.optimizer.kind.describe()}"
    if setup.precision.master_weights:
        detail += " on an fp32 master copy of the bf16 parameters"
    if setup.optimizer.library in ("bitsandbytes", "torchao"):
        import importlib.util

        library = setup.optimizer.library
        if importlib.util.find_spec(library) is None:
            detail += f" -- {library} is not installed: pip install {library}"
    return Change("optimizer", False, detail)

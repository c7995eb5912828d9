from __future__ import annotations

import dataclasses

from ..setup import Sharding
from .base import Context, Proposal, Skip, Technique, register, with_engine_that_can
from .costs import zero_traffic


@register
class ZeroSharding(Technique):
    """ZeRO-1 (optimizer states), -2 (+ gradients), -3 (+ parameters): the cheapest stage that fits."""

    key = "zero"
    title = "ZeRO sharding"

    def propose(self, ctx: Context) -> Proposal | Skip:
        n = ctx.hardware.world_size
        if n < 2:
            return Skip("ZeRO shards over GPUs and this setup has 1; " + _gpus_needed(ctx))
        stages = [s for s in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3) if s.stage > ctx.setup.sharding.stage]
        if not stages:
            return Skip("already ZeRO-3")
        candidates = [with_engine_that_can(ctx.setup, sharding=s, num_gpus=n) for s in stages]
        chosen = ctx.first_fitting(candidates) or candidates[-1]
        stage = chosen.sharding
        change = (f"deepspeed zero_optimization.stage={stage.stage}" if chosen.engine.value == "deepspeed" else
                  {1: "torch ZeroRedundancyOptimizer", 2: "FSDP2 fully_shard(reshard_after_forward=False)",
                   3: "FSDP2 fully_shard per block, then the root"}[stage.stage])
        what = {1: "optimizer states", 2: "optimizer states and gradients",
                3: "parameters, gradients and optimizer states"}[stage.stage]
        why = f"{stage} splits {what} over {n} GPUs"
        if chosen.engine is not ctx.setup.engine:
            why += f" (with DeepSpeed: torch's engines cannot shard this setup, {chosen.optimizer} included)"
        return Proposal(chosen, change, zero_traffic(ctx.spec, chosen), why)


def zero3_gpus_needed(ctx: Context, *, limit: int = 1024) -> int | None:
    """The fewest GPUs (a power of two above the current count, 8 per node) on which the setup fits with ZeRO-3,
    or None up to `limit`."""
    n = 2
    while n <= limit:
        if n > ctx.hardware.world_size:
            hw = dataclasses.replace(ctx.hardware, gpus_per_node=min(n, 8), num_nodes=max(1, n // 8))
            if ctx.fits_on(with_engine_that_can(ctx.setup, sharding=Sharding.ZERO3, num_gpus=n), hw):
                return n
        n *= 2
    return None


def _gpus_needed(ctx: Context) -> str:
    n = zero3_gpus_needed(ctx, limit=512)
    if n is None:
        return "ZeRO-3 alone would not make it fit even on 512 GPUs"
    return f"with ZeRO-3 it would fit on {n} x {ctx.hardware.gpu.name} (--gpus {n})"

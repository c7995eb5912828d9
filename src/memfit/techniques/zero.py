from __future__ import annotations

import dataclasses

from ..setup import Sharding
from .base import Context, Proposal, Skip, Technique, register
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
        candidates = [ctx.setup.replace(sharding=s, num_gpus=n) for s in stages]
        chosen = ctx.first_fitting(candidates) or candidates[-1]
        stage = chosen.sharding
        return Proposal(chosen, f"deepspeed zero_optimization.stage={stage.stage}"
                        + ("  (FSDP2: fully_shard per block)" if stage.stage == 3 else ""),
                        zero_traffic(ctx.spec, chosen),
                        f"{stage} splits {'optimizer states' if stage.stage == 1 else 'optimizer states and gradients' if stage.stage == 2 else 'parameters, gradients and optimizer states'} over {n} GPUs")


def _gpus_needed(ctx: Context) -> str:
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        hw = dataclasses.replace(ctx.hardware, gpus_per_node=min(n, 8), num_nodes=max(1, n // 8))
        if ctx.fits_on(ctx.setup.replace(sharding=Sharding.ZERO3, num_gpus=n), hw):
            return f"with ZeRO-3 it would fit on {n} x {ctx.hardware.gpu.name} (--gpus {n})"
    return "ZeRO-3 alone would not make it fit even on 512 GPUs"

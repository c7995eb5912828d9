from __future__ import annotations

from ..change import Change
from ..errors import ConfigError
from ..setup import Engine, Sharding
from .base import Context, Proposal, Skip, Technique, register, with_engine_that_can
from .convert import Target, conversion
from .costs import Cost, zero_cost, zero_traffic_bytes


@register
class ZeroSharding(Technique):
    """ZeRO-1 (optimizer states), -2 (+ gradients), -3 (+ parameters): the cheapest stage that fits."""

    key = "zero"
    title = "ZeRO sharding"

    def step_cost(self, spec, setup, hardware) -> Cost:
        """Bytes on the wire with more than one GPU (data parallelism without ZeRO too)."""
        return Cost(wire_bytes=zero_traffic_bytes(spec, setup) if setup.num_gpus > 1 else 0)

    def search_values(self, setup, hardware) -> dict[str, list]:
        """No sharding, and every ZeRO stage with more than one GPU."""
        more = [Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3] if hardware.world_size > 1 else []
        return {"sharding": [Sharding.NONE] + more}

    def propose(self, ctx: Context) -> Proposal | Skip:
        n = ctx.hardware.world_size
        if n < 2:
            return Skip("ZeRO shards over GPUs and this setup has 1")
        stages = [s for s in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3) if s.stage > ctx.setup.sharding.stage]
        if not stages:
            return Skip("already ZeRO-3")
        candidates, refused = [], ""
        for stage in stages:
            try:
                candidates.append(with_engine_that_can(ctx.setup, keep=ctx.keep, sharding=stage, num_gpus=n))
            except ConfigError as error:
                refused = str(error)
        if not candidates:
            return Skip(refused)
        chosen = ctx.pick(candidates)
        if isinstance(chosen, Skip):
            return chosen
        stage = chosen.sharding
        change = (f"deepspeed zero_optimization.stage={stage.stage}" if chosen.engine.value == "deepspeed" else
                  {1: "torch ZeroRedundancyOptimizer", 2: "FSDP2 fully_shard(reshard_after_forward=False)",
                   3: "FSDP2 fully_shard per block, then the root"}[stage.stage])
        what = {1: "optimizer states", 2: "optimizer states and gradients",
                3: "parameters, gradients and optimizer states"}[stage.stage]
        why = f"{stage} splits {what} over {n} GPUs"
        if chosen.engine is Engine.DEEPSPEED and ctx.setup.engine is not Engine.DEEPSPEED:
            why += f" (with DeepSpeed: torch's engines cannot shard this setup, {chosen.optimizer} included)"
        elif chosen.engine is not ctx.setup.engine:
            why += (f" (with torch's FSDP2: DeepSpeed cannot shard this setup, "
                    f"{ctx.setup.finetune.method if ctx.setup.finetune.adapters else chosen.optimizer} included)")
        return Proposal(chosen, change, zero_cost(ctx.spec, chosen), why)


@conversion("engine")
def convert(model, setup, target: Target):
    """Sharding and offload need an engine (memfit._torch.engine.prepare, DeepSpeed, FSDP2): said, not done."""
    from ..setup import Offload

    if setup.sharding is Sharding.NONE and setup.offload is Offload.NONE:
        return None
    parts = [f"{setup.sharding} over {setup.num_gpus} GPUs"] if setup.sharding is not Sharding.NONE else []
    parts += [f"offload {setup.offload}"] if setup.offload is not Offload.NONE else []
    return Change("engine", False, f"{' + '.join(parts)} needs an engine (DeepSpeed / FSDP): launch with the config "
                                   "memfit emits; apply_ changes this one process only")

from __future__ import annotations

from ..setup import Offload, Optimizer, Precision, Sharding
from ..units import format_bytes
from .base import Context, Proposal, Skip, Technique, register, with_engine_that_can
from .costs import offload_traffic


@register
class CpuOffload(Technique):
    """ZeRO-Offload: optimizer states (and fp32 master weights) in CPU RAM, the step on the CPU; with ZeRO-3 the
    parameters may follow."""

    key = "cpu_offload"
    title = "CPU offload of optimizer states"

    def propose(self, ctx: Context) -> Proposal | Skip:
        setup = ctx.setup
        if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
            return Skip("optimizer states and parameters are offloaded already")
        if setup.offload is Offload.OPTIMIZER:
            if setup.sharding is not Sharding.ZERO3:
                return Skip("offloading parameters too needs ZeRO-3 (more than one GPU)")
            nxt = with_engine_that_can(setup, offload=Offload.OPTIMIZER_AND_PARAMS)
        else:
            optimizer = Optimizer.ADAMW if setup.optimizer is Optimizer.ADAMW_8BIT else setup.optimizer
            precision = Precision.BF16_MASTER if setup.precision is Precision.BF16 else setup.precision
            nxt = with_engine_that_can(setup, offload=Offload.OPTIMIZER, optimizer=optimizer, precision=precision)
        host_need = ctx.size(nxt).cpu_bytes * ctx.hardware.gpus_per_node
        if host_need > ctx.hardware.cpu_ram_bytes:
            return Skip(f"offload needs {format_bytes(host_need)} of CPU RAM per node, more than the "
                        f"{format_bytes(ctx.hardware.cpu_ram_bytes)} given (--cpu-ram)")
        change = ("deepspeed offload_optimizer.device=cpu" if nxt.offload is Offload.OPTIMIZER
                  else "deepspeed offload_param.device=cpu")
        why = ("optimizer states are used once per step: keep them (and the fp32 master weights) in "
               f"CPU RAM ({format_bytes(host_need)} per node) and step there")
        if nxt.optimizer is not setup.optimizer or nxt.precision is not setup.precision:
            why += ("; DeepSpeed's CPU Adam steps fp32 states against an fp32 master copy, so it takes neither "
                    "8-bit states nor pure bf16 weights")
        return Proposal(nxt, change, offload_traffic(ctx.spec, nxt, ctx.hardware), why)

"""Costs a technique adds, in the units users weigh: compute, bytes over the wire per step, seconds."""

from __future__ import annotations

from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Offload, TrainingSetup
from ..units import format_bytes


def zero_traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Bytes each rank sends per optimizer step. ZeRO paper sec. 7: stages 1-2 move 2 x Psi (reduce-scatter of
    gradients + all-gather of parameters), like DDP's all-reduce; stage 3 moves 3 x Psi (parameters gathered in
    forward and again in backward). Psi in bf16/fp16 gradient bytes."""
    psi = 2 * spec.num_params
    return (3 if setup.sharding.stage == 3 else 2) * psi


def zero_traffic(spec: ModelSpec, setup: TrainingSetup) -> str:
    factor = "1.5x" if setup.sharding.stage == 3 else "1x"
    return (f"{format_bytes(zero_traffic_bytes(spec, setup))} per rank per step over the interconnect "
            f"({factor} DDP's all-reduce)")


def offload_traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Host<->device bytes per optimizer step per rank: bf16 gradients down, bf16 parameters up (ZeRO-Offload,
    Ren et al. 2021); with parameter offload the parameters also cross twice more (forward and backward)."""
    shard = setup.num_gpus if setup.sharding.stage >= 2 else 1
    traffic = 2 * 2 * spec.num_params // shard
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        traffic += 2 * 2 * spec.num_params // setup.num_gpus
    return traffic


def offload_traffic(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> str:
    traffic = offload_traffic_bytes(spec, setup)
    seconds = traffic / (hardware.gpu.host_link_gbps * 1e9)
    return (f"{format_bytes(traffic)} over PCIe per step (~{seconds:.2f} s at {hardware.gpu.host_link_gbps:g} GB/s) "
            "and a CPU optimizer step")

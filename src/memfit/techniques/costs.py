"""Costs a technique adds, in the units users weigh: compute, bytes over the wire per step, seconds."""

from __future__ import annotations

from ..estimate.comm import comm_volume, data_parallel_bytes, describe_runtime
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Offload, TrainingSetup
from ..units import format_bytes


def zero_traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Bytes each rank sends per optimizer step on the setup's engine and ZeRO stage: memfit.estimate.comm, the one
    communication model (the ZeRO paper's 2 Psi / 3 Psi where the engine does what the paper does)."""
    return comm_volume(spec, setup).per_rank_bytes


def zero_traffic(spec: ModelSpec, setup: TrainingSetup) -> str:
    volume = comm_volume(spec, setup)
    baseline = data_parallel_bytes(spec, setup)
    ratio = f", {volume.per_rank_bytes / baseline:.3g}x its data-parallel all-reduce" if baseline else ""
    return (f"{format_bytes(volume.per_rank_bytes)} per rank per step over the interconnect "
            f"({volume.psi_multiple:.3g} x Psi, {describe_runtime(setup)}{ratio})")


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
    link = hardware.gpu.host_link_gb_per_s
    seconds = traffic / (link * 1e9)
    return f"{format_bytes(traffic)} over PCIe per step (~{seconds:.2f} s at {link:g} GB/s) and a CPU optimizer step"

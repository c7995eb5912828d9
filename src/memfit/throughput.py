"""A coarse step-time model for ranking setups that fit (`memfit plan --optimize`). Relative, not absolute.

time/sample = (compute + exposed communication + offload) / effective batch, where
- compute = 6 P tokens FLOPs (Kaplan et al. 2020), 8 P tokens with full checkpointing (one extra forward), at a
  model FLOP utilisation that falls for small micro-batches (fewer tokens per matmul), for eager attention and for
  fp32 (the techniques' `mfu_factor`);
- ZeRO traffic (ZeRO paper sec. 7) over NVLink within a node or the network across nodes, half of it hidden
  behind compute;
- offload: the engine's host<->device copies over PCIe (techniques.costs.offload_traffic_bytes) and a CPU Adam
  step at ~1e9 params/s per rank (CPU_ADAM_PARAMS_PER_S).
Every technique's part is its typed Cost (Technique.step_cost, memfit.techniques.costs), the numbers the ladder
prints.
"""

from __future__ import annotations

from .hardware import Hardware
from .model_spec import ModelSpec
from .setup import TrainingSetup
from .techniques.costs import CPU_ADAM_PARAMS_PER_S  # noqa: F401  (re-exported: the model's CPU Adam rate)
from .techniques import REGISTRY
from .techniques.costs import Cost, combined


def step_cost(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost:
    """What the setup's techniques cost a step together: each registered technique's typed Cost (its step_cost),
    the same numbers the ladder prints."""
    return combined(cost for technique in REGISTRY.values()
                    if (cost := technique.step_cost(spec, setup, hardware)) is not None)

NVLINK_BYTES_PER_S = 200e9
NETWORK_BYTES_PER_S = 25e9
BASE_MFU = 0.45


def relative_step_time(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> float:
    """Modelled seconds per training sample (per rank); only ratios between setups are meaningful."""
    tokens = setup.micro_batch_size * setup.seq_len * setup.grad_accum_steps
    cost = step_cost(spec, setup, hardware)
    flops_per_token = 6 * spec.num_params * (1 + cost.recompute_fraction)
    mfu = BASE_MFU * min(1.0, (setup.micro_batch_size * setup.seq_len / 4096) ** 0.25) * cost.mfu_factor
    peak = (hardware.gpu.peak_tflops_bf16 or 100.0) * 1e12
    compute = tokens * flops_per_token / (peak * mfu) * cost.step_time_factor
    comm = 0.0
    if setup.num_gpus > 1:
        link = NVLINK_BYTES_PER_S if hardware.num_nodes == 1 else NETWORK_BYTES_PER_S
        comm = 0.5 * cost.wire_bytes / link
    offload = cost.host_link_seconds + cost.cpu_step_seconds
    return (compute + comm + offload) / (setup.micro_batch_size * setup.grad_accum_steps)

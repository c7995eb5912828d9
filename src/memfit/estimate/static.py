"""Static memory: parameters, gradients and optimizer states, per rank, with the engines' real dtypes.

Sources: ZeRO (Rajbhandari et al., 2020, arXiv:1910.02054) section 3.1 counts mixed-precision Adam at 2 + 2 + 12 bytes
per parameter and gives the per-rank split of each stage; torch.optim.adamw (_single_tensor_adamw /
_multi_tensor_adamw) for the step temporaries; bitsandbytes Optimizer8bit (block-wise quantisation, 256-element
blocks, fp32 state below min_8bit_size=4096 elements) for 8-bit AdamW; transformers.optimization.Adafactor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model_spec import ModelSpec
from ..setup import Offload, Optimizer, Precision, Sharding, TrainingSetup

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes: tensors smaller than this keep 32-bit state
BNB_BLOCK = 256  # bitsandbytes blockwise quantisation: one fp32 absmax per 256 elements


@dataclass(frozen=True)
class StaticBytes:
    """Full-model (unsharded) sizes; sharding is applied by the caller."""

    params: int
    grads: int
    states: int
    master: int
    step_temp: int
    param_bytes_per_elem: int
    state_formula: str


def param_elem_bytes(precision: Precision) -> int:
    return 2 if precision.param_dtype == "bf16" else 4


def optimizer_state_bytes(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
    p_bytes = param_elem_bytes(setup.precision)
    # With fp32 master weights (bf16-master) or CPU offload the states are fp32 whatever the param dtype.
    s_bytes = 4 if setup.precision.master_weights or setup.offload is not Offload.NONE else p_bytes
    n_tensors = sum(p.count for p in spec.params)
    opt = setup.optimizer
    if opt.is_adam and opt is not Optimizer.ADAMW_8BIT:
        step = 4 * n_tensors if setup.offload is Offload.NONE else 0  # one fp32 'step' scalar tensor per param
        return 2 * s_bytes * spec.num_params + step, f"2 states x {s_bytes} B x P (exp_avg, exp_avg_sq)"
    if opt is Optimizer.ADAMW_8BIT:
        total = 0
        for p in spec.params:
            if p.numel < BNB_MIN_8BIT_SIZE:
                total += 2 * 4 * p.numel * p.count
            else:
                total += (2 * p.numel + 2 * 4 * math.ceil(p.numel / BNB_BLOCK)) * p.count
        total += 2 * 4 * 256  # the two shared dynamic quantisation maps (qmap1, qmap2), fp32[256]
        return total, "2 x uint8 x P + fp32 absmax per 256 elements (fp32 states for tensors < 4096 elements)"
    if opt is Optimizer.SGD:
        return s_bytes * spec.num_params, f"momentum buffer {s_bytes} B x P"
    return _adafactor_bytes(spec, s_bytes), "factored 2nd moment: rows + cols per matrix, full for vectors"


def _adafactor_bytes(spec: ModelSpec, s_bytes: int) -> int:
    total = 0
    for p in spec.params:
        shape = getattr(p, "shape", ()) or ()
        if len(shape) >= 2:
            per = shape[-1] + math.prod(shape[:-1])
        elif "weight" in p.name and "norm" not in p.name and "ln" not in p.name and p.numel > 4096:
            side = math.isqrt(p.numel)  # shape unknown: a square matrix is the conservative guess
            per = 2 * side
        else:
            per = p.numel
        total += (per * s_bytes + 4) * p.count  # + the fp32 'RMS' scalar
    return total


def optimizer_step_temp_bytes(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
    """Transient memory of the optimizer step on the device (0 when the step runs on the CPU)."""
    if setup.offload is not Offload.NONE:
        return 0, "step runs on the CPU (DeepSpeed CPU Adam)"
    p_bytes = 4 if setup.precision.master_weights else param_elem_bytes(setup.precision)
    largest = max((p.numel for p in spec.params), default=0)
    opt = setup.optimizer
    if opt is Optimizer.ADAMW:
        return 2 * largest * p_bytes, "exp_avg_sq.sqrt() / bias_correction: 2 x the largest tensor"
    if opt is Optimizer.ADAMW_FOREACH:
        return spec.num_params * p_bytes, "_foreach_sqrt(exp_avg_sq): one parameter-sized temporary"
    if opt is Optimizer.ADAFACTOR:
        extra = 2 if p_bytes == 2 else 0  # bf16 params are upcast: p.float() and grad.float()
        return (3 + extra) * largest * 4, "grad**2, factored update and scale: ~3 fp32 copies of the largest tensor"
    return 0, "in-place update"


def full_static(spec: ModelSpec, setup: TrainingSetup) -> StaticBytes:
    p_bytes = param_elem_bytes(setup.precision)
    states, formula = optimizer_state_bytes(spec, setup)
    temp, _ = optimizer_step_temp_bytes(spec, setup)
    master = 4 * spec.num_params if setup.precision.master_weights else 0
    return StaticBytes(params=p_bytes * spec.num_params, grads=p_bytes * spec.num_params, states=states,
                       master=master, step_temp=temp, param_bytes_per_elem=p_bytes, state_formula=formula)


@dataclass(frozen=True)
class ShardedStatic:
    """Per-rank resident bytes on the device and on the host."""

    params: int
    grads: int
    optimizer: int
    cpu: int
    param_working_set: int
    """ZeRO-3: unsharded parameters of the blocks being computed (all-gather buffers), beyond the shard."""


def shard(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes) -> ShardedStatic:
    n = setup.num_gpus
    stage = setup.sharding.stage
    params = full.params // n if stage >= 3 else full.params
    grads = full.grads // n if stage >= 2 else full.grads
    optimizer = (full.states + full.master) // n if stage >= 1 else full.states + full.master
    cpu = 0
    if setup.offload is not Offload.NONE:
        # ZeRO-Offload keeps fp32 master weights, fp32 gradients and the states in host RAM (per rank's shard)
        fp32_master = 4 * spec.num_params if full.params != 4 * spec.num_params else 0
        cpu = (full.states + fp32_master + 4 * spec.num_params) // (n if stage >= 1 else 1)
        optimizer = 0
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        cpu += params
        params = 0
    working = 0
    if setup.sharding is Sharding.ZERO3:
        per_layer = sum(p.numel for p in spec.params if ".*." in p.name)
        outer = spec.num_params - sum(p.total for p in spec.params if ".*." in p.name)
        # Unsharded copies live beside the shards: the root module (embeddings, final norm, LM head), gathered for
        # the whole forward and backward, and the block being computed. At the activation peak (start of backward)
        # that is one block; FSDP2 traces over a fake process group show exactly root + 1 block there.
        working = full.param_bytes_per_elem * (per_layer + outer)
    return ShardedStatic(params=params, grads=grads, optimizer=optimizer, cpu=cpu, param_working_set=working)

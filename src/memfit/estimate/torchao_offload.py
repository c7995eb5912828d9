"""torchao's CPUOffloadOptimizer (torchao/optim/cpu_offload.py, torchao 0.18): the optimizer states and the step on
the CPU for single-GPU training, with or without `offload_gradients`. Not DeepSpeed's ZeRO-Offload: nothing is cast
and there is no fp32 master copy; the wrapper keeps the model as it is and mirrors each large parameter on the host.

What its code holds, per trainable parameter tensor of at least `minimal_size` (4096) elements:
- device: the parameter in the model's dtype, updated in place by a non-blocking H2D copy after the CPU step (no
  device temporary); its gradient until backward's post-accumulate-grad hook has copied it to the host, and with
  offload_gradients=True the hook frees it right after the D2H copy (record_stream keeps it until the copy on the
  side stream ends: one such gradient in flight at a time is what memfit counts, which holds while the D2H copies
  keep pace with backward; where PCIe is slower than backward makes gradients, more wait on the side stream and
  the device holds more: not modelled, a lower bound there);
- host: `torch.empty_like(p, device="cpu", pin_memory=True)` for the parameter and the same for its gradient (the
  model's dtype, pinned), and the base optimizer built on that host parameter, whose states therefore have the
  model's dtype too (AdamW: exp_avg and exp_avg_sq, zeros_like(param)); fused CPU AdamW by default.
Smaller tensors (norms, biases) are `retained_params`: one on-device optimizer (`d_opt`) with their states, gradients
and step on the GPU, as without the wrapper.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .lora import adapted_spec
from .static import (optimizer_state_bytes, optimizer_step_temp_bytes, param_elem_bytes,
                     trainable_bytes)

if TYPE_CHECKING:
    from ..model_spec import ModelSpec
    from ..setup import TrainingSetup
    from .static import ShardedStatic, StaticBytes

MINIMAL_SIZE = 4096
"""CPUOffloadOptimizer(minimal_size=4096): tensors with fewer elements stay on the device with `d_opt`."""
SOURCE = "torchao/optim/cpu_offload.py CPUOffloadOptimizer (torchao 0.18)"


def applies(setup: TrainingSetup) -> bool:
    return setup.cpu_offload_optimizer.value != "off"


def offload_gradients(setup: TrainingSetup) -> bool:
    return setup.cpu_offload_optimizer.value == "grads"


def problems(setup: TrainingSetup) -> list[str]:
    """What memfit sizes of CPUOffloadOptimizer: one GPU, torch's own optimizers, no fp32 master copy (the wrapper
    keeps none), and offload_gradients without accumulation (torchao: 'Not compatible with gradient accumulation':
    each micro-step's host copy overwrites the last)."""
    if not applies(setup):
        return []
    out = []
    if (setup.num_gpus > 1 or setup.sharding.value != "none" or setup.offload.value != "none" or setup.tp > 1
            or setup.pp > 1 or setup.cp > 1):
        out.append("torchao's CPUOffloadOptimizer is for single-GPU training: drop sharding, offload and model "
                   "parallelism, or use --offload optimizer (DeepSpeed ZeRO-Offload)")
    if setup.optimizer.library != "torch":
        out.append(f"CPUOffloadOptimizer is sized with torch.optim optimizers, got {setup.optimizer}")
    if setup.precision.master_weights or setup.precision.value == "amp-fp16":
        out.append(f"CPUOffloadOptimizer is sized with fp32, amp-bf16 or pure bf16 weights (it keeps no fp32 master "
                   f"copy), got {setup.precision}")
    if offload_gradients(setup) and setup.grad_accum_steps > 1:
        out.append("CPUOffloadOptimizer(offload_gradients=True) does not accumulate gradients (each micro-step's "
                   "host copy overwrites the last): use --cpu-offload-optimizer on, or accumulation 1")
    if setup.optimizer_in_backward:
        out.append("CPUOffloadOptimizer steps after backward: drop --optimizer-in-backward")
    return out


def _part(spec: ModelSpec, offloaded: bool) -> ModelSpec:
    """The trainable tensors the wrapper offloads (`offloaded`) or keeps on the device with `d_opt`."""
    return dataclasses.replace(spec, params=tuple(p for p in spec.params if (p.numel >= MINIMAL_SIZE) == offloaded))


def layout(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes, s: ShardedStatic) -> ShardedStatic:
    """Device and host bytes as the wrapper lays them out (module docstring): each part's states as its own optimizer
    keeps them (the host optimizers' scalar `step` counters included)."""

    pb = full.param_bytes_per_elem
    host_part, device_part = _part(spec, True), _part(spec, False)
    off, kept = trainable_bytes(host_part, pb), trainable_bytes(device_part, pb)
    largest = max((p.nbytes or p.numel * pb for p in host_part.params), default=0)
    # the host copy and its gradient (torch.empty_like(p, device="cpu", pin_memory=True), twice) and the states
    host = 2 * off + optimizer_state_bytes(host_part, setup)[0]
    grads = kept + largest if offload_gradients(setup) else s.grads_bytes
    notes = (f"torchao CPUOffloadOptimizer: tensors of {MINIMAL_SIZE}+ elements have a pinned host copy and host "
             f"gradient in the model's dtype and their {setup.optimizer} states on the host, stepped there; smaller "
             "ones stay on the GPU with their states",
             "gradients leave for the host in backward and are freed (offload_gradients=True): one in flight "
             "counted, more while the PCIe copies fall behind backward"
             if offload_gradients(setup) else "gradients stay on the GPU until zero_grad (offload_gradients=False)")
    return dataclasses.replace(s, grads_bytes=grads, optimizer_bytes=optimizer_state_bytes(device_part, setup)[0],
                               cpu_bytes=host, notes=s.notes + notes)


def offloaded_spec(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    """The tensors the CPU steps, from a model's spec as the callers hold it (adapters: the adapted one's)."""
    if setup.finetune.adapters:

        spec = adapted_spec(spec, setup)
    return _part(spec, True)


def traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Host<->device bytes per optimizer step: every micro-step's backward hook copies each offloaded gradient down
    (p_host.grad.copy_), the step copies each offloaded parameter back up (p_device.copy_(p_host)), both in the
    model's dtype."""

    off = trainable_bytes(offloaded_spec(spec, setup), param_elem_bytes(setup.precision))
    return off * (setup.grad_accum_steps + 1)


def step_temp_bytes(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
    """The device part of the step: `d_opt` on the retained small tensors only (the rest steps on the CPU)."""

    temp, formula = optimizer_step_temp_bytes(_part(spec, False), dataclasses.replace(setup, cpu_offload_optimizer="off"))
    return temp, f"on-device optimizer of the tensors under {MINIMAL_SIZE} elements: {formula}"


def code(setup: TrainingSetup) -> str:
    """The line that builds it, with the base optimizer's kernel as memfit sizes it."""
    # torchao adds fused=True to torch.optim.AdamW unless told: the other two kernels say fused=False
    kernel = {"adamw-fused": "fused=True", "adamw-foreach": "fused=False, foreach=True",
              "adamw": "fused=False, foreach=False"}.get(setup.optimizer.value, "")
    args = ", ".join(a for a in ("model.parameters()", setup.optimizer.kind.cls,
                                 f"offload_gradients={offload_gradients(setup)}", kernel) if a)
    return f"from torchao.optim import CPUOffloadOptimizer\noptimizer = CPUOffloadOptimizer({args})"

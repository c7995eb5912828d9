"""torchao's CPUOffloadOptimizer (torchao/optim/cpu_offload.py, torchao 0.18), the whole technique in one module: its
setup field, its checks, its static layout and optimizer-step temporaries, its cost, its place in the CPU offload
rung, its runtime note, its HF Trainer note and its torchtune reader. Nothing else in memfit names it: the module
registers each part where the core, the ladder, the emitters and the readers look for registered parts
(docs/design.md, "Adding a technique").

The optimizer states and the step on the CPU for single-GPU training, with or without `offload_gradients`. Not
DeepSpeed's ZeRO-Offload: nothing is cast and there is no fp32 master copy; the wrapper keeps the model as it is and
mirrors each large parameter on the host.

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..change import Change
from ..choice import Choice
from ..estimate.lora import adapted_spec
from ..estimate.static import (ShardedStatic, StaticBytes, optimizer_state_bytes, optimizer_step_temp_bytes,
                               param_elem_bytes, trainable_bytes)
from ..fields import Option, TechniqueSection, setting, technique_section
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Optimizer, TrainingSetup
from .base import Technique, fragment, register
from .convert import Target, conversion
from .costs import CPU_ADAM_PARAMS_PER_S, Cost, host_link_seconds, host_step_cost
from .offload import one_gpu_alternative

MINIMAL_SIZE = 4096
"""CPUOffloadOptimizer(minimal_size=4096): tensors with fewer elements stay on the device with `d_opt`."""
SOURCE = "torchao/optim/cpu_offload.py CPUOffloadOptimizer (torchao 0.18)"


class CpuOffloadOptimizer(Choice):
    """torchao's CPUOffloadOptimizer on one GPU: states and step on the host."""

    OFF = "off"
    ON = "on"  # offload_gradients=False: gradients stay on the GPU until zero_grad
    GRADS = "grads"  # offload_gradients=True: each gradient freed once copied to the host

    def aliases(self) -> tuple[str, ...]:
        return {"off": ("none", "no", "false"), "on": ("yes", "true", "torchao"),
                "grads": ("offload-gradients", "offload_gradients")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "torchao CPU offload"


# ---- the config section: the setup's field, its option, label and checks --------------------------------------

@technique_section
@dataclass(frozen=True)
class TorchaoOffload(TechniqueSection):
    """torchao.optim.CPUOffloadOptimizer as TrainingSetup holds it (`setup.cpu_offload_optimizer`)."""

    key = "torchao_offload"

    cpu_offload_optimizer: CpuOffloadOptimizer = setting(
        CpuOffloadOptimizer.OFF, section="optimizer", label="torchao CPU offload", option=Option(
            ("--cpu-offload-optimizer",), "{choices}: torchao.optim.CPUOffloadOptimizer on one GPU, the states and "
            "step on the host (on: offload_gradients=False; grads: True, no accumulation). Default: off.", "choice",
            page="Sharding, offload and parallelism"))
    """torchao.optim.CPUOffloadOptimizer (on: offload_gradients=False; grads: True) on one GPU."""

    @property
    def offload_gradients(self) -> bool:
        return self.cpu_offload_optimizer is CpuOffloadOptimizer.GRADS

    def problems(self, setup: TrainingSetup) -> list[str]:
        """What memfit sizes of CPUOffloadOptimizer: one GPU, torch's own optimizers, no fp32 master copy (the
        wrapper keeps none), and offload_gradients without accumulation (torchao: 'Not compatible with gradient
        accumulation': each micro-step's host copy overwrites the last)."""
        out = []
        if (setup.num_gpus > 1 or setup.sharding.value != "none" or setup.offload.value != "none" or setup.tp > 1
                or setup.pp > 1 or setup.cp > 1):
            out.append("torchao's CPUOffloadOptimizer is for single-GPU training: drop sharding, offload and model "
                       "parallelism, or use --offload optimizer (DeepSpeed ZeRO-Offload)")
        if setup.optimizer.library != "torch":
            out.append(f"CPUOffloadOptimizer is sized with torch.optim optimizers, got {setup.optimizer}")
        if setup.precision.master_weights or setup.precision.value == "amp-fp16":
            out.append(f"CPUOffloadOptimizer is sized with fp32, amp-bf16 or pure bf16 weights (it keeps no fp32 "
                       f"master copy), got {setup.precision}")
        if self.offload_gradients and setup.grad_accum_steps > 1:
            out.append("CPUOffloadOptimizer(offload_gradients=True) does not accumulate gradients (each micro-step's "
                       "host copy overwrites the last): use --cpu-offload-optimizer on, or accumulation 1")
        if setup.optimizer_in_backward:
            out.append("CPUOffloadOptimizer steps after backward: drop --optimizer-in-backward")
        return out

    def describe(self) -> str:
        return f", torchao CPU offload {self.cpu_offload_optimizer}"

    # ---- its change to the step model (memfit.estimate.static calls these for every section it holds) ----

    def step_temp_bytes(self, spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
        """The device part of the step: `d_opt` on the retained small tensors only (the rest steps on the CPU)."""
        temp, formula = optimizer_step_temp_bytes(_part(spec, False), _without(setup))
        return temp, f"on-device optimizer of the tensors under {MINIMAL_SIZE} elements: {formula}"

    def static_layout(self, spec: ModelSpec, setup: TrainingSetup, full: StaticBytes,
                      s: ShardedStatic) -> ShardedStatic:
        """Device and host bytes as the wrapper lays them out (module docstring): each part's states as its own
        optimizer keeps them (the host optimizers' scalar `step` counters included)."""
        pb = full.param_bytes_per_elem
        host_part, device_part = _part(spec, True), _part(spec, False)
        off, kept = trainable_bytes(host_part, pb), trainable_bytes(device_part, pb)
        largest = max((p.nbytes or p.numel * pb for p in host_part.params), default=0)
        # the host copy and its gradient (torch.empty_like(p, device="cpu", pin_memory=True), twice) and the states
        host = 2 * off + optimizer_state_bytes(host_part, setup)[0]
        grads = kept + largest if self.offload_gradients else s.grads_bytes
        notes = (f"torchao CPUOffloadOptimizer: tensors of {MINIMAL_SIZE}+ elements have a pinned host copy and host "
                 f"gradient in the model's dtype and their {setup.optimizer} states on the host, stepped there; "
                 "smaller ones stay on the GPU with their states",
                 "gradients leave for the host in backward and are freed (offload_gradients=True): one in flight "
                 "counted, more while the PCIe copies fall behind backward"
                 if self.offload_gradients else "gradients stay on the GPU until zero_grad (offload_gradients=False)")
        return dataclasses.replace(s, grads_bytes=grads, optimizer_bytes=optimizer_state_bytes(device_part, setup)[0],
                                   cpu_bytes=host, notes=s.notes + notes)


def section(setup: TrainingSetup) -> TorchaoOffload:
    return setup.technique(TorchaoOffload)


def applies(setup: TrainingSetup) -> bool:
    return section(setup).cpu_offload_optimizer is not CpuOffloadOptimizer.OFF


def _without(setup: TrainingSetup) -> TrainingSetup:
    return setup.replace(cpu_offload_optimizer=CpuOffloadOptimizer.OFF)


def _part(spec: ModelSpec, offloaded: bool) -> ModelSpec:
    """The trainable tensors the wrapper offloads (`offloaded`) or keeps on the device with `d_opt`."""
    return dataclasses.replace(spec, params=tuple(p for p in spec.params if (p.numel >= MINIMAL_SIZE) == offloaded))


def offloaded_spec(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    """The tensors the CPU steps, from a model's spec as the callers hold it (adapters: the adapted one's)."""
    if setup.finetune.adapters:
        spec = adapted_spec(spec, setup)
    return _part(spec, True)


# ---- its cost: host copies and the CPU step ----------------------------------------------------------------------

def traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Host<->device bytes per optimizer step: every micro-step's backward hook copies each offloaded gradient down
    (p_host.grad.copy_), the step copies each offloaded parameter back up (p_device.copy_(p_host)), both in the
    model's dtype."""
    off = trainable_bytes(offloaded_spec(spec, setup), param_elem_bytes(setup.precision))
    return off * (setup.grad_accum_steps + 1)


def cpu_step_seconds(spec: ModelSpec, setup: TrainingSetup) -> float:
    """The CPU AdamW over the offloaded tensors, at DeepSpeed's CPU Adam rate (memfit.techniques.costs)."""
    return offloaded_spec(spec, setup).num_params / CPU_ADAM_PARAMS_PER_S


@register
class TorchaoCpuOffload(Technique):
    """Its step cost for memfit.throughput (the CPU offload rung proposes it: TorchaoHostStep). Not a rung of its own
    and not searched by `plan --optimize` (memfit.techniques.base.SEARCH)."""

    key = "torchao_offload"
    title = "torchao CPUOffloadOptimizer"

    def propose(self, ctx):
        raise NotImplementedError("proposed by the CPU offload rung (memfit.techniques.offload)")

    def step_cost(self, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost:
        if not applies(setup):
            return Cost()
        traffic = traffic_bytes(spec, setup)
        return Cost(host_link_bytes=traffic, host_link_seconds=host_link_seconds(traffic, hardware),
                    cpu_step_seconds=cpu_step_seconds(spec, setup))


# ---- its place in the CPU offload rung (one GPU, after DeepSpeed's candidates) -----------------------------------

@one_gpu_alternative
class TorchaoHostStep:
    """CPUOffloadOptimizer(offload_gradients=True) on the user's own setup: no DeepSpeed, no cast, no master copy."""

    name = "torchao CPUOffloadOptimizer"

    @staticmethod
    def applies(setup: TrainingSetup) -> bool:
        return applies(setup)

    @staticmethod
    def candidate(setup: TrainingSetup) -> TrainingSetup:
        return setup.replace(cpu_offload_optimizer=CpuOffloadOptimizer.GRADS)

    @staticmethod
    def change(setup: TrainingSetup) -> str:
        return code(setup).splitlines()[-1]

    @staticmethod
    def why(ram: str) -> str:
        return (f"DeepSpeed's candidates do not fit or change what --keep pins: torchao's CPUOffloadOptimizer keeps "
                f"the model as it is, mirrors each tensor of {MINIMAL_SIZE}+ elements with its gradient and optimizer "
                f"states in pinned {ram}, steps there and frees each gradient once copied")

    @staticmethod
    def cost(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost:
        return host_step_cost(traffic_bytes(spec, setup), cpu_step_seconds(spec, setup), setup, hardware)


# ---- the code that builds it: the HF Trainer note, the runtime note ----------------------------------------------

def code(setup: TrainingSetup) -> str:
    """The line that builds it, with the base optimizer's kernel as memfit sizes it."""
    # torchao adds fused=True to torch.optim.AdamW unless told: the other two kernels say fused=False
    kernel = {"adamw-fused": "fused=True", "adamw-foreach": "fused=False, foreach=True",
              "adamw": "fused=False, foreach=False"}.get(setup.optimizer.value, "")
    args = ", ".join(a for a in ("model.parameters()", setup.optimizer.kind.cls,
                                 f"offload_gradients={section(setup).offload_gradients}", kernel) if a)
    return f"from torchao.optim import CPUOffloadOptimizer\noptimizer = CPUOffloadOptimizer({args})"


@fragment("hf_trainer")
def hf_trainer_fragment(setup: TrainingSetup, **_) -> tuple[dict, dict[str, str], list[str]]:
    """TrainingArguments has no name for it: the Trainer takes the built optimizer."""
    if not applies(setup):
        return {}, {}, []
    return {}, {}, ["torchao CPU offload: build the optimizer yourself and pass it as Trainer(..., optimizers="
                    "(optimizer, None)), which overrides `optim`:\n" + code(setup)]


@conversion("optimizer")
def convert(model, setup: TrainingSetup, target: Target) -> Change | None:
    """Its runtime conversion (apply_, the HF model builder, the trace and the engines run it after the optimizer's
    own): nothing on the model; the wrapper needs a CUDA or XPU device and the loop's optimizer, so it says what the
    caller builds."""
    if not applies(setup):
        return None
    return Change("optimizer", False, "wrap it yourself (torchao asserts a CUDA or XPU device): "
                  + code(setup).replace("\n", "; "))


# ---- its torchtune reader ----------------------------------------------------------------------------------------

def _truthy(value: Any) -> bool:
    """What the config readers (memfit.readers._mapper) take for true (an enum by its value)."""
    return getattr(value, "value", value) in (True, "true", "True", "auto") or (
        isinstance(value, int) and not isinstance(value, bool) and value > 0)


@fragment("torchtune.optimizer")
def read_torchtune_optimizer(read, optimizer: Mapping) -> bool:
    """torchtune `optimizer: {_component_: torchao.optim.CPUOffloadOptimizer, optimizer_class, offload_gradients}`;
    torchao passes fused=True to torch.optim.AdamW unless the config says."""
    if str(optimizer.get("_component_")).lower() != "torchao.optim.cpuoffloadoptimizer":
        return False
    grads = _truthy(optimizer.get("offload_gradients"))
    read.set("cpu_offload_optimizer", "grads" if grads else "on", "optimizer._component_", optimizer["_component_"],
             f"torchao CPUOffloadOptimizer, offload_gradients={grads}")
    base = str(optimizer.get("optimizer_class", "torch.optim.AdamW"))
    if base.lower() != "torch.optim.adamw":
        read.unmappable("optimizer", "optimizer.optimizer_class", base,
                        "memfit sizes CPUOffloadOptimizer around torch.optim.AdamW")
    elif "fused" in optimizer and not _truthy(optimizer["fused"]):
        read.set("optimizer", Optimizer.ADAMW if optimizer.get("foreach") is False else Optimizer.ADAMW_FOREACH,
                 "optimizer.fused", optimizer["fused"])
    else:
        read.set("optimizer", Optimizer.ADAMW_FUSED, "optimizer.optimizer_class", base,
                 "torchao adds fused=True to AdamW")
    if "offload_gradients" in optimizer:
        read.consume("optimizer.offload_gradients")
    return True

"""Activation offloading to the CPU (torchtune enable_activation_offloading, training/_activation_offloading.py
OffloadActivations): the saved tensors of forward wait in pinned host RAM for their backward. torchtune pairs it with
activation checkpointing, which leaves only each block's input to move: a few MiB of traffic instead of every saved
tensor; offloading alone moves them all.

The technique in one module (docs/design.md, "Adding a technique"): its setup field and checks (ActivationOffloadSection),
its change to the step's moments and host RAM (the section's step-model hooks, which call the sizing in
memfit.estimate.offload_activations), its rung, its runtime conversion and its HF Trainer note."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from ..change import Change
from ..diagnose import Bottleneck
from ..errors import ConfigError
from ..estimate import offload_activations as sizing
from ..estimate.moments import StepMoments
from ..estimate.result import Term
from ..fields import Option, TechniqueSection, setting, technique_section
from ..model_spec import ModelSpec
from ..setup import Checkpointing, Loss, TrainingSetup
from ..setup_checks import positive_int
from ..units import format_bytes
from .base import Context, Proposal, Skip, Technique, fragment, register
from .convert import MEMFIT_LOOP, ApplyItem, Target, apply_item, conversion, loop_context
from ..hardware import Hardware
from .costs import Cost, host_link_seconds


# ---- the config section: the setup's field, its option, label and checks --------------------------------------

@technique_section
@dataclass(frozen=True)
class ActivationOffloadSection(TechniqueSection):
    """Activation offloading as TrainingSetup holds it (`setup.activation_offload`)."""

    key = "activation_offload"
    after = "keep_zeroed_grads"  # where the field sat when it was the setup's own: --help and JSON keep their order
    classifier_sized = False  # not measured with a sequence classifier's head (memfit.estimate.heads)

    activation_offload: bool = setting(False, section="memory", label="activation offload",
                                       keep=("activation_offload",), option=Option(
        ("--activation-offload",), "Offload the tensors saved for backward to pinned CPU RAM (torchtune "
        "enable_activation_offloading; TRL / axolotl activation_offloading): the LM head's and the loss's stay. Best "
        "with --checkpointing full. Default: off.", "flag", page="Precision and memory"))
    """Tensors saved for backward go to pinned host memory in forward and come back in backward (torchtune
    enable_activation_offloading / OffloadActivations, TRL and axolotl activation_offloading); the LM head's and the
    loss's stay on the device."""

    def problems(self, setup: TrainingSetup) -> list[str]:
        """What memfit sizes of activation offloading: full training, on one GPU or each data-parallel rank."""
        if not isinstance(self.activation_offload, bool):
            return [f"activation_offload must be true or false, got {self.activation_offload!r}"]
        if not self.activation_offload:
            return []
        ft = setup.finetune
        if ft.adapters and (ft.dora or ft.modules_to_save
                            or ft.base_storage(setup.precision.compute_dtype).value == "int8"):
            return [f"activation offloading with {ft.method} is sized for adapters on a 16-bit, fp32 or 4-bit base "
                    "(bitsandbytes' int8 matmul keeps its input outside the hooks; DoRA and modules_to_save are not "
                    "counted): drop --activation-offload or those options"]
        if positive_int(setup.tp) and setup.tp > 1:
            return ["activation offloading with tensor parallelism is not sized yet"]
        if str(setup.checkpointing) in ("selective-op", "attention"):
            return [f"activation offloading with checkpointing {setup.checkpointing} is not sized yet (the kept "
                    "outputs live in the checkpoint's own store, which the offload hooks never see): use full, "
                    "every-N or none"]
        if str(setup.loss) == "fused":
            return ["activation offloading with the fused loss is not sized yet: use loss standard or chunked"]
        if getattr(setup.fsdp_version, "is_fsdp1", False):
            return ["FSDP1 with activation offload is not sized: use --fsdp-version 2"]
        return []

    def describe(self) -> str:
        return ", activation offload" if self.activation_offload else ""

    def plan_words(self) -> str:
        return "activation offload" if self.activation_offload else ""

    # ---- its change to the step model (memfit.estimate.analytic calls these for every section it holds) ----

    def check_model(self, spec: ModelSpec, setup: TrainingSetup) -> None:
        sizing.check(spec, setup)

    def step_moments(self, moments: StepMoments, spec: ModelSpec, setup: TrainingSetup, acts: list[Term],
                     on_cpu: bool) -> StepMoments:
        """On a CPU device there is nowhere to move them: the moments stay."""
        if not self.activation_offload or on_cpu:
            return moments
        return sizing.on_device(moments, spec, setup, acts)

    def host_activations(self, spec: ModelSpec, setup: TrainingSetup, acts: Callable[[], list[Term]],
                         on_cpu: bool) -> sizing.OffloadSizes | None:
        if not self.activation_offload or on_cpu:
            return None
        return sizing.sizes(spec, setup, acts())

    def host_notes(self, host: sizing.OffloadSizes) -> tuple[str, ...]:
        return sizing.host_term_notes(host)

    def trace_note(self) -> str:
        if not self.activation_offload:
            return ""
        return ("activation offload is not traced: fake tensors have no host to go to, so the saved tensors stay in "
                "this device peak (the analytic estimate sizes the offload)")


def host_bytes(ctx: Context, setup: TrainingSetup) -> int:
    """Pinned host bytes per GPU of the setup's activation offload (the estimate's host RAM less the optimizer's)."""
    return ctx.size(setup).cpu_bytes - ctx.size(setup.replace(activation_offload=False)).cpu_bytes


# ---- its cost and its rung --------------------------------------------------------------------------------------

def traffic_bytes(host_bytes_per_micro_step: int, setup: TrainingSetup) -> int:
    """Activation offloading moves every pack down in forward and back up in backward, each micro-step
    (memfit.estimate.offload_activations)."""
    return 2 * host_bytes_per_micro_step * setup.grad_accum_steps


def cost(host_bytes_per_micro_step: int, setup: TrainingSetup, hardware: Hardware) -> Cost:
    """The activation-offload rung's cost: every pack down and up each micro-step, and the pinned host RAM."""
    traffic = traffic_bytes(host_bytes_per_micro_step, setup)
    per = f" ({setup.grad_accum_steps} micro-steps)" if setup.grad_accum_steps > 1 else ""
    return Cost(host_link_bytes=traffic, host_link_seconds=host_link_seconds(traffic, hardware),
                host_bytes=host_bytes_per_micro_step,
                caveats=(per, f"{hardware.gpu.host_link_gb_per_s:g} GB/s",
                         "overlapped with compute on torchtune's second stream as far as the link keeps up"),
                template="{host_link} over PCIe per step{caveat[0]} (~{host_link_seconds:.2f} s at {caveat[1]}), "
                         "{caveat[2]}; {host} of pinned host RAM per GPU")


@register
class ActivationOffload(Technique):
    """After the chunked / fused loss on the activation ladders: it costs host RAM and PCIe bandwidth (hidden behind
    compute only as far as the link keeps up), where the rungs before it cost a little compute or nothing."""

    key = "activation_offload"
    cuts_static = False
    # it costs host RAM and PCIe bandwidth rather than compute, and pairs with checkpointing
    rung_after = {Bottleneck.ACTIVATIONS: "fused_loss", Bottleneck.BOTH: "fused_loss"}
    title = "activation offloading to the CPU"

    def search_values(self, setup: TrainingSetup, hardware) -> dict[str, list]:
        return {"activation_offload": [False, True]}

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.activation_offload:
            return Skip("already offloading activations")
        if ctx.setup.loss is Loss.FUSED:  # setup.replace would turn the fused loss back: keep it instead
            return Skip("not sized with the fused loss, which already keeps no logits")
        modes = [ctx.setup.checkpointing]
        if not ctx.setup.checkpointing.is_on:
            modes.append(Checkpointing.FULL)  # torchtune's pairing: offload the checkpoints only
        candidates = []
        for mode in modes:
            try:
                candidates.append(ctx.setup.replace(activation_offload=True, checkpointing=mode))
            except ConfigError as error:
                return Skip(str(error))
        ram = ctx.hardware.cpu_ram_bytes
        need = {id(c): (ctx.size(c).cpu_bytes * ctx.hardware.gpus_per_node) for c in candidates}
        within = [c for c in candidates if need[id(c)] <= ram]
        if not within:
            return Skip(f"host RAM is the limit: the offloaded activations need {format_bytes(min(need.values()))} "
                        f"per node, more than the {format_bytes(ram)} given (--cpu-ram)")
        chosen = ctx.pick(within)
        if isinstance(chosen, Skip):
            return chosen
        moved = host_bytes(ctx, chosen)
        paired = chosen.checkpointing is not ctx.setup.checkpointing
        return Proposal(
            chosen,
            "torchtune: enable_activation_offloading: True" + (", enable_activation_checkpointing: True" if paired
                                                              else "") + "  # TRL SFTConfig / axolotl: "
            "activation_offloading: true; HF Trainer: memfit.apply_(model, {'activation_offload': True})",
            cost(moved, chosen, ctx.hardware),
            "tensors saved for backward wait in pinned host RAM and stream back block by block; the LM head's and "
            "the loss's stay on the device" + ("; with full checkpointing only each block's input moves" if
                                               chosen.checkpointing is Checkpointing.FULL else ""))


@conversion("activation_offload", after="engine")
def convert(model, setup: TrainingSetup, target: Target):
    """torchtune's OffloadActivations hooks around every forward of the model (memfit._torch.offload_activations):
    for loops that call model(**batch), as the HF Trainer does. memfit's own loop wraps its forward and loss
    itself (offload_activations.context), so a model it trains gets no hooks."""
    if not setup.activation_offload:
        return None
    if target.loop == MEMFIT_LOOP:
        return Change("activation offload", False, "memfit's training loop offloads around the forward and the loss")
    if getattr(model, "_memfit_activation_offload", None) is not None:
        return Change("activation offload", False, "already installed")
    _runtime().install(model)
    return Change("activation offload", True, "saved tensors of >= 1 KiB (parameters aside) go to pinned host RAM in "
                                              "forward and come back in backward; the LM head's and the loss's stay")


# ---- its HF Trainer note ------------------------------------------------------------------------------------------

@fragment("hf_trainer.memory")
def hf_trainer_fragment(setup: TrainingSetup, *, apply_line: str | None = None,
                        **_) -> tuple[dict, dict[str, str], list[str]]:
    """TrainingArguments has no activation offloading; TRL's SFTConfig, axolotl and torchtune run torchtune's
    OffloadActivations hooks, and memfit.apply_ installs the same hooks on a live model (`apply_line`: the emitter's
    line that applies memfit_apply.json)."""
    if not setup.activation_offload:
        return {}, {}, []
    return {}, {}, [f"Activation offloading: TrainingArguments has no such option, so memfit_apply.json holds it: "
                    f"`{apply_line}` on the loaded model installs torchtune's saved-tensor hooks "
                    "before Trainer(...) (TRL `SFTConfig(activation_offloading=True)`, axolotl "
                    "`activation_offloading: true` and torchtune `enable_activation_offloading: True` are the same "
                    "hooks). It needs CUDA and pinned host RAM."]


# ---- its memfit_apply.json item: TrainingArguments has no activation offloading ----------------------------------

def _apply_parse(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


apply_item(ApplyItem("activation_offload", lambda setup: True if setup.activation_offload else None,
                     "torchtune's OffloadActivations rule on the model's forward (memfit._torch.offload_activations): "
                     "saved tensors to pinned host RAM; needs CUDA", lambda value: "activation offloading",
                     _apply_parse))


# ---- its runtime: the saved-tensor hooks (memfit._torch.offload_activations; torch is imported there) -------------

def _runtime():
    """memfit._torch.offload_activations, imported on first use (it imports torch)."""
    from .._torch import offload_activations
    return offload_activations


@loop_context
def loop_offloading(model, setup: TrainingSetup):
    """What memfit's own loop wraps the forward and the loss in: the hooks, unless off or apply_ installed them."""
    if not setup.activation_offload:
        return contextlib.nullcontext()
    return _runtime().context(model, True)

"""LoRA and QLoRA as rungs beyond the seed's ladder: when a full fine-tune's static memory cannot fit after mixed
precision, 8-bit Adam and ZeRO, train low-rank adapters on a frozen base (LoRA), then on a 4-bit base (QLoRA).
They change the method, not just the memory: the cost line says so."""

from __future__ import annotations

from ..change import Change
from ..errors import ConfigError
from ..estimate.lora import rung_targets
from ..finetune import BaseWeights, Finetune, Method
from ..setup import Offload, Sharding, TrainingSetup
from .base import Context, Proposal, Skip, Technique, register
from .costs import lora_cost
from .convert import Target, conversion

UPCAST_NOTE = " (fp32 after prepare_model_for_kbit_training)"
"""What the QLoRA rung says of the unquantized rest under peft's recipe (memfit.frameworks says it for LitGPT's)."""


def _adapted(ctx: Context, finetune: Finetune) -> TrainingSetup | Skip:
    """The current setup training `finetune`, with what memfit cannot size for adapters removed (DeepSpeed ZeRO-3
    and CPU offload, which a frozen base needs less); a Skip when that would need more memory than now."""
    for changes in ({}, {"offload": Offload.NONE},
                    {"offload": Offload.NONE,
                     "sharding": Sharding.ZERO2 if ctx.setup.num_gpus > 1 else Sharding.NONE}):
        try:
            setup = ctx.setup.replace(finetune=finetune, **changes)
        except ConfigError:
            continue
        if changes and ctx.size(setup).total_bytes >= ctx.estimate.total_bytes:
            dropped = " and ".join(f"{name} {getattr(ctx.setup, name)}" for name, value in changes.items()
                                   if getattr(ctx.setup, name) != value)
            return Skip(f"memfit sizes {finetune.method} without {dropped} only, and that needs more than now")
        return setup
    return Skip(f"no setup memfit can size trains {finetune.method} here")


def _lora_config(ft: Finetune, targets: str) -> str:
    return (f"get_peft_model(model, LoraConfig(r={ft.rank}, lora_alpha={ft.alpha:g}, lora_dropout={ft.dropout:g}, "
            f"target_modules={targets}))")


def _targets_text(ft: Finetune) -> str:
    if not ft.targets:
        return "None  # peft's default for the architecture"
    return repr(ft.targets[0]) if len(ft.targets) == 1 else repr(list(ft.targets))


@register
class Lora(Technique):
    key = "lora"
    title = "LoRA (beyond the seed)"
    beyond_seed = True

    def propose(self, ctx: Context) -> Proposal | Skip:
        if ctx.setup.finetune.adapters:
            return Skip(f"already {ctx.setup.finetune.method}")
        if ctx.spec.graph is None:
            return Skip("memfit has no graph of this architecture to place adapters on")
        setup = _adapted(ctx, Finetune(method=Method.LORA, targets=rung_targets(ctx.spec)))
        if isinstance(setup, Skip):
            return setup
        return Proposal(setup, _lora_config(setup.finetune, _targets_text(setup.finetune)), lora_cost(quantized=False),
                        "the base weights are frozen: no gradients or optimizer states for them, only for "
                        "the adapters (peft keeps those in fp32)")


@register
class Qlora(Technique):
    key = "qlora"
    title = "QLoRA (beyond the seed)"
    beyond_seed = True

    def propose(self, ctx: Context) -> Proposal | Skip:
        ft = ctx.setup.finetune
        if ft.base_storage(ctx.setup.precision.compute_dtype).four_bit:
            return Skip("the base is 4-bit already")
        if ctx.spec.graph is None:
            return Skip("memfit has no graph of this architecture to place adapters on")
        if ctx.hardware.is_cpu:
            return Skip("bitsandbytes' 4-bit base is sized for CUDA devices")
        new = (ft if ft.adapters else Finetune(targets=rung_targets(ctx.spec))).replace(method=Method.QLORA,
                                                                                       base=BaseWeights.NF4)
        setup = _adapted(ctx, new)
        if isinstance(setup, Skip):
            return setup
        return Proposal(setup, "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
                               "bnb_4bit_quant_type=\"nf4\", bnb_4bit_use_double_quant=True, "
                               "bnb_4bit_compute_dtype=torch.bfloat16)); prepare_model_for_kbit_training(model); "
                        + _lora_config(new, _targets_text(new)), lora_cost(quantized=True),
                        "the frozen Linear weights are stored in 4 bits (0.5 B plus ~0.127 bits of block constants "
                        "per weight); embeddings, head and norms stay unquantized" + UPCAST_NOTE)


@conversion("finetune")
def convert(model, setup: TrainingSetup, target: Target) -> Change | None:
    """LoRA / QLoRA: the adapters injected in place (peft.inject_adapter_in_model, which freezes everything else),
    kept in fp32 as get_peft_model does by default; for QLoRA the base's Linears quantized in place to
    bitsandbytes 4-bit (or 8-bit) first, the rest upcast to fp32 (prepare_model_for_kbit_training) unless
    kbit_prep is False (the rest in the compute dtype). memfit._torch.lora does it, on real or fake tensors."""
    if not setup.finetune.adapters:
        return None
    from .._torch import lora as torch_lora

    return Change("finetune", *torch_lora.apply_adapters(model, setup))

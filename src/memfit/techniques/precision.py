from __future__ import annotations

from ..change import Change
from ..diagnose import Bottleneck
from ..setup import Offload, Optimizer, Precision, TrainingSetup, needs_bf16
from .base import Context, Proposal, Skip, Technique, register
from .costs import Cost, precision_cost, precision_step_cost
from .convert import Target, conversion


@register
class MixedPrecision(Technique):
    """The seed: 'halves parameter and gradient memory'. Under torch.autocast it does not (weights, gradients and
    states stay fp32); only pure bf16 does. So the step chosen depends on what is short: activations -> autocast,
    static memory -> pure bf16 (with its convergence caveat)."""

    key = "mixed_precision"
    title = "mixed precision"

    def step_cost(self, spec, setup: TrainingSetup, hardware) -> Cost:
        return precision_step_cost(setup)

    def search_values(self, setup: TrainingSetup, hardware) -> dict[str, list]:
        """The setup's precision, autocast bf16 and pure bf16 on a GPU with bf16; fp16 autocast from fp32 on one
        without."""
        precisions = {setup.precision}
        if hardware.gpu.bf16:
            precisions |= {Precision.AMP_BF16, Precision.BF16}
        elif setup.precision is Precision.FP32:
            precisions.add(Precision.AMP_FP16)
        return {"precision": sorted(p for p in precisions if hardware.gpu.bf16 or not needs_bf16(p))}

    def propose(self, ctx: Context) -> Proposal | Skip:
        current = ctx.setup.precision
        if ctx.setup.finetune.adapters and current is not Precision.FP32:
            return Skip(f"{ctx.setup.finetune.method}: the frozen base is stored as "
                        f"{ctx.setup.finetune.base_storage(current.compute_dtype)} already, and peft keeps the "
                        "adapters in fp32 whatever the precision")
        wants_static = ctx.diagnosis.bottleneck in (Bottleneck.STATIC, Bottleneck.BOTH)
        if not ctx.hardware.gpu.bf16:
            if current is Precision.FP32:
                return Proposal(ctx.setup.replace(precision=Precision.AMP_FP16),
                                "TrainingArguments(fp16=True)  # torch.autocast(fp16) + GradScaler",
                                precision_cost(Precision.AMP_FP16),
                                f"{ctx.hardware.gpu.name} has no bf16: fp16 autocast halves most activations")
            return Skip(f"{ctx.hardware.gpu.name} has no bf16, and pure fp16 training is unstable")
        if wants_static and current in (Precision.FP32, Precision.AMP_BF16, Precision.AMP_FP16,
                                         Precision.BF16_MASTER) and ctx.setup.offload is Offload.NONE:
            return Proposal(ctx.setup.replace(precision=Precision.BF16),
                            f"model = {ctx.spec.auto_class}.from_pretrained(..., {_dtype_keyword()}=torch.bfloat16)"
                            "  # pure bf16",
                            precision_cost(Precision.BF16),
                            "the only precision change that cuts static memory: autocast keeps fp32 weights, "
                            "gradients and states, and fp32 master weights cost 16 B/param like fp32 Adam")
        if current is Precision.FP32:
            return Proposal(ctx.setup.replace(precision=Precision.AMP_BF16),
                            "TrainingArguments(bf16=True)  # torch.autocast(bf16)",
                            precision_cost(Precision.AMP_BF16),
                            "bf16 activations are half the size (+2 B/param of cached bf16 weight copies)")
        if current is Precision.BF16 and ctx.setup.optimizer.state_bits < 32:
            return Skip("already pure bf16")
        return Skip(f"already {current}")


def _dtype_keyword() -> str:
    from ..libraries import dtype_keyword

    return dtype_keyword()


@conversion("precision")
def convert(model, setup: TrainingSetup, target: Target) -> Change:
    """The parameters in the setup's storage dtype (pure bf16 / back to fp32); under LoRA the frozen base in its
    planned storage dtype (a quantized base is the finetune item's), adapters left to peft (fp32). Parameters
    transformers keeps in fp32 stay. Autocast and the master copy are the loop's: the detail says how."""
    from .._torch import lora as torch_lora, step as torch_step

    kept = _kept_in_fp32(model) if target.is_hf else frozenset()
    if setup.finetune.adapters:
        base = setup.finetune.base_storage(setup.precision.compute_dtype)
        how = "; wrap forward and loss in `applied.autocast()`" if setup.precision.is_autocast else ""
        if base.quantized:
            return Change("precision", False, f"the base is quantized to {base} by the finetune item{how}")
        dtype, name, what = torch_lora.base_dtype(setup), f"{base}", "the base"
        kept |= frozenset(n for n, _ in model.named_parameters() if "lora_" in n)
        already, done = f"base already {base}{how}", f" (frozen, stored as planned){how}"
    else:
        how = _LOOP_PART.get(setup.precision, "")
        dtype, name, what = torch_step.param_dtype(setup), setup.precision.param_dtype, "parameters"
        already, done = f"parameters already {name} ({setup.precision}){how}", f" ({setup.precision}){how}"
    dtypes = {p.dtype for n, p in model.named_parameters() if p.is_floating_point() and n not in kept}
    if dtypes <= {dtype}:
        return Change("precision", False, already)
    torch_step.cast_floating(model, dtype, skip=kept, buffers=not setup.finetune.adapters)
    was = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return Change("precision", True, f"cast {what} {was} -> {name}{done}")


_LOOP_PART = {
    Precision.AMP_BF16: "; wrap forward and loss in `applied.autocast()` (torch.autocast bf16)",
    Precision.AMP_FP16: "; wrap forward and loss in `applied.autocast()` (torch.autocast fp16) and scale the "
                        "loss with torch.amp.GradScaler",
    Precision.BF16_MASTER: "; `applied.make_optimizer` keeps the fp32 master copy",
}


def _kept_in_fp32(model) -> frozenset[str]:
    """Parameters transformers keeps in fp32 whatever the dtype asked (`_keep_in_fp32_modules_strict`,
    transformers modeling_utils.py): a model built in bf16 holds them in fp32 and is already as the setup says."""
    names = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    return frozenset(n for n, _ in model.named_parameters() if any(k in n for k in names))  # its regex search

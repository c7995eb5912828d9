from __future__ import annotations

from ..diagnose import Bottleneck
from ..setup import Offload, Optimizer, Precision
from .base import Context, Proposal, Skip, Technique, register


@register
class MixedPrecision(Technique):
    """The seed: 'halves parameter and gradient memory'. Under torch.autocast it does not (weights, gradients and
    states stay fp32); only pure bf16 does. So the step chosen depends on what is short: activations -> autocast,
    static memory -> pure bf16 (with its convergence caveat)."""

    key = "mixed_precision"
    title = "mixed precision"

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
                                "none in compute (faster tensor cores); loss scaling needed for fp16",
                                f"{ctx.hardware.gpu.name} has no bf16: fp16 autocast halves most activations")
            return Skip(f"{ctx.hardware.gpu.name} has no bf16, and pure fp16 training is unstable")
        if wants_static and current in (Precision.FP32, Precision.AMP_BF16, Precision.AMP_FP16,
                                         Precision.BF16_MASTER) and ctx.setup.offload is Offload.NONE:
            return Proposal(ctx.setup.replace(precision=Precision.BF16),
                            f"model = {ctx.spec.auto_class}.from_pretrained(..., {_dtype_keyword()}=torch.bfloat16)"
                            "  # pure bf16",
                            "none in compute; bf16 weight updates lose small steps: prefer stochastic rounding or "
                            "Kahan summation for long runs",
                            "the only precision change that cuts static memory: autocast keeps fp32 weights, "
                            "gradients and states, and fp32 master weights cost 16 B/param like fp32 Adam")
        if current is Precision.FP32:
            return Proposal(ctx.setup.replace(precision=Precision.AMP_BF16),
                            "TrainingArguments(bf16=True)  # torch.autocast(bf16)",
                            "none in compute (faster tensor cores); weights stay fp32",
                            "bf16 activations are half the size (+2 B/param of cached bf16 weight copies)")
        if current is Precision.BF16 and ctx.setup.optimizer.state_bits < 32:
            return Skip("already pure bf16")
        return Skip(f"already {current}")


def _dtype_keyword() -> str:
    from ..emit.hf_trainer import dtype_keyword

    return dtype_keyword()

"""LoRA on a model whose activations memfit.derive.stacks fits (ViT, DINOv2, T5, BART): those copies are traced
without adapters, so the estimate refuses in one line instead of failing inside."""

from __future__ import annotations

import pytest

from memfit import ConfigError, TrainingSetup
from memfit.estimate.analytic import estimate
from memfit.finetune import Finetune, Method
from memfit.hardware import make_hardware
from memfit.sources import resolve_model


def test_lora_on_a_stacked_derived_model_is_one_clear_refusal():
    spec = resolve_model("vit-base-patch16-224")
    assert getattr(spec.derived, "stacked", False)
    setup = TrainingSetup(finetune=Finetune(method=Method.LORA, targets=("q_proj", "v_proj")))
    with pytest.raises(ConfigError) as refused:
        estimate(spec, setup, make_hardware("A100-80GB"))
    assert "memfit.derive.stacks" in str(refused.value) and "memfit trace" in str(refused.value)

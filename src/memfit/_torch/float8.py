"""torchao float8 training on a real module, as torchtitan's Float8LinearConverter applies it (torchtitan
components/quantization/float8.py): `convert_to_float8_training` with the recipe's Float8LinearConfig on every
nn.Linear but the LM head (torchtitan's filter_fqns=["output"]; transformers names it lm_head) and those whose
dimensions are not multiples of 16 (torch._scaled_mm's constraint; torchtitan's module_filter_fn skips them)."""

from __future__ import annotations

import torch

from ..errors import MissingDependencyError
from ..choices import Float8
from ..setup import TrainingSetup

HEAD_NAMES = ("lm_head", "output", "embed_out")
"""The LM head's module name in transformers (lm_head), torchtitan (output) and GPT-NeoX (embed_out)."""


def convertible(module: torch.nn.Module, fqn: str) -> bool:
    """Whether torchtitan converts this module: a plain nn.Linear (not already a Float8Linear, a quantized or an
    adapted one), not the head, both dimensions multiples of 16."""
    if type(module) is not torch.nn.Linear or fqn.split(".")[-1] in HEAD_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: torch.nn.Module, setup: TrainingSetup) -> int:
    """Swap the convertible Linears for torchao Float8Linear (in place); returns how many it swapped now."""
    if not setup.float8.is_on:
        return 0
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise MissingDependencyError("float8 training needs torchao: pip install torchao") from error
    recipe = "tensorwise" if setup.float8 is Float8.TENSORWISE else "rowwise"
    config = Float8LinearConfig.from_recipe_name(recipe)
    if setup.float8_all_gather:  # torchao's FSDP2 hook: WeightWithDynamicFloat8CastTensor weights
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    from torchao.float8.float8_linear import Float8Linear

    before = sum(isinstance(m, Float8Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    return sum(isinstance(m, Float8Linear) for m in model.modules()) - before

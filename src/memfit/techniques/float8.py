"""torchao float8 training (TrainingSetup.float8): not a ladder rung, a conversion of the live model. Sized by
memfit.estimate.float8; converted by memfit._torch.float8."""

from __future__ import annotations

from ..change import Change
from ..setup import Float8, TrainingSetup
from .convert import Target, conversion


@conversion("float8")
def convert(model, setup: TrainingSetup, target: Target):
    """The convertible Linears swapped for torchao Float8Linear (memfit._torch.float8), as torchtitan converts them,
    before checkpointing wraps the blocks."""
    if not setup.float8.is_on:
        return None
    from .._torch.float8 import apply_float8

    swapped = apply_float8(model, setup)
    if not swapped:
        return Change("float8", False, "no plain nn.Linear left to convert (already Float8Linear, or none)")
    return Change("float8", True, f"{swapped} Linears now torchao Float8Linear ({setup.float8}; the LM head and "
                                  "Linears with a dimension not a multiple of 16 stay as they were)")


FLOAT8_CONVERTER = "quantize.linear.float8"


def torchtitan_fragment(setup: TrainingSetup) -> dict[str, dict]:
    """torchtitan's Float8LinearConverter tables for the setup's float8 (none without it), as memfit.emit.torchtitan
    writes them: `[model] converters` and the converter's own table (components/quantization/float8.py)."""
    if not setup.float8.is_on:
        return {}
    options: dict = {"filter_fqns": ["output"]}
    if setup.float8 is Float8.ROWWISE:
        options["recipe_name"] = "rowwise"
    if setup.float8_all_gather:  # the scales of all float8 weights in one all-reduce after the optimizer step
        options.update(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    return {"model": {"converters": [FLOAT8_CONVERTER]}, FLOAT8_CONVERTER: options}

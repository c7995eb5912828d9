"""torchao float8 training (torchao.float8.convert_to_float8_training, torchtitan `--model.converters float8`): its
setup fields and checks (Float8Section), its words, its conversion of the live model and its torchtitan tables. Not a
ladder rung. Sized by memfit.estimate.float8 (the step model reads `setup.float8`); converted by
memfit._torch.float8."""

from __future__ import annotations

from dataclasses import dataclass

from ..change import Change
from ..choices import Float8
from ..fields import Option, TechniqueSection, setting, technique_section
from ..setup import Engine, TrainingSetup
from ..way_out import engine_way_out, refusal
from .convert import Target, conversion

# ---- the config section: the setup's fields, their options, labels and checks ---------------------------------


@technique_section
@dataclass(frozen=True)
class Float8Section(TechniqueSection):
    """torchao float8 training as TrainingSetup holds it (`setup.float8`, `setup.float8_all_gather`)."""

    key = "float8"
    after = "compile"  # where the fields sat when they were the setup's own: --help and JSON keep their order
    turned_back = ("float8_all_gather", "float8")  # a change that cannot run with float8 turns it back off
    checked_late = True  # its refusals assume the parallel layout already passed the setup's own checks

    float8: Float8 = setting(Float8.OFF, section="precision", label="float8", keep=("float8",), option=Option(
        ("--float8",), "{choices}: torchao float8 training on every Linear but the LM head (torchtitan "
        "--model.converters float8, [float8] recipe_name); needs a bf16 compute dtype. Default: off.", "choice",
        page="Precision and memory"))
    """torchao Float8Linear on every Linear but the LM head (torchtitan `--model.converters float8`, `[float8]
    recipe_name`): off, tensorwise or rowwise. Needs a bf16 compute dtype (amp-bf16, bf16, bf16-master)."""
    float8_all_gather: bool = setting(False, section="precision", label="float8 all-gather", keep=("float8",),
                                      option=Option(("--float8-all-gather",), "FSDP2 all-gathers the float8 Linears' "
                                                    "weights in float8, 1 B per element (torchtitan [float8] "
                                                    "enable_fsdp_float8_all_gather): --engine torch, zero2/zero3, "
                                                    "tensorwise. Default: off.", "flag", page="Precision and memory"))
    """FSDP2 all-gathers the float8 Linears' weights in float8 (1 B per element, plus one fp32 scale) instead of
    bf16 (torchao enable_fsdp_float8_all_gather, torchtitan `[float8] enable_fsdp_float8_all_gather`): tensorwise
    on engine torch with zero2 / zero3 only."""

    def problems(self, setup: TrainingSetup) -> list[str]:
        """What torchao's float8 training runs and memfit sizes (torchao 0.18 float8/config.py, float8_linear.py)."""
        if not isinstance(self.float8_all_gather, bool):
            return [f"float8_all_gather must be true or false, got {self.float8_all_gather!r}"]
        if not self.float8.is_on:
            return ["float8 all-gather needs float8 training: give --float8 tensorwise"] * self.float8_all_gather
        problems = []
        if setup.precision.compute_dtype != "bf16":
            problems.append(f"float8 training computes its matmul outputs in bf16: precision {setup.precision} cannot "
                            "run it; use amp-bf16, bf16 or bf16-master")
        if setup.finetune.adapters:
            problems.append(f"float8 training with {setup.finetune.method} is not sized (a frozen or quantized base "
                            "is no Float8Linear): use method full or --float8 off")
        if setup.pp > 1:
            problems.append("float8 training with pipeline parallelism is not sized yet: use --float8 off")
        if self.float8_all_gather and (setup.engine is not Engine.TORCH or setup.sharding.stage < 2):
            problems.append(refusal("float8 all-gather is FSDP2's (torchao enable_fsdp_float8_all_gather)",
                                    engine_way_out(setup, Engine.TORCH), "drop --float8-all-gather"))
        if self.float8_all_gather and self.float8 is not Float8.TENSORWISE:
            problems.append("float8 all-gather supports tensorwise scaling only (torchao Float8LinearConfig): use "
                            "--float8 tensorwise")
        return problems

    def fsdp1_sized(self) -> bool:
        return not self.float8.is_on

    def describe(self) -> str:
        if not self.float8.is_on:
            return ""
        return f", float8 {self.float8}" + (" + float8 all-gather" if self.float8_all_gather else "")


# ---- its conversion of a live model and its torchtitan tables ---------------------------------------------------

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

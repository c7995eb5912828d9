"""The float8-training keys of the config formats memfit reads (memfit.estimate.float8 sizes them).

- torchtune (recipes/full_finetune_distributed.py): `enable_fp8_training`, `fp8_recipe_name`; with no recipe name
  torchtune's training/quantization.py `convert_to_float8_training` uses tensorwise with
  enable_fsdp_float8_all_gather=True (its distributed recipe shards with FSDP2), the output layer left out.
- axolotl: `fp8: true` (torchao's tensorwise recipe through accelerate's AORecipeKwargs) and
  `fp8_enable_fsdp_float8_all_gather`. accelerate's default module filter also leaves the first Linear in bf16,
  which memfit sizes as converted (one Linear of the model).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..choices import Float8
from ._reader import Reader

_RECIPES = {"tensorwise": Float8.TENSORWISE, "rowwise": Float8.ROWWISE}


def _on(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "on")


def torchtune_float8(read: Reader, data: Mapping, world: int | None) -> None:
    if "enable_fp8_training" not in data:
        if "fp8_recipe_name" in data:
            read.ignore("fp8_recipe_name", data["fp8_recipe_name"], "without enable_fp8_training it does nothing")
        return
    raw = data["enable_fp8_training"]
    if not _on(raw):
        read.set("float8", Float8.OFF, "enable_fp8_training", raw)
        return
    name = data.get("fp8_recipe_name")
    recipe = _RECIPES.get(str(name).lower()) if name is not None else Float8.TENSORWISE
    if recipe is None:
        read.unmappable("float8", "fp8_recipe_name", name, "memfit sizes the tensorwise and rowwise recipes",
                        fallback="float8 left off")
        return
    read.set("float8", recipe, "enable_fp8_training", raw,
             "torchao Float8Linear on every Linear but the output" + (f" ({name})" if name else " (tensorwise)"))
    if name is not None:
        read.set_part("float8", "recipe", recipe, "fp8_recipe_name", name)
    elif world is not None and world > 1:  # torchtune's default config all-gathers float8 weights under FSDP2
        read.set("float8_all_gather", True, "enable_fp8_training", raw,
                 "no fp8_recipe_name: tensorwise with enable_fsdp_float8_all_gather")


def axolotl_float8(read: Reader, data: Mapping) -> None:
    if "fp8" in data:
        on = _on(data["fp8"])
        read.set("float8", Float8.TENSORWISE if on else Float8.OFF, "fp8", data["fp8"],
                 "torchao tensorwise through accelerate (AORecipeKwargs)" if on else "")
    if "fp8_enable_fsdp_float8_all_gather" in data:
        raw = data["fp8_enable_fsdp_float8_all_gather"]
        read.set("float8_all_gather", _on(raw) and _on(data.get("fp8", False)), "fp8_enable_fsdp_float8_all_gather",
                 raw)

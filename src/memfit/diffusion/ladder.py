"""The diffusion ladder (`memfit diffusion ... --plan`): the levers of a diffusion fine-tune, cheapest first, each
re-estimated (memfit.diffusion.api.size_run) on top of the ones before, stopping at the first setup that fits; a
lever already on is skipped.

Order (what each costs, in the trainers' own terms):
1. cache the text encoders' outputs: the encoders leave the GPU after one pass over the prompts; no cost per step,
   but the captions are fixed (no caption dropout or shuffling while training).
2. cache the latents: the VAE leaves the GPU; no per-epoch image augmentation (random crop / flip).
3. gradient checkpointing: each block's forward runs again in backward (about a third more compute).
4. 8-bit AdamW (bitsandbytes): block-wise 8-bit states; for a LoRA the states are small, so this rung saves little.
5. fp8 base (layerwise casting / kohya --fp8_base): frozen weights stored in fp8, upcast per layer; a quality
   caveat (e4m3 rounding of the base) and a cast per layer per step.
6. NF4 base (bitsandbytes 4-bit QLoRA): the base's Linears in 4 bits plus absmax; more rounding than fp8 and a
   dequantization per layer in forward and backward.
7. block swap (kohya / musubi-tuner --blocks_to_swap, fp8 or bf16 base): the fewest blocks that fit; each swapped
   block's weights cross PCIe twice per step, and host RAM holds them.
8. smaller micro-batch, then lower resolution (1024 -> 768 -> 512 px a side): fewer tokens, a different model
   quality at the trained size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .api import DiffusionEstimate, size_run
from .presets import resolve_model
from .swap import most_blocks

GIB = 2 ** 30
RESOLUTIONS = (768, 512)


@dataclass(frozen=True)
class Rung:
    title: str
    changes: dict[str, Any]
    """The size_run values this rung set."""
    cost: str
    kohya: str
    """sd-scripts / musubi-tuner flags to paste."""
    diffusers: str
    """diffusers DreamBooth script flags (or the call) to paste."""
    required: int
    budget: int
    fits: bool
    host_bytes: int = 0


def _levers(values: dict[str, Any], family: str) -> list[tuple[str, dict[str, Any], str, str, str]]:
    """(title, changes, cost, kohya, diffusers) of every lever not yet on, in the ladder's order."""
    lora = values.get("method", "lora") == "lora"
    out = []
    if not values.get("cache_text"):
        out.append(("cache text-encoder outputs", {"cache_text": True},
                    "none per step; captions fixed (no caption dropout / shuffle)",
                    "--cache_text_encoder_outputs", "one --instance_prompt, no --train_text_encoder (the script "
                    "then encodes the prompt once and frees the encoders)"))
    if not values.get("cache_latents"):
        out.append(("cache latents", {"cache_latents": True}, "no per-epoch image augmentation",
                    "--cache_latents", "--cache_latents"))
    if not values.get("checkpointing"):
        out.append(("gradient checkpointing", {"checkpointing": True},
                    "~+33% compute (each block's forward again in backward)", "--gradient_checkpointing",
                    "--gradient_checkpointing"))
    if "8bit" not in str(values.get("optimizer") or ""):
        out.append(("8-bit AdamW", {"optimizer": "adamw8bit"}, "~1% step time; block-wise 8-bit states",
                    "--optimizer_type AdamW8bit", "--use_8bit_adam"))
    if lora and values.get("base_dtype", "bf16") == "bf16" and family != "sdxl":  # fp8 not sized for SDXL
        out.append(("fp8 base", {"base_dtype": "fp8"}, "base rounded to e4m3 (quality caveat); a cast per layer",
                    "--fp8_base", "transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, "
                    "compute_dtype=torch.bfloat16)"))
    if lora and values.get("base_dtype", "bf16") != "nf4":
        out.append(("NF4 base", {"base_dtype": "nf4"}, "4-bit base (more rounding than fp8); dequantized per layer "
                    "in forward and backward", "(no NF4 base in sd-scripts: use --fp8_base + --blocks_to_swap)",
                    "--bnb_quantization_config_path nf4.json ({\"load_in_4bit\": true, \"bnb_4bit_quant_type\": "
                    "\"nf4\"})"))
    return out


def plan(model: str | dict, *, resolution: tuple[int, int], gpu: str = "RTX-4090",
         **values: Any) -> tuple[DiffusionEstimate, list[Rung]]:
    """(the estimate as given, the rungs climbed): each rung's settings on top of the rungs before it."""
    values = dict(values)
    first, hardware, (ok, required, budget) = size_run(model, resolution=resolution, gpu=gpu, **values)
    rungs: list[Rung] = []
    if ok:
        return first, rungs
    family = first.family
    for title, changes, cost, kohya, diffusers in _levers(values, family):
        values.update(changes)
        result, _, (ok, required, budget) = size_run(model, resolution=resolution, gpu=gpu, **values)
        rungs.append(Rung(title, changes, cost, kohya, diffusers, required, budget, ok))
        if ok:
            return first, rungs
    if values.get("method", "lora") == "lora" and family in ("flux", "sd3") and not values.get("blocks_to_swap"):
        rung = _swap(model, resolution, gpu, values)
        if rung is not None:
            rungs.append(rung)
            if rung.fits:
                return first, rungs
            values.update(rung.changes)
    while values.get("batch", 1) > 1:
        values["batch"] = max(1, values.get("batch", 1) // 2)
        _, _, (ok, required, budget) = size_run(model, resolution=resolution, gpu=gpu, **values)
        rungs.append(Rung(f"micro-batch {values['batch']}", {"batch": values["batch"]},
                          "more accumulation steps for the same images per update",
                          f"--train_batch_size {values['batch']}", f"--train_batch_size {values['batch']}",
                          required, budget, ok))
        if ok:
            return first, rungs
    for side in RESOLUTIONS:
        if side >= min(resolution):
            continue
        size = (side, side)
        _, _, (ok, required, budget) = size_run(model, resolution=size, gpu=gpu, **values)
        rungs.append(Rung(f"resolution {side}", {"resolution": size}, "fewer tokens: the model learns at a "
                          "smaller size", f"--resolution {side},{side}", f"--resolution {side}", required, budget,
                          ok, rungs[-1].host_bytes if rungs else 0))
        if ok:
            break
    return first, rungs


def _swap(model, resolution, gpu, values: dict[str, Any]) -> Rung | None:
    """The fewest swapped blocks that fit (a bisection: required falls as N grows, the step itself unchanged), on
    an fp8 base when the rung before was NF4 (kohya swaps plain weights); kohya's most when none fits."""
    values = {**{k: v for k, v in values.items() if k != "blocks_to_swap"},
              "base_dtype": "fp8" if values.get("base_dtype") == "nf4" else values.get("base_dtype", "bf16")}
    top = most_blocks(resolve_model(model))
    if top < 1:
        return None

    def run(n: int):
        result, _, (ok, required, budget) = size_run(model, resolution=resolution, gpu=gpu, blocks_to_swap=n,
                                                     **values)
        return result, ok, required, budget

    best = (top, run(top))
    if not best[1][1]:
        return _swap_rung(values, *best)
    low = 1
    while low < best[0]:
        middle = (low + best[0]) // 2
        found = run(middle)
        if found[1]:
            best = (middle, found)
        else:
            low = middle + 1
    return _swap_rung(values, *best)


def _swap_rung(values: dict[str, Any], n: int, found) -> Rung:
    result, ok, required, budget = found
    fp8 = values.get("base_dtype") == "fp8"
    return Rung(f"block swap {n}", {"blocks_to_swap": n, "base_dtype": values.get("base_dtype", "bf16")},
                f"{result.swap.describe()} cross PCIe twice per step; {result.swap.host_bytes / GIB:.2f} GiB host RAM",
                f"--blocks_to_swap {n}" + (" --fp8_base" if fp8 else ""), "(no block swap in the diffusers scripts)",
                required, budget, ok, result.swap.host_bytes)

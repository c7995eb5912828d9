"""`memfit vlm`: a vision-language model's training step from the images a sample carries (memfit.vlm): the vision
tokens the processor makes, the language model's sequence, each stack's parameters, the traced peak, and the largest
max_pixels or images per sample that fit the GPU. Parse -> memfit.vlm -> print. It takes the sizing commands'
generated setup and hardware options (cli/options.with_setup_options) beside its own (images, pixels, text length,
tower, search); its --image-size is the images', not the setup's image-classifier field."""

from dataclasses import replace
from enum import Enum
from typing import Annotated, Optional

import typer

from ..errors import ConfigError
from ..finetune import Method
from ..setup import Checkpointing, Precision
from ..vlm.api import estimate_vlm, fits, image_tokens, plan_data, search_images, search_max_pixels
from ..vlm.presets import resolve_vlm_config
from ..vlm.readers import pixel_setting, pre_resized, read_vlm_config
from .common import DOES_NOT_FIT, app, console, examples, parse_pixels, print_json
from .options import MAX_MICRO_BATCH, JsonOpt, SetupOptions, choice, whole_number, with_setup_options

GIB = 2 ** 30

VLM_DEFAULTS = {"micro_batch_size": 1, "precision": Precision.BF16, "checkpointing": Checkpointing.NONE}
"""What a setup option left out means here (TrainingSetup()'s for the rest): one sample of pure bf16 weights,
nothing recomputed."""
NOT_FOR_VLM = {"seq": "--seq", "target_len": "--target-len", "padding": "--padding",
               "longest_sample": "--longest-sample", "task": "--task", "num_labels": "--num-labels"}
"""Shared options a VLM step has no use for: its sequence is --text-len plus the images' tokens, its head the LM's."""


class Search(str, Enum):
    NONE = "none"
    MAX_PIXELS = "max-pixels"
    IMAGES = "images"


def parse_size(value: str) -> tuple[int, int]:
    """'768' or '768x1024' (height x width) -> (768, 768) / (768, 1024)."""
    return parse_pixels(value, "--image-size", "HEIGHTxWIDTH pixels (e.g. 768x1024) or one side")


def vlm_options(opts: SetupOptions, micro_batch: int | None, finetune: Method | None,
                rank: int | None) -> SetupOptions:
    """`opts` with vlm's older spellings (--micro-batch, --finetune, --rank) where the shared ones (--batch,
    --method, --lora-rank) were not given; a shared option that does not apply is one error line."""
    for name, flag in NOT_FOR_VLM.items():
        if getattr(opts, name) is not None:
            raise ConfigError(f"{flag} does not apply to memfit vlm: the language model's sequence is --text-len "
                              "plus the images' tokens")
    return replace(opts, batch=opts.batch or micro_batch, method=opts.method or finetune,
                   lora_rank=opts.lora_rank or rank)


@app.command("vlm", epilog=examples(
    "memfit vlm Qwen2.5-VL-7B-Instruct --images 4 --image-size 768x768 --method lora --gpu A100-80GB",
    "memfit vlm Qwen2.5-VL-7B-Instruct --image-size 1920x1080 --method lora --gpu 4090 --search max-pixels",
    "memfit vlm ./config.json --images 2 --max-pixels 1003520 --json"))
@with_setup_options
def vlm_command(
        model: Annotated[Optional[str], typer.Argument(
            help="A preset (Qwen2.5-VL-7B-Instruct, llava-1.5-7b-hf, gemma-3-4b-it, ...) or a config.json of a "
                 "qwen2_vl / qwen2_5_vl / llava / llava_next / gemma3 model. Optional with a --config that names "
                 "it.")] = None,
        opts: SetupOptions = None,  # given by with_setup_options (MODEL before it is optional: --config names it)
        images: Annotated[int, typer.Option("--images", min=0, help="Images per sample.")] = 1,
        image_size: Annotated[str, typer.Option("--image-size",
                                                help="HEIGHTxWIDTH of each image in pixels.")] = "768x768",
        max_pixels: Annotated[Optional[int], typer.Option("--max-pixels", min=1, help="The processor's max_pixels "
                                                          "(default: the hub processor's 12,845,056).")] = None,
        min_pixels: Annotated[Optional[int], typer.Option("--min-pixels", min=1)] = None,
        text_len: Annotated[int, typer.Option("--text-len", min=1, help="Text tokens per sample.")] = 512,
        tower: Annotated[Optional[str], typer.Option("--tower", help="The vision tower: frozen, trained or lora "
                                                                   "(default frozen).")] = None,
        config: Annotated[Optional[str], typer.Option("--config", metavar="FILE", help="Read the step from the "
                                                      "trainer config you already have: an ms-swift `swift sft` "
                                                      "command line (and its MAX_PIXELS), a LLaMA-Factory YAML or a "
                                                      "TRL SFTConfig YAML / JSON (with the processor's max_pixels); "
                                                      "an option overrides a field.")] = None,
        search: Annotated[Search, typer.Option("--search", help="Also find the largest max-pixels or images per "
                                                              "sample that fit (a few more traces).")] = Search.NONE,
        micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", hidden=True,
                                                           parser=whole_number(MAX_MICRO_BATCH))] = None,
        finetune: Annotated[Optional[Method], typer.Option("--finetune", hidden=True, parser=choice(Method))] = None,
        rank: Annotated[Optional[int], typer.Option("--rank", hidden=True, parser=whole_number(65_536))] = None,
        plan: Annotated[bool, typer.Option("--plan", help="When it does not fit: the data rungs, cheapest first, "
                                                          "each re-estimated (fewer pixels, then fewer images per "
                                                          "sample), with their cost in vision tokens.")] = False,
        json_output: JsonOpt = False) -> None:
    """The memory of a VLM training step from its images: vision tokens, sequences, stacks, and what fits."""
    reading = read_vlm_config(config) if config else None
    model = model or (reading.model if reading else None)
    if not model:
        raise ConfigError("Missing argument 'MODEL': give a preset or a config.json, or a --config that names one")
    size = pre_resized(parse_size(image_size), reading.pre_resize if reading else None)
    opts = vlm_options(opts, micro_batch, finetune, rank)
    hardware = opts.hardware()
    setup = opts.given_setup(hardware, **{**VLM_DEFAULTS, **(reading.setup if reading else {})})
    max_pixels = max_pixels or (reading.max_pixels if reading else None)
    min_pixels = min_pixels or (reading.min_pixels if reading else None)
    tower = tower or (reading.tower if reading else None) or "frozen"
    common = {"image_size": size, "min_pixels": min_pixels, "text_len": text_len, "setup": setup, "tower": tower,
              "hardware": hardware}
    result = estimate_vlm(model, images=images, max_pixels=max_pixels, **common)
    ok, required, budget = fits(result, hardware)
    found = _search(search, model, result, images, max_pixels, common, hardware, budget)
    rungs, skipped = plan_data(model, result, **common) if plan else ((), {})
    paste = _paste(reading, rungs, parse_size(image_size), result)
    if json_output:
        print_json({**_json(result, hardware, ok, required, budget, found),
                    **({"plan": [r.to_dict() for r in rungs], "plan_skipped": skipped, "paste": paste}
                       if plan else {}), **({"config": reading.to_dict()} if reading else {})})
    else:
        if reading:
            _print_reading(reading)
        _print(result, hardware, ok, required, budget, found)
        if plan:
            _print_plan(rungs, skipped, ok)
            if paste:
                console().print(f"  set it: {paste}")
    if not ok and not (rungs and rungs[-1].fits):
        raise typer.Exit(DOES_NOT_FIT)


def _search(search: Search, model, result, images, max_pixels, common, hardware, budget) -> dict | None:
    given = {k: v for k, v in common.items() if k != "hardware"}
    if search is Search.MAX_PIXELS:
        if not result.max_pixels_apply:
            raise ConfigError(f"{result.family} resizes every image (or tile) to its tower's square: max_pixels "
                              "does not apply (--search images does)")
        best, traced = search_max_pixels(model, images=images, hardware=hardware, budget=budget, **given)
        return {"search": "max_pixels", "largest": best, "traced": traced}
    if search is Search.IMAGES:
        best, traced = search_images(model, max_pixels=max_pixels, hardware=hardware, budget=budget, **given)
        return {"search": "images", "largest": best, "traced": traced}
    return None


def _json(result, hardware, ok, required, budget, found) -> dict:
    import dataclasses

    return {"model": result.model, "gpu": hardware.gpu.name, "fits": ok, "required_bytes": required,
            "budget_bytes": budget, "image": dataclasses.asdict(result.image), "images_per_sample": result.images,
            "vision_tokens_per_sample": result.vision_tokens, "tower_patches_per_sample": result.patches,
            "text_len": result.text_len, "lm_seq": result.lm_seq, "micro_batch": result.micro_batch,
            "max_pixels": result.max_pixels, "tower": result.tower,
            "stacks": [dataclasses.asdict(s) for s in result.stacks], "estimate": result.memory.to_dict(),
            "search": {**found, "traced": [[k, v] for k, v in found["traced"].items()]} if found else None}


def _print(result, hardware, ok, required, budget, found) -> None:
    out = console()
    image = result.image
    limit = f" (max_pixels {result.max_pixels:,})" if result.max_pixels_apply else ""
    out.print(f"[bold]{result.model}[/bold]  {result.images} image(s) per sample, resized to "
              f"{image.size[0]}x{image.size[1]}{limit}")
    out.print(f"  vision tokens: {image.lm_tokens:,} per image, {result.vision_tokens:,} per sample; vision tower: "
              f"{image.tower_tokens:,} patches per image, {result.patches:,} per sample")
    wrapped = " (placeholders + vision start/end)" if result.wrapper else ""
    out.print(f"  language model sequence: {result.lm_seq:,} = {result.text_len:,} text + "
              f"{result.lm_seq - result.text_len:,} image{wrapped}; micro-batch {result.micro_batch}")
    for stack in result.stacks:
        out.print(f"  {stack.name:<24} {stack.params:>15,} params  {stack.trainable:>13,} trainable  "
                  f"{stack.bytes / GIB:8.2f} GiB")
    for term in result.memory.terms:
        if term.num_bytes:
            out.print(f"  {term.name:<24} {term.num_bytes / GIB:8.2f} GiB")
    verdict = "[green]fits[/green]" if ok else "[red]does not fit[/red]"
    out.print(f"  peak (traced) {result.memory.tensor_bytes / GIB:.2f} GiB; on {hardware.gpu.name}: "
              f"{required / GIB:.2f} of {budget / GIB:.2f} GiB usable -> {verdict}")
    if found:
        what = "max_pixels" if found["search"] == "max_pixels" else "images per sample"
        best = found["largest"]
        out.print(f"  largest {what} that fits: " + (f"{best:,}" if best is not None else "none") +
                  f" ({len(found['traced'])} traces)")


def _paste(reading, rungs, image_size, result) -> str | None:
    """The processor setting of the fewer-pixels rung, in the config's words (memfit.vlm.readers.pixel_setting)."""
    rung = next((r for r in rungs if r.rung == "fewer pixels"), None)
    if rung is None:
        return None
    config, _ = resolve_vlm_config(result.model)
    tokens = rung.estimate.image.lm_tokens
    return pixel_setting(reading, rung.estimate.max_pixels, image_size, tokens,
                         lambda size: image_tokens(config, size, max_pixels=result.max_pixels).lm_tokens)


def _print_reading(reading) -> None:
    out = console()
    out.print(f"[bold]{reading.file}[/bold] ({reading.format})")
    for entry in reading.read:
        out.print(f"  read: {entry.text}")
    for entry in reading.ignored:
        out.print(f"  left out: {entry.text}")


def _print_plan(rungs, skipped, ok) -> None:
    out = console()
    if ok:
        out.print("  plan: it fits as given")
        return
    out.print("  plan (cheapest first, re-estimated after each step):")
    for number, rung in enumerate(rungs, 1):
        fewer = rung.vision_tokens_before - rung.vision_tokens_after
        out.print(f"  {number}. {rung.rung:<13} {rung.change:<40} {rung.required_bytes / GIB:8.2f} GiB  "
                  f"{'fits' if rung.fits else 'does not fit'}; vision tokens per sample "
                  f"{rung.vision_tokens_before:,} -> {rung.vision_tokens_after:,} "
                  f"(-{fewer / max(rung.vision_tokens_before, 1):.0%})")
    for name, why in skipped.items():
        out.print(f"     {name}: passed over ({why})")
    if not (rungs and rungs[-1].fits):
        out.print("  no data rung makes it fit: see memfit plan / memfit estimate for the memory techniques")

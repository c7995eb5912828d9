"""`memfit diffusion`: a diffusion fine-tune's memory by phase (memfit.diffusion): the latent and tokens a resolution
gives, the denoiser's traced step, the text encoders and VAE on the GPU or cached, and whether it fits. Parse ->
memfit.diffusion -> print. Its own options, named as the shared setup options where they mean the same (--precision,
--optimizer, --lora-rank / --rank, --batch / --micro-batch, --gpu); the text-model ones (--seq-len, ZeRO, ...) do
not apply to this first slice."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..diffusion.readers import split_words, with_config
from ..errors import ConfigError
from .common import DOES_NOT_FIT, app, console, examples, parse_pixels, print_json
from .options import config_section

GIB = 2 ** 30


def parse_resolution(value: str) -> tuple[int, int]:
    """'1024' or '768x1344' (height x width) -> (1024, 1024) / (768, 1344)."""
    return parse_pixels(value, "--resolution", "pixels, one side or HEIGHTxWIDTH (e.g. 1024 or 768x1344)")


@app.command("diffusion", epilog=examples(
    "memfit diffusion flux.1-dev --resolution 1024 --method lora --rank 16 --gpu RTX-4090 --cache-latents "
    "--cache-text --checkpointing",
    "memfit diffusion sdxl-base --resolution 1024 --method full --optimizer adamw8bit --gpu A100-40GB --json",
    "memfit diffusion ./transformer/config.json --resolution 512",
    "memfit diffusion --config flux_lora.toml --gpu RTX-4090",
    "memfit diffusion -- accelerate launch train_dreambooth_lora_flux.py --resolution 512 --rank 16"))
def diffusion_command(
        ctx: typer.Context,
        model: Annotated[Optional[str], typer.Argument(
            help="A catalog entry (flux.1-dev, sd3.5-large, sdxl-base), its hub id, or a denoiser config.json with "
                 "its _class_name. Optional when --config names a catalog model.")] = None,
        command: Annotated[Optional[list[str]], typer.Argument(
            help="After --: a training command line (accelerate launch / python with a kohya or diffusers "
                 "script and its arguments), read as --config reads one.", show_default=False)] = None,
        config: Annotated[Optional[Path], typer.Option(
            "--config", metavar="FILE", help="Your trainer's config: a kohya sd-scripts TOML, an ai-toolkit YAML, "
            "or a file holding a kohya / diffusers script's command line. Options given here override it.")]
        = None,
        resolution: Annotated[str, typer.Option("--resolution", help="Training pixels: one side or HEIGHTxWIDTH.")]
        = "1024",
        batch: Annotated[int, typer.Option("--batch", "-b", "--micro-batch", min=1, max=4096)] = 1,
        method: Annotated[str, typer.Option("--method", "--finetune", help="full or lora.")] = "lora",
        rank: Annotated[int, typer.Option("--rank", "--lora-rank", "-r", min=1, max=65536)] = 16,
        targets: Annotated[Optional[str], typer.Option(
            "--lora-targets", help="attention (to_k,to_q,to_v,to_out.0: the diffusers scripts' default), all, or "
                                   "module names separated by commas.")] = None,
        lora_dtype: Annotated[str, typer.Option("--lora-dtype", help="The adapters' dtype: fp32 (peft, "
                                                "cast_training_params) or bf16 / fp16.")] = "fp32",
        precision: Annotated[str, typer.Option("--precision", help="amp-bf16 (--mixed_precision bf16: frozen "
                                               "weights bf16, full fine-tune weights fp32), bf16, fp32, amp-fp16."
                                               )] = "amp-bf16",
        checkpointing: Annotated[bool, typer.Option("--checkpointing/--no-checkpointing",
                                                    help="diffusers' enable_gradient_checkpointing.")] = False,
        optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="adamw (default), adamw8bit, ...")]
        = None,
        cache_latents: Annotated[bool, typer.Option("--cache-latents", help="Latents encoded once before "
                                                    "training; the VAE leaves the GPU.")] = False,
        cache_text: Annotated[bool, typer.Option("--cache-text", help="Prompt embeddings computed once; the text "
                                                 "encoders leave the GPU.")] = False,
        base_dtype: Annotated[str, typer.Option("--base-dtype", help="LoRA's frozen base: bf16 (as --precision "
                                                "says), fp8 (layerwise casting / kohya --fp8_base) or nf4 "
                                                "(bitsandbytes 4-bit).")] = "bf16",
        blocks_to_swap: Annotated[int, typer.Option("--blocks-to-swap", min=0, max=4096, help="kohya / "
                                                    "musubi-tuner block swap: N blocks' weights in host RAM.")] = 0,
        exact: Annotated[bool, typer.Option("--exact", help="Trace the whole denoiser instead of the per-block "
                                            "fit (Flux, SD3: minutes instead of seconds).")] = False,
        plan: Annotated[bool, typer.Option("--plan", help="The diffusion ladder: levers cheapest first until it "
                                           "fits, with the flags to paste.")] = False,
        gpu: Annotated[str, typer.Option("--gpu")] = "RTX-4090",
        json_output: Annotated[bool, typer.Option("--json")] = False) -> None:
    """A diffusion fine-tune's memory by phase (Flux, SD3 / 3.5, SDXL): latents, tokens, encoders, what fits."""
    values = dict(resolution=parse_resolution(resolution), batch=batch, method=method, rank=rank, targets=targets,
                  lora_dtype=lora_dtype, precision=precision, checkpointing=checkpointing, optimizer=optimizer,
                  cache_latents=cache_latents, cache_text=cache_text, base_dtype=base_dtype,
                  blocks_to_swap=blocks_to_swap)
    model, words = split_words(model, command)
    reading = None
    if config is not None or words:  # read before torch loads: a bad file is one line at once
        given = {k for k in values  # typer's own click: its ParameterSource named, not imported
                 if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}
        values, model, reading = with_config(values, given, model, config, words)
    elif model is None:
        raise ConfigError("Missing argument 'MODEL': give a model, or a --config that names one")
    from ..diffusion import api, ladder  # torch and diffusers load when the command runs

    size = values.pop("resolution")
    values["exact"] = exact
    if plan:
        _plan(ladder, model, size, gpu, values, json_output)
        return
    result, hardware, (ok, required, budget) = api.size_run(model, resolution=size, gpu=gpu, **values)
    if json_output:
        print_json({**_json(result, hardware, ok, required, budget),
                    **({"config": reading.to_dict()} if reading else {})})
    else:
        _print(result, hardware, ok, required, budget)
        if reading is not None:
            typer.echo("\n".join(config_section(reading) + [f"  note: {n}" for n in reading.notes]))
    if not ok:
        raise typer.Exit(DOES_NOT_FIT)


def _json(result, hardware, ok, required, budget) -> dict:
    import dataclasses

    return {"model": result.model, "family": result.family, "gpu": hardware.gpu.name, "fits": ok,
            "required_bytes": required, "budget_bytes": budget, "peak_phase": result.peak.name,
            "resolution": [result.shapes.height, result.shapes.width], "batch": result.batch,
            "latent": list(result.shapes.latent), "image_tokens": result.shapes.image_tokens,
            "text_tokens": result.shapes.text_tokens, "method": result.method,
            "rank": result.rank if result.method != "full" else None, "lora_targets": list(result.targets),
            "denoiser_params": result.denoiser_params, "trainable_params": result.trainable_params,
            "cache_latents": result.cache_latents, "cache_text": result.cache_text, "base_dtype": result.base_dtype,
            "blocks_to_swap": result.swap.blocks if result.swap else 0,
            "host_bytes": result.swap.host_bytes if result.swap else 0, "fitted_per_block": result.fitted,
            "frozen": [dataclasses.asdict(f) for f in result.frozen],
            "phases": [{"name": p.name, "bytes": p.bytes, "parts": dict(p.parts)} for p in result.phases],
            "estimate": result.memory.to_dict(), "notes": list(result.notes)}


def _print(result, hardware, ok, required, budget) -> None:
    out = console()
    shp = result.shapes
    c, h, w = shp.latent
    tokens = (f"{shp.image_tokens:,} image + {shp.text_tokens:,} text tokens" if shp.image_tokens
              else f"UNet on the latent, cross-attention over {shp.text_tokens} text tokens")
    out.print(f"[bold]{result.model}[/bold]  {shp.height}x{shp.width} px, batch {result.batch}: latent {c}x{h}x{w}; "
              f"{tokens}")
    what = "full fine-tune" if result.method == "full" else f"LoRA r{result.rank} on {', '.join(result.targets)}"
    base = "" if result.base_dtype == "bf16" else f"; base {result.base_dtype}"
    how = "fitted per block" if result.fitted else "traced whole"
    out.print(f"  denoiser {result.denoiser_params:,} params; {what}: {result.trainable_params:,} trainable{base} "
              f"({how})")
    if result.swap is not None:
        out.print(f"  block swap {result.swap.blocks}: {result.swap.describe()} in host RAM, "
                  f"{result.swap.host_bytes / GIB:.2f} GiB off the GPU")
    for part in result.frozen:
        where = "cached, leaves the GPU" if part not in result.resident else "on the GPU"
        out.print(f"  {part.name:<16} {part.params:>15,} params  {part.weight_bytes / GIB:6.2f} GiB {part.dtype}  "
                  f"forward {part.forward_bytes / GIB:5.2f} GiB  ({where})")
    for phase in result.phases:
        marker = " <- peak" if phase is result.peak else ""
        out.print(f"  [bold]{phase.name}[/bold]: {phase.bytes / GIB:.2f} GiB{marker}")
        for name, num in phase.parts:
            if num:
                out.print(f"      {name:<30} {num / GIB:8.2f} GiB")
    verdict = "[green]fits[/green]" if ok else "[red]does not fit[/red]"
    out.print(f"  on {hardware.gpu.name}: {required / GIB:.2f} of {budget / GIB:.2f} GiB usable -> {verdict}")


def _plan(ladder, model, size, gpu, values, json_output) -> None:
    first, rungs = ladder.plan(model, resolution=size, gpu=gpu, **values)
    ok = not rungs or rungs[-1].fits
    if json_output:
        print_json({"model": first.model, "gpu": gpu, "fits": ok, "rungs": [
            {"title": r.title, "changes": {k: list(v) if isinstance(v, tuple) else v for k, v in r.changes.items()},
             "required_bytes": r.required, "budget_bytes": r.budget, "fits": r.fits, "host_bytes": r.host_bytes,
             "cost": r.cost, "kohya": r.kohya, "diffusers": r.diffusers} for r in rungs]})
    else:
        out = console()
        out.print(f"[bold]{first.model}[/bold] on {gpu}: diffusion ladder (cheapest first, re-estimated after each)")
        if not rungs:
            out.print("  fits as given")
        for i, r in enumerate(rungs, 1):
            verdict = "yes" if r.fits else "no"
            out.print(f"  {i}. {r.title:<28} {r.required / GIB:8.2f} of {r.budget / GIB:.2f} GiB  fits: {verdict}")
            out.print(f"     cost       {r.cost}")
            out.print(f"     kohya      {r.kohya}")
            out.print(f"     diffusers  {r.diffusers}")
    if not ok:
        raise typer.Exit(DOES_NOT_FIT)

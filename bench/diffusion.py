"""memfit diffusion against real CPU training steps: tiny Flux, SD3 and SDXL-UNet configs (memfit.diffusion.presets.
tiny_model) built by diffusers from their configs, fed the tensors the diffusers DreamBooth scripts give them at a
128 x 128 resolution (memfit.diffusion.latents / model), measured with the profiler's allocation events
(memfit.measure) and traced on fake tensors with the CPU's kernels (memfit.diffusion.model.trace_denoiser: the
answer `memfit diffusion` gives for the denoiser's step, with CUDA's kernels there).

    python bench/diffusion.py            # prints the table and writes bench/results/diffusion.md
    python bench/diffusion.py --levers   # the base-weight levers and the per-block fit only (its own section)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from memfit.diffusion.api import diffusion_setup, estimate_diffusion
from memfit.diffusion.latents import shapes
from memfit.diffusion.model import measure_denoiser, trace_denoiser
from memfit.diffusion.presets import tiny_model

RESULTS = Path(__file__).parent / "results" / "diffusion.md"
RESOLUTION, BATCH = 128, 2
SETUPS = {
    "full fp32": dict(method="full", precision="fp32"),
    "full amp-bf16": dict(method="full", precision="amp-bf16"),
    "full amp-bf16, checkpointing": dict(method="full", precision="amp-bf16", checkpointing=True),
    "LoRA r8 bf16 base, fp32 adapters, amp-bf16": dict(method="lora", rank=8, precision="amp-bf16"),
    "LoRA r8 all targets, amp-bf16, checkpointing": dict(method="lora", rank=8, precision="amp-bf16",
                                                          targets="all", checkpointing=True),
    "LoRA r8 pure bf16, bf16 adapters": dict(method="lora", rank=8, precision="bf16", lora_dtype="bf16"),
    "full amp-bf16, 8-bit AdamW": dict(method="full", precision="amp-bf16", optimizer="adamw8bit"),
    "LoRA r8 amp-bf16, checkpointing, 8-bit AdamW": dict(method="lora", rank=8, precision="amp-bf16",
                                                           checkpointing=True, optimizer="adamw8bit"),
}


def run_case(family: str, fields: dict) -> tuple[int, int]:
    fields = dict(fields)
    lora_dtype = fields.pop("lora_dtype", "fp32")
    model = tiny_model(family)
    shp = shapes(model, RESOLUTION, RESOLUTION)
    setup = diffusion_setup(family=family, batch=BATCH, **fields)
    measured = measure_denoiser(model, shp, setup, batch=BATCH, lora_dtype=lora_dtype).tensor_bytes
    traced = trace_denoiser(model, shp, setup, batch=BATCH, kernels="cpu", lora_dtype=lora_dtype).tensor_bytes
    return measured, traced


LEVERS_MARK = "## Base-weight levers and the per-block fit"
LEVERS = {
    "LoRA r8 fp8 base (layerwise casting), amp-bf16": dict(method="lora", rank=8, base_dtype="fp8"),
    "LoRA r8 fp8 base, amp-bf16, checkpointing": dict(method="lora", rank=8, base_dtype="fp8", checkpointing=True),
    "LoRA r8 nf4 base (bitsandbytes CPU 4-bit), amp-bf16": dict(method="lora", rank=8, base_dtype="nf4"),
}
FIT_CASES = (("flux.1-dev", dict(method="lora", rank=16), "LoRA r16"),
             ("flux.1-dev", dict(method="lora", rank=16, checkpointing=True), "LoRA r16, checkpointing"),
             ("sd3.5-large", dict(method="lora", rank=16, checkpointing=True), "LoRA r16, checkpointing"))


def run_lever(family: str, fields: dict) -> tuple[int, int]:
    fields = dict(fields)
    base = fields.pop("base_dtype")
    model = tiny_model(family)
    shp = shapes(model, RESOLUTION, RESOLUTION)
    setup = diffusion_setup(family=family, batch=BATCH, base_dtype=base, **fields)
    measured = measure_denoiser(model, shp, setup, batch=BATCH, base_dtype=base).tensor_bytes
    traced = trace_denoiser(model, shp, setup, batch=BATCH, kernels="cpu", base_dtype=base).tensor_bytes
    return measured, traced


def levers() -> int:
    rows = []
    for family in ("flux", "sd3", "sdxl"):
        for name, fields in LEVERS.items():
            if family == "sdxl" and fields.get("checkpointing") and fields["base_dtype"] == "fp8":
                rows.append(f"| {family} | {name} | - | - | not run: the real step raises torch.utils.checkpoint's "
                            "CheckpointError (recomputed metadata differs) |")
                continue
            measured, traced = run_lever(family, fields)
            rows.append(f"| {family} | {name} | {measured:,} | {traced:,} | {(traced - measured) / measured:+.2%} |")
            print(rows[-1], flush=True)
    fits = []
    for name, fields, label in FIT_CASES:
        setup = diffusion_setup(family="flux" if name.startswith("flux") else "sd3", **fields)
        start = time.time()
        fitted = estimate_diffusion(name, resolution=1024, setup=setup)
        middle = time.time()
        whole = estimate_diffusion(name, resolution=1024, setup=setup, exact=True)
        end = time.time()
        a, b = fitted.memory.tensor_bytes, whole.memory.tensor_bytes
        fits.append(f"| {name} | {label} | {a:,} ({'fitted' if fitted.fitted else 'traced whole'}, "
                    f"{middle - start:.0f} s) | {b:,} ({end - middle:.0f} s) | {a - b:+,} B |")
        print(fits[-1], flush=True)
    text = "\n".join([
        LEVERS_MARK, "", "Generated by `python bench/diffusion.py --levers`. The same tiny denoisers, "
        f"{RESOLUTION} x {RESOLUTION} px, batch {BATCH}: `--base-dtype fp8` (diffusers' enable_layerwise_casting, "
        "fp8 e4m3 storage, bf16 compute) and `--base-dtype nf4` (bitsandbytes Linear4bit on CPU, nf4, no double "
        "quantization, peft prepare_model_for_kbit_training), real CPU steps against the trace.", "",
        "| family | setup | measured B | traced B | error |", "|---|---|---|---|---|", *rows, "",
        "Per-block fit (memfit.diffusion.blocks; 1- and 2-block copies traced at the real shape, first run, "
        "no cache) against the whole denoiser traced, 1024 x 1024 px, batch 1, amp-bf16, CUDA kernels:", "",
        "| model | setup | fitted B (time) | whole trace B (time) | difference |", "|---|---|---|---|---|", *fits,
        ""])
    old = RESULTS.read_text()
    head = old.split(LEVERS_MARK)[0].rstrip("\n")
    RESULTS.write_text(f"{head}\n\n{text}")
    return 0


def main() -> int:
    if "--levers" in sys.argv[1:]:
        return levers()
    rows, errors = [], {}
    for family in ("flux", "sd3", "sdxl"):
        for name, fields in SETUPS.items():
            start = time.time()
            measured, traced = run_case(family, fields)
            error = (traced - measured) / measured
            errors.setdefault(family, []).append(abs(error))
            rows.append(f"| {family} | {name} | {measured:,} | {traced:,} | {error:+.2%} |")
            print(rows[-1], f"({time.time() - start:.0f} s)", flush=True)
    every = [e for family in errors.values() for e in family]
    lines = [f"- {family}: median |error| {statistics.median(e):.2%}, worst {max(e):.2%}"
             for family, e in errors.items()]
    summary = f"{len(every)} cases: median |error| {statistics.median(every):.2%}, worst {max(every):.2%}"
    text = "\n".join([
        "# memfit diffusion: traced vs measured (CPU)", "",
        "Generated by `python bench/diffusion.py`. Tiny Flux / SD3 / SDXL-UNet denoisers "
        "(memfit.diffusion.presets.tiny_model) built by diffusers from their configs, "
        f"{RESOLUTION} x {RESOLUTION} px, batch {BATCH}; peak tensor bytes of two real optimizer steps on CPU "
        "(torch.profiler allocation events, memfit.measure) against the trace on fake tensors with the CPU's "
        "kernels. LoRA: peft on to_k / to_q / to_v / to_out.0 (all: the context stream and feed-forwards too); "
        "checkpointing: diffusers' enable_gradient_checkpointing; 8-bit AdamW: bitsandbytes' CPU step.", "",
        "| family | setup | measured B | traced B | error |", "|---|---|---|---|---|", *rows, "",
        summary, "", *lines, ""])
    old = RESULTS.read_text() if RESULTS.exists() else ""
    kept = old[old.index(LEVERS_MARK):] if LEVERS_MARK in old else ""
    RESULTS.write_text(f"{text}\n{kept}" if kept else text)
    print(summary)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Analytic vs traced at full size: the catalog's real shapes (7B, 13B, 70B class) across the technique matrix.

    python bench/fullsize.py [--quick]     # writes bench/results/fullsize.md

The trace runs the real HF training step on fake tensors (exact tensor peak of that code on the CPU's kernels), so
the analytic side is evaluated for a CPU device too (same kernel choices: e.g. dropout masks); on a GPU the two
differ only where the kernels do. Cases disagreeing by more than 3% are flagged.

Sharded rows use engine torch on both sides (the trace runs FSDP2 over a fake process group). Gemma 2 runs eager
only: transformers refuses torch SDPA for it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import catalog_config, resolve_model
from memfit.trace import trace

HERE = Path(__file__).resolve().parent
BASE = {"micro_batch_size": 1, "seq_len": 2048, "precision": "fp32", "optimizer": "adamw", "attention": "sdpa"}
VARIANTS = {
    "fp32 adamw": {},
    "pure bf16": {"precision": "bf16"},
    "autocast bf16": {"precision": "amp-bf16"},
    "bf16 + ckpt": {"precision": "bf16", "checkpointing": "full"},
    "eager": {"attention": "eager", "seq_len": 1024},
    "8-bit adamw": {"optimizer": "adamw-8bit", "precision": "bf16"},
    "foreach": {"optimizer": "adamw-foreach"},
    "B=4 T=512": {"micro_batch_size": 4, "seq_len": 512},
    "zero3 x8 bf16-master": {"precision": "bf16-master", "sharding": "zero3", "num_gpus": 8, "engine": "torch"},
    "zero2 x8 bf16-master": {"precision": "bf16-master", "sharding": "zero2", "num_gpus": 8, "engine": "torch"},
    "zero3 x8 + offload": {"precision": "bf16-master", "sharding": "zero3", "num_gpus": 8, "engine": "torch",
                           "offload": "optimizer+params"},
    "bf16 B=8": {"precision": "bf16", "micro_batch_size": 8},
    "bf16 eager B=4 T=1024": {"precision": "bf16", "attention": "eager", "micro_batch_size": 4, "seq_len": 1024},
    "eager bf16": {"attention": "eager", "precision": "bf16", "seq_len": 1024},
    "eager bf16 + ckpt": {"attention": "eager", "precision": "bf16", "seq_len": 1024, "checkpointing": "full"},
}
MODELS = {
    "llama-2-7b": list(VARIANTS), "llama-2-13b": ["fp32 adamw", "bf16 + ckpt", "bf16 B=8", "zero3 x8 bf16-master"],
    "llama-3.1-70b": ["bf16 + ckpt", "zero3 x8 bf16-master"], "qwen2.5-7b": ["fp32 adamw", "pure bf16", "eager", "bf16 B=8", "bf16 eager B=4 T=1024"],
    "mistral-7b": ["fp32 adamw", "bf16 + ckpt"], "gpt2-xl": ["fp32 adamw", "pure bf16", "bf16 + ckpt"],
    "bert-large-uncased": ["fp32 adamw", "bf16 + ckpt"], "pythia-6.9b": ["fp32 adamw", "bf16 + ckpt"],
    "phi-3-mini": ["fp32 adamw", "bf16 + ckpt"], "gemma-2-9b": ["eager bf16", "eager bf16 + ckpt"],
}
QUICK = {"llama-2-7b": ["fp32 adamw", "bf16 + ckpt"], "gpt2-xl": ["fp32 adamw"]}


def main(argv: list[str]) -> int:
    models = QUICK if "--quick" in argv else MODELS
    hw_cpu = make_hardware(cpu_device(8 * 1024**4))
    lines = ["| model | setup | traced GiB | analytic GiB | error % | peak phase (traced / analytic) | trace s |",
             "|---|---|---:|---:|---:|---|---:|"]
    flagged = 0
    for model, variants in models.items():
        spec = resolve_model(model)
        for variant in variants:
            overrides = {**BASE, **VARIANTS[variant]}
            overrides["seq_len"] = min(overrides["seq_len"], spec.max_position_embeddings or overrides["seq_len"])
            try:
                setup = TrainingSetup(**overrides)
            except ConfigError as error:
                lines.append(f"| {model} | {variant} | - | - | - | {error} | - |")
                continue
            hw = hw_cpu if setup.num_gpus == 1 else make_hardware(cpu_device(8 * 1024**4), gpus_per_node=8)
            start = time.perf_counter()
            try:
                traced = trace(catalog_config(model), setup)
            except Exception as error:  # a bench reports what failed and goes on
                lines.append(f"| {model} | {variant} | failed: {type(error).__name__}: {str(error)[:80]} | | | | |")
                print(lines[-1], flush=True)
                continue
            seconds = time.perf_counter() - start
            predicted = estimate(spec, setup, hw)
            err = 100 * (predicted.tensor_bytes - traced.tensor_bytes) / traced.tensor_bytes
            flag = " **>3%**" if abs(err) > 3 else ""
            flagged += bool(flag)
            lines.append(f"| {model} | {variant} | {traced.tensor_bytes / 2**30:.2f} | "
                         f"{predicted.tensor_bytes / 2**30:.2f} | {err:+.2f}{flag} | "
                         f"{traced.peak_phase.value} / {predicted.peak_phase.value} | {seconds:.1f} |")
            print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"{flagged} case(s) disagree by more than 3%.")
    text = "\n".join(lines)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "fullsize.md").write_text(
        "# Analytic vs traced at full size (`python bench/fullsize.py`)\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

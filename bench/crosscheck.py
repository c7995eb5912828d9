"""One truth, full matrix: the formulas against the trace at full size, on the same target-device semantics.

    python bench/crosscheck.py [--quick] [--families llama,gpt2]     # writes bench/results/crosscheck.md

Every catalog family at its real shape (and the 7B-70B catalog shapes on a few setups each), on an H100 (so both sides take CUDA's kernel choices: bool dropout masks,
flash / memory-efficient SDPA), across precision, optimizer (single-tensor, foreach, fused, 8-bit, Adafactor, SGD),
checkpointing, attention, ZeRO 1/2/3 on both engines, data parallelism and offload. Each row is compared like for
like (memfit.verify.cross_check: the formulas on the layout the trace runs, FSDP2) and flagged beyond 3%; the
engine's own layout (DeepSpeed, DDP) is shown beside it, from the formulas. tests/trace/test_crosscheck.py runs a subset.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from memfit.errors import ConfigError
from memfit.hardware import make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import catalog_config, resolve_model
from memfit.trace import trace
from memfit.verify import TOLERANCE, cross_check

HERE = Path(__file__).resolve().parent
FAMILIES = {"llama": "llama-3.2-1b", "mistral": "mistral-7b", "qwen2": "qwen2.5-0.5b", "gemma2": "gemma-2-2b",
            "phi3": "phi-3-mini", "gpt2": "gpt2-large", "gpt_neox": "pythia-1b", "bert": "bert-large-uncased"}
BASE = {"micro_batch_size": 2, "seq_len": 1024, "precision": "bf16", "optimizer": "adamw", "attention": "sdpa"}
X8 = {"num_gpus": 8}
SETUPS = {
    "fp32 adamw": {"precision": "fp32"},
    "amp-bf16 foreach": {"precision": "amp-bf16", "optimizer": "adamw-foreach"},
    "bf16 fused": {"optimizer": "adamw-fused"},
    "bf16-master adamw": {"precision": "bf16-master"},
    "bf16 8-bit": {"optimizer": "adamw-8bit"},
    "fp32 adafactor": {"precision": "fp32", "optimizer": "adafactor"},
    "fp32 sgd": {"precision": "fp32", "optimizer": "sgd"},
    "bf16 ckpt": {"checkpointing": "full"},
    "amp-bf16 ckpt B=4": {"precision": "amp-bf16", "checkpointing": "full", "micro_batch_size": 4},
    "eager amp-bf16": {"attention": "eager", "precision": "amp-bf16"},
    "eager bf16 ckpt": {"attention": "eager", "checkpointing": "full"},
    "accum 2": {"grad_accum_steps": 2},
    "ddp x8 torch": {**X8, "engine": "torch", "precision": "amp-bf16"},
    "zero1 x8 torch": {**X8, "sharding": "zero1", "engine": "torch", "precision": "amp-bf16"},
    "zero1 x8 deepspeed": {**X8, "sharding": "zero1", "engine": "deepspeed", "precision": "bf16-master"},
    "zero2 x8 torch": {**X8, "sharding": "zero2", "engine": "torch", "precision": "bf16-master"},
    "zero2 x8 deepspeed 8-bit": {**X8, "sharding": "zero2", "engine": "deepspeed", "optimizer": "adamw-8bit"},
    "zero3 x8 torch ckpt": {**X8, "sharding": "zero3", "engine": "torch", "checkpointing": "full"},
    "zero3 x8 torch foreach": {**X8, "sharding": "zero3", "engine": "torch", "optimizer": "adamw-foreach"},
    "zero3 x8 deepspeed ckpt": {**X8, "sharding": "zero3", "engine": "deepspeed", "checkpointing": "full"},
    "zero3 x8 torch offload": {**X8, "sharding": "zero3", "engine": "torch", "precision": "bf16-master",
                               "offload": "optimizer+params"},
    "zero2 x8 deepspeed offload": {**X8, "sharding": "zero2", "engine": "deepspeed", "precision": "bf16-master",
                                   "offload": "optimizer"},
}
# the larger catalog shapes (7B to 70B), on the setups where each family's size matters most
SIZES = {"llama-2-7b": ["fp32 adamw", "amp-bf16 foreach", "bf16 ckpt", "eager bf16 ckpt", "zero3 x8 torch ckpt"],
         "llama-2-13b": ["bf16 ckpt", "zero3 x8 deepspeed ckpt"],
         "llama-3.1-70b": ["bf16 ckpt", "zero3 x8 torch ckpt", "zero3 x8 torch offload"],
         "qwen2.5-7b": ["bf16 fused", "eager amp-bf16"], "gpt2-xl": ["fp32 adamw", "bf16 ckpt"],
         "pythia-6.9b": ["fp32 adamw", "bf16 ckpt"], "gemma-2-9b": ["eager bf16 ckpt"],
         "llama-2-70b": ["zero3 x8 deepspeed ckpt"]}
QUICK = {"llama": ["bf16 ckpt", "zero3 x8 torch foreach", "zero2 x8 deepspeed 8-bit"], "gpt2": ["fp32 adamw"]}
EAGER_ONLY = {"gemma2"}  # transformers refuses torch SDPA for Gemma 2


def case_setup(model_type: str, name: str, max_positions: int) -> TrainingSetup:
    overrides = {**BASE, **SETUPS[name]}
    if model_type in EAGER_ONLY:
        overrides["attention"] = "eager"
    overrides["seq_len"] = min(overrides["seq_len"], max_positions or overrides["seq_len"])
    return TrainingSetup(**overrides)


def run_case(model: str, name: str, gpu: str = "H100"):
    """(CrossCheck, trace seconds) for one cell of the matrix: a family key or a catalog model name."""
    model = FAMILIES.get(model, model)
    spec = resolve_model(model)
    setup = case_setup(spec.model_type, name, spec.max_position_embeddings)
    hardware = make_hardware(gpu, gpus_per_node=min(setup.num_gpus, 8))
    start = time.perf_counter()
    traced = trace(catalog_config(model), setup, kernels="cuda")
    seconds = time.perf_counter() - start
    return cross_check(spec, setup, hardware, traced), seconds


def main(argv: list[str]) -> int:
    wanted = {**{f: list(SETUPS) for f in FAMILIES}, **SIZES}
    if "--quick" in argv:
        wanted = QUICK
    for arg in argv:
        if arg.startswith("--families="):
            wanted = {f: list(SETUPS) if f in FAMILIES else SIZES[f] for f in arg.split("=", 1)[1].split(",")}
    lines = ["| family (model) | setup | traced GiB | formulas, same layout | error | formulas, own engine | "
             "trusted | trace s |", "|---|---|---:|---:|---:|---:|---|---:|"]
    errors, failures = [], 0
    for family, names in wanted.items():
        for name in names:
            try:
                check, seconds = run_case(family, name)
            except ConfigError as error:
                lines.append(f"| {family} ({FAMILIES.get(family, family)}) | {name} | - | - | - | - | not a valid setup: "
                             f"{str(error)[:70]} | - |")
                continue
            except Exception as error:  # a bench reports what failed and goes on
                failures += 1
                lines.append(f"| {family} | {name} | failed: {type(error).__name__}: {str(error)[:80]} | | | | | |")
                print(lines[-1], flush=True)
                continue
            errors.append((abs(check.error), family, name, check.error))
            flag = "" if check.agrees else " **>3%**"
            lines.append(f"| {family} ({FAMILIES.get(family, family)}) | {name} | {check.traced.tensor_bytes / 2**30:.3f} | "
                         f"{check.like_for_like.tensor_bytes / 2**30:.3f} | {check.error:+.2%}{flag} | "
                         f"{check.asked.tensor_bytes / 2**30:.3f} | {check.trusted} | {seconds:.1f} |")
            print(lines[-1], flush=True)
    errors.sort(reverse=True)
    beyond = [e for e in errors if e[0] > TOLERANCE]
    median = sorted(e[0] for e in errors)[len(errors) // 2] if errors else 0.0
    summary = [f"{len(errors)} cases, {len(beyond)} beyond {TOLERANCE:.0%}, median |error| {median:.2%}, "
               f"{failures} failed.", "", "Worst cases:"]
    summary += [f"- {family} / {name}: {err:+.2%}" for _, family, name, err in errors[:8]]
    text = "\n".join(lines + [""] + summary)
    print("\n".join(summary))
    if "--quick" not in argv:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "crosscheck.md").write_text(
            "# Formulas vs trace at full size, same target semantics (`python bench/crosscheck.py`)\n\n"
            "H100 target (CUDA kernel choices on both sides); error = (formulas - trace) / trace on tensor bytes, "
            "like for like (formulas on the layout the trace runs). 'formulas, own engine' is the setup's own "
            "engine layout (DeepSpeed / DDP buffers), which the trace cannot run.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

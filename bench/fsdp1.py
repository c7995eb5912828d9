"""FSDP1 (FullyShardedDataParallel, flat parameters) on real gloo ranks (CPU) vs memfit's formulas
(memfit.estimate.fsdp1), and what memfit answered before it sized FSDP1 (FSDP2's per-parameter sharding).

    OMP_NUM_THREADS=1 python bench/fsdp1.py            # run, print the table, a few minutes
    OMP_NUM_THREADS=1 python bench/fsdp1.py --write    # and write bench/results/fsdp1.md
    python bench/fsdp1.py --filter lora --keep /tmp/fsdp1.json   # only those setups; keep / reuse the measurements

Each setup is run by tests/fsdp1_worker.py: the tiny Llama of tests/tiny_configs.py (full fine-tune, or peft LoRA
on every Linear), wrapped by memfit._torch.fsdp1.wrap as accelerate / the HF Trainer (fsdp_version 1: peft's
auto-wrap policy gives each adapter Linear a unit of its own) or Lightning / LitGPT (1-blocks: the blocks are the
only units, use_orig_params=True) wrap it, AdamW, two steps under memfit._torch.rank_memory.PeakMeter. gloo frees
some buffers on its own threads, which the profiler does not see: each rank's peak is an interval [peak - unseen,
peak]; the error is the formula's distance to it (0 inside), the worst rank's; the summary gives the median and
the worst over the setups. Each step is also run under FSDP2 (tests/lora_fsdp_worker.py) to show what FSDP1 adds,
measured and sized.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from tiny_configs import TINY_LLAMA  # noqa: E402

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

LORA = {"method": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]}
FSDP2 = "@fsdp2"


def cases(ranks: int = 2) -> dict[str, tuple[dict, TrainingSetup]]:
    out: dict[str, tuple[dict, dict]] = {}
    big, small = dict(TINY_LLAMA), dict(TINY_LLAMA, vocab_size=64)  # small: the peak moves into the blocks
    for sharding in ("zero3", "zero2"):
        for precision in ("fp32", "amp-bf16"):
            for ckpt in ("none", "full"):
                out[f"full-{sharding}-{precision}-ckpt_{ckpt}"] = (big, dict(
                    sharding=sharding, precision=precision, checkpointing=ckpt, fsdp_version="1"))
            for version in ("1", "1-blocks"):
                out[f"lora-v{version}-{sharding}-{precision}"] = (big, dict(
                    sharding=sharding, precision=precision, checkpointing="none", fsdp_version=version,
                    finetune=LORA))
    out["lora-v1-blocks-zero3-amp-bf16-ckpt_full"] = (big, dict(
        sharding="zero3", precision="amp-bf16", checkpointing="full", fsdp_version="1-blocks", finetune=LORA))
    out["lora-v1-blocks-zero3-bf16"] = (big, dict(sharding="zero3", precision="bf16", checkpointing="none",
                                                  fsdp_version="1-blocks", finetune=LORA))
    for precision in ("fp32", "amp-bf16"):
        for ckpt in ("none", "full"):
            out[f"full-zero3-{precision}-ckpt_{ckpt}-v64"] = (small, dict(
                sharding="zero3", precision=precision, checkpointing=ckpt, fsdp_version="1"))
            for version in ("1", "1-blocks"):
                out[f"lora-v{version}-zero3-{precision}-ckpt_{ckpt}-v64"] = (small, dict(
                    sharding="zero3", precision=precision, checkpointing=ckpt, fsdp_version=version,
                    finetune=LORA))
    return {name: (config, TrainingSetup(micro_batch_size=2, seq_len=128 if config is big else 256,
                                         optimizer="adamw", engine="torch", num_gpus=ranks, **fields))
            for name, (config, fields) in out.items()}


def run_all(chosen: dict, ranks: int, worker: str = "fsdp1_worker.py") -> dict[str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    by_config: dict[str, dict] = {}
    for name, (config, setup) in chosen.items():
        by_config.setdefault(json.dumps(config, sort_keys=True), {})[name] = setup
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (config, group) in enumerate(by_config.items()):
            config_path, out = Path(tmp) / f"config{index}.json", Path(tmp) / f"out{index}"
            config_path.write_text(config)
            setups = {n: {k: v for k, v in s.to_dict().items() if k != "notes"} for n, s in group.items()}
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    str(REPO / "tests" / worker), str(config_path), str(out), json.dumps(setups), "2"]
            done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise SystemExit(done.stderr[-4000:])
            for name in group:
                results[name] = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(ranks)]
    return results


def measured_interval(rank: dict) -> tuple[int, int]:
    """[low, high] of a rank's peak: gloo frees some buffers on its own threads, unseen by the profiler."""
    return rank["peak_bytes"] - rank["unseen_at_peak_bytes"], rank["peak_bytes"]


def error(predicted: int, interval: tuple[int, int]) -> float:
    low, high = interval
    return 0.0 if low <= predicted <= high else (predicted - high) / high if predicted > high else (
        predicted - low) / low


def table(chosen: dict, results: dict, ranks: int) -> str:
    hardware = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=ranks)
    lines = ["| setup | measured peak B (per rank) | memfit FSDP1 B | error | moment | memfit before (FSDP2) B | "
             "error before | FSDP1 - FSDP2 measured B | memfit's FSDP1 - FSDP2 B |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    errors, before_errors = [], []
    for name, (config, setup) in chosen.items():
        failed = [rank["error"] for rank in results[name] if "error" in rank]
        if failed:
            lines.append(f"| {name} | {failed[0]} | | | | | | | |")
            continue
        spec = resolve_model(config)
        predicted = estimate(spec, setup, hardware)
        before = estimate(spec, setup.replace(fsdp_version="2"), hardware)
        intervals = [measured_interval(rank) for rank in results[name]]
        worst = max((error(predicted.tensor_bytes, i) for i in intervals), key=abs)
        worst_before = max((error(before.tensor_bytes, i) for i in intervals), key=abs)
        errors.append(worst)
        before_errors.append(worst_before)
        spans = "; ".join(f"{low:,}" if low == high else f"{low:,}..{high:,}" for low, high in intervals)
        fsdp2 = max(rank["peak_bytes"] for rank in results[name + FSDP2]) if name + FSDP2 in results else None
        added = "" if fsdp2 is None else f"{max(r['peak_bytes'] for r in results[name]) - fsdp2:+,}"
        lines.append(f"| {name} | {spans} | {predicted.tensor_bytes:,} | {100 * worst:+.2f}% | "
                     f"{predicted.peak_phase.value} | {before.tensor_bytes:,} | {100 * worst_before:+.2f}% | "
                     f"{added} | {predicted.tensor_bytes - before.tensor_bytes:+,} |")

    def summary(values: list[float]) -> str:
        return (f"median {100 * statistics.median(abs(e) for e in values):.2f}%, worst "
                f"{100 * max(values, key=abs):+.2f}%, within 2%: {sum(abs(e) <= 0.02 for e in values)}/{len(values)}")

    return (f"# FSDP1 (flat parameters): formulas vs real {ranks}-rank gloo steps (CPU)\n\nGenerated by "
            f"`bench/fsdp1.py`. {len(errors)} setups on {ranks} gloo ranks (torch FullyShardedDataParallel wrapped "
            "as accelerate / the HF Trainer (`v1`) or Lightning / LitGPT (`v1-blocks`) wrap it). memfit FSDP1: "
            f"{summary(errors)}. Before (FSDP2's sizing): {summary(before_errors)}. The last two columns: the same "
            "step "
            "under FSDP2 (memfit's engine, tests/lora_fsdp_worker.py), its measured peak subtracted, against what "
            "memfit's FSDP1 sizing adds to its FSDP2 sizing. The 64-token (`-v64`, seq 256) rows move the peak into "
            "the blocks, where the one-process formulas are off already (the same step's FSDP2 sizing errs alike: "
            "bench/results/lora_fsdp.md); FSDP1 inherits that. FSDP1's CPUOffload needs an accelerator (torch 2.13 "
            "refuses it on a CPU-only build): it is sized from the code, not measured here.\n\n"
            + "\n".join(lines) + "\n")


def main() -> int:
    ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 2
    chosen = cases(ranks)
    if "--filter" in sys.argv:
        word = sys.argv[sys.argv.index("--filter") + 1]
        chosen = {name: case for name, case in chosen.items() if word in name}
    keep = Path(sys.argv[sys.argv.index("--keep") + 1]) if "--keep" in sys.argv else None
    kept = json.loads(keep.read_text()) if keep is not None and keep.exists() else {}
    missing = {name: case for name, case in chosen.items() if name not in kept}
    if missing:
        kept.update(run_all(missing, ranks))
        if keep is not None:
            keep.write_text(json.dumps(kept))
    # the same steps under FSDP2 (memfit's engine, tests/lora_fsdp_worker.py): what FSDP1 adds, measured
    missing = {name + FSDP2: (config, setup.replace(fsdp_version="2")) for name, (config, setup) in chosen.items()
               if name + FSDP2 not in kept}
    if missing:
        kept.update(run_all(missing, ranks, "lora_fsdp_worker.py"))
        if keep is not None:
            keep.write_text(json.dumps(kept))
    text = table(chosen, kept, ranks)
    print(text)
    if "--write" in sys.argv:
        (HERE / "results" / ("fsdp1.md" if ranks == 2 else f"fsdp1_{ranks}ranks.md")).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

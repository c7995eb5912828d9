"""LoRA / QLoRA under FSDP2 on 2 real gloo ranks (CPU) vs memfit's formulas (memfit.estimate.lora_sharded).

    OMP_NUM_THREADS=1 python bench/lora_fsdp.py           # ~14 setups in one 2-rank torchrun, a few minutes
    OMP_NUM_THREADS=1 python bench/lora_fsdp.py --write   # and write bench/results/lora_fsdp.md
    OMP_NUM_THREADS=1 python bench/lora_fsdp.py --filter qlora-zero3-amp   # only the setups named so

Each setup is run by tests/lora_fsdp_worker.py (the tiny Llama of tests/tiny_configs.py with peft adapters, sharded
by memfit's engine, two AdamW steps under memfit._torch.rank_memory.PeakMeter). gloo frees some buffers on its own
threads, which the profiler does not see: each rank's peak is an interval [peak - unseen, peak]; the error column
is the formula's distance to that interval (0 inside it), the worst rank shown. `1 process`: the same model and
step without sharding (memfit.measure on one process) against the formulas, to tell what FSDP2 adds from what the
one-process LoRA model already misses.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from lora_fsdp_worker import compute_side_interval  # noqa: E402
from tiny_configs import TINY_LLAMA  # noqa: E402

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

RANKS = 2
LORA = {"method": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]}


def cases() -> dict[str, tuple[dict, TrainingSetup]]:
    out = {}
    for vocab, seq in ((512, 128), (64, 256)):
        for sharding, precision, ckpt in itertools.product(("zero2", "zero3"), ("fp32", "amp-bf16"),
                                                           ("none", "full")):
            if vocab == 64 and ckpt == "full":
                continue
            out[f"lora-{sharding}-{precision}-ckpt_{ckpt}-v{vocab}"] = (dict(TINY_LLAMA, vocab_size=vocab), dict(
                sharding=sharding, precision=precision, checkpointing=ckpt, seq_len=seq, finetune=LORA))
    for sharding, precision, ckpt in (("zero2", "fp32", "none"), ("zero3", "fp32", "none"),
                                      ("zero2", "amp-bf16", "none"), ("zero3", "amp-bf16", "none"),
                                      ("zero3", "amp-bf16", "full")):
        out[f"qlora-{sharding}-{precision}-ckpt_{ckpt}-v512"] = (dict(TINY_LLAMA), dict(
            sharding=sharding, precision=precision, checkpointing=ckpt, seq_len=128,
            finetune=dict(LORA, method="qlora")))
    # FSDP-QLoRA as axolotl / TRL run it: no prepare_model_for_kbit_training, the norms and embeddings stay bf16
    for ckpt in ("none", "full"):
        out[f"qlora-zero3-amp-bf16-ckpt_{ckpt}-v512-no-kbit-prep"] = (dict(TINY_LLAMA), dict(
            sharding="zero3", precision="amp-bf16", checkpointing=ckpt, seq_len=128,
            finetune=dict(LORA, method="qlora", kbit_prep=False)))
    for sharding, precision, ckpt in (("zero2", "fp32", "none"), ("zero3", "fp32", "none"),
                                      ("zero3", "amp-bf16", "none"), ("zero3", "amp-bf16", "full")):
        out[f"dora-{sharding}-{precision}-ckpt_{ckpt}-v512"] = (dict(TINY_LLAMA), dict(
            sharding=sharding, precision=precision, checkpointing=ckpt, seq_len=128, finetune=dict(LORA, dora=True)))
    out["dora-qlora-zero3-amp-bf16-ckpt_none-v512"] = (dict(TINY_LLAMA), dict(
        sharding="zero3", precision="amp-bf16", checkpointing="none", seq_len=128,
        finetune=dict(LORA, method="qlora", dora=True)))
    # FSDP-QLoRA with CPU offload (CPUOffloadPolicy): the compute side of each peak, the host tensors taken out
    for method, ckpt in (("lora", "none"), ("qlora", "none"), ("qlora", "full")):
        out[f"{method}-zero3-amp-bf16-offload-ckpt_{ckpt}-v512"] = (dict(TINY_LLAMA), dict(
            sharding="zero3", precision="amp-bf16", checkpointing=ckpt, seq_len=128, offload="optimizer+params",
            finetune=dict(LORA, method=method)))
    # torchtune's recipe (lora_finetune_distributed: bf16 model and adapters, no MixedPrecisionPolicy, torchao NF4
    # base, whose NF4Tensor FSDP2 shards and gathers itself); shapes a multiple of 2 x to_nf4's 16,384 elements
    tune = dict(TINY_LLAMA, hidden_size=256, intermediate_size=512, num_key_value_heads=4)
    # (an even number of quantization factors per weight: nf4_split gives each rank an equal share)
    for method, sharding, ckpt in (("lora", "zero3", "none"), ("qlora", "zero2", "none"), ("qlora", "zero3", "none"),
                                   ("qlora", "zero3", "full")):
        out[f"torchtune-{method}-{sharding}-bf16-ckpt_{ckpt}-v512"] = (tune, dict(
            sharding=sharding, precision="bf16", checkpointing=ckpt, seq_len=128,
            finetune=dict(LORA, method=method, recipe="torchtune")))
    return {name: (config, TrainingSetup(micro_batch_size=2, optimizer="adamw", engine="torch", num_gpus=RANKS,
                                         **fields)) for name, (config, fields) in out.items()}


def run_all(chosen: dict) -> dict[str, list[dict]]:
    results = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    by_config: dict[str, dict] = {}
    for name, (config, setup) in chosen.items():
        by_config.setdefault(json.dumps(config, sort_keys=True), {})[name] = setup
    with tempfile.TemporaryDirectory() as tmp:
        for index, (config, group) in enumerate(by_config.items()):
            config_path, out = Path(tmp) / f"config{index}.json", Path(tmp) / "out"
            config_path.write_text(config)
            setups = {n: {k: v for k, v in s.to_dict().items() if k != "notes"} for n, s in group.items()}
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                    str(REPO / "tests" / "lora_fsdp_worker.py"), str(config_path), str(out), json.dumps(setups), "2"]
            done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(done.stderr[-4000:])
            for name in group:
                results[name] = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return results


def one_process_error(config: dict, setup: TrainingSetup) -> float:
    """The same step on one process, no sharding: memfit.measure vs the formulas."""
    import torch

    from memfit._torch.step import build_hf_model
    from memfit.measure import measure

    single = setup.replace(sharding="none", num_gpus=1, offload="none")
    torch.manual_seed(0)
    measured = measure(build_hf_model(config, single), single, steps=2).tensor_bytes
    predicted = estimate(resolve_model(config), single, make_hardware(cpu_device(64 * 1024**3))).tensor_bytes
    return (predicted - measured) / measured


def table(chosen: dict, results: dict) -> str:
    hardware = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=RANKS)
    lines = ["| setup | frozen shard B (real / memfit) | measured peak B (per rank) | memfit B | error | memfit moment "
             "| 1 process |", "| --- | --- | --- | ---: | ---: | --- | ---: |"]
    singles: dict[str, float] = {}
    errors = []
    for name, (config, setup) in chosen.items():
        predicted = estimate(resolve_model(config), setup, hardware)
        offloaded = setup.offload.value != "none"  # the frozen shards on the host: only the QuantState stays
        frozen = {sum(p["bytes"] for p in r["local"].values() if not p["trainable"]) * (not offloaded)
                  + r["quant_state_bytes"] for r in results[name]}
        spans, worst = [], 0.0
        for rank in results[name]:
            low, high = (compute_side_interval(rank) if offloaded else
                         (rank["peak_bytes"] - rank["unseen_at_peak_bytes"], rank["peak_bytes"]))
            spans.append(f"{low:,}" if low == high else f"{low:,}..{high:,}")
            p = predicted.tensor_bytes
            error = 0.0 if low <= p <= high else (p - high) / high if p > high else (p - low) / low
            worst = error if abs(error) > abs(worst) else worst
        errors.append(worst)
        key = json.dumps([config, setup.precision.value, setup.checkpointing.value, setup.finetune.to_dict()])
        if key not in singles:
            singles[key] = one_process_error(config, setup)
        lines.append(f"| {name} | {'/'.join(f'{f:,}' for f in sorted(frozen))} / "
                     f"{sum(t.num_bytes for t in predicted.terms if t.name == 'parameters/frozen'):,} | "
                     f"{'; '.join(spans)} | "
                     f"{predicted.tensor_bytes:,} | {100 * worst:+.2f}% | {predicted.peak_phase.value} | "
                     f"{100 * singles[key]:+.2f}% |")
    summary = (f"{len(errors)} setups on {RANKS} gloo ranks: worst {100 * max(errors, key=abs):+.2f}%, within 2%: "
               f"{sum(abs(e) <= 0.02 for e in errors)}")
    return ("# LoRA / QLoRA under FSDP2: formulas vs real 2-rank gloo steps (CPU)\n\nGenerated by "
            "`bench/lora_fsdp.py`. " + summary + ". The frozen shards (QuantState included) are exact; at a 64-token "
            "vocabulary the peak moves from the loss into the blocks, where the one-process LoRA formulas are low "
            "already (`1 process`): that gap is not FSDP2's. `offload` rows run CPUOffloadPolicy: on a CPU the host "
            "and the device are one memory, so their measured figure is the compute side, the last step's peak less each "
            "rank's parameter shards, optimizer states and gradient shards (an interval: some gradient shards may "
            "not exist yet at the peak), against memfit's device peak; their frozen column is the QuantState left on the "
            "device.\n\n" + "\n".join(lines) + "\n")


def main() -> int:
    chosen = cases()
    if "--filter" in sys.argv:  # e.g. --filter qlora: only the setups whose name contains it
        word = sys.argv[sys.argv.index("--filter") + 1]
        chosen = {name: case for name, case in chosen.items() if word in name}
    text = table(chosen, run_all(chosen))
    print(text)
    if "--write" in sys.argv:
        (HERE / "results" / "lora_fsdp.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

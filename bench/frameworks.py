"""Frameworks' own training scripts, traced by `memfit trace -- python SCRIPT` vs run for real on this CPU.

Each script in tests/data/scripts (written for its framework, not for memfit: a plain PyTorch loop, HF Trainer,
a LightningModule under lightning.Trainer, a Lightning Fabric loop, TRL's SFTTrainer with a peft LoRA) runs twice
for its first 2 optimizer steps, each run in a fresh process (what a script allocates depends on what its
process imported before): for real under torch.profiler's memory events
(memfit.trace.script.measured_script_peak: every allocation and free of the run, oneDNN's bf16 matmul scratch left
out, as tests/trace/test_trace.py measures memfit's own step), and traced on fake tensors with CPU semantics
(trace_script(device="cpu")). The last column is the same script traced for a CUDA device (H100): the script
takes its CUDA path, host tensors (its data pipeline's) are off the device, CUDA's kernel choices.

Scripts for several ranks (DDP, FSDP2) run under torchrun: for real on gloo ranks (rank 0's peak, from memfit's
rank meter), and traced as rank 0 of a fake process group.

    python bench/frameworks.py                  # prints the table and writes bench/results/frameworks.md
    python bench/frameworks.py ddp_loop.py      # only these scripts' rows, printed (the file is left as it is)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "data" / "scripts"
RESULTS = ROOT / "bench" / "results" / "frameworks.md"
# (framework, script, its arguments, ranks): ranks > 1 runs under torchrun (real: gloo ranks; trace: rank 0 of a fake
# process group)
CASES = (("plain PyTorch loop (AdamW)", "plain_loop.py", (), 1), ("HF Trainer", "hf_trainer.py", (), 1),
         ("Lightning Trainer (LightningModule)", "lightning_module.py", (), 1),
         ("Lightning Fabric", "lightning_fabric.py", (), 1), ("TRL SFTTrainer + peft LoRA", "trl_sft.py", (), 1),
         ("DDP loop (torchrun)", "ddp_loop.py", (), 2),
         ("DDP loop, bucket_cap_mb=0.25, gradient_as_bucket_view", "ddp_loop.py",
          ("--bucket-cap-mb", "0.25", "--gradient-as-bucket-view"), 2),
         ("DDP loop, find_unused_parameters", "ddp_loop.py", ("--find-unused-parameters",), 2),
         ("Lightning Fabric, strategy=ddp", "lightning_fabric.py", ("--devices", "2", "--strategy", "ddp"), 2),
         ("FSDP2 loop (torchrun, fully_shard)", "fsdp2_loop.py", (), 2))
STEPS = 2
NOTES = """
- The script trace counts what memfit's StepTracker sees (every op's output storage); the profiler counts every CPU
  allocation. TRL's 32 bytes: the same tracker run on real tensors (`trace_script(..., _fake=False)`) gives the
  trace's figure, so they are an allocation below the dispatcher that no op returns, not a fake-tensor difference.
- "trace for H100": the scripts' CUDA path. Tensors they make on the CPU (token tables, datasets) are host memory and
  leave the device peak; one batch per step is copied to the device. TRL's script turns on bf16 when CUDA is there.
- 2 ranks: the real job is `torchrun --nproc-per-node 2` on gloo, rank 0 measured by memfit's rank meter; the
  trace is `memfit trace -- torchrun --nproc_per_node 2 SCRIPT`, rank 0 of a fake process group. DDP's C++ Reducer
  runs in the trace, so its gradient buckets (the trainable parameters' bytes) are its own allocations. "Counted at
  the end": bytes of the rank's peak still counted after the run and a garbage collection, either alive then or
  freed by a gloo worker thread, which the rank's profiler cannot see (DDP's init broadcast buffer, the size of
  all parameters, when gloo's thread drops it last): the true rank peak lies between the peak less that and the
  peak.
- Seconds include the process start and the framework's imports (each run is a fresh process); a 2-rank real run's
  seconds are rank 0's run from the first statement.
- Not in the table: HF Trainer / Lightning with FSDP1 (both refuse FSDP on a CPU, so there is no real run to check
  against here), DeepSpeed (HF Trainer + ZeRO-2, 2 ranks: rank 0's real peak 2,986,596 B, the trace 3,577,700; the
  trace refuses DeepSpeed engines until that is understood), LitGPT's finetune scripts (need a converted checkpoint
  folder), torchtune and torchtitan (not installed).
"""


def measure(argv: list[str], mode: str) -> tuple[int, float]:
    """(peak bytes, seconds) of one run in this process: mode 'real', 'cpu' (trace) or 'cuda' (trace)."""
    from memfit.trace.script import measured_script_peak, trace_script

    start = time.perf_counter()
    if mode == "real":
        peak = measured_script_peak(argv, steps=STEPS)
    else:
        peak = trace_script(argv, steps=STEPS, device=mode, gpu_name="H100").tensor_bytes
    return peak, time.perf_counter() - start


def measure_rank(out: str, argv: list[str]) -> None:
    """One real gloo rank (run under torchrun): the script's first STEPS optimizer steps under memfit's rank meter
    (memfit._torch.rank_memory.PeakMeter, as bench/fsdp1.py measures its ranks), its peak as the profiler counts it.
    The profiler sees this thread's frees only: a block a gloo worker thread frees stays counted (DDP's init
    broadcast flattens every parameter into one buffer that gloo's thread may free last), and `at_end` is the bytes
    of the peak still counted when the run is over, after a garbage collection: blocks alive then (what a
    framework keeps referenced) or freed unseen."""
    import gc
    import json

    from memfit._torch.rank_memory import PeakMeter
    from memfit.trace.script import StepWatch, parse_command, run_steps

    start = time.perf_counter()
    with PeakMeter() as meter, meter.window():
        run_steps(parse_command(argv), StepWatch(steps=STEPS))
        gc.collect()  # what the script left in reference cycles (FSDP2's modules) is freed here, in this thread
    peak = meter.peak_bytes
    at_end = meter.account_unseen_frees([])
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(
        {"peak": peak, "at_end": at_end, "seconds": time.perf_counter() - start}))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


def run_real_ranks(script: str, args: tuple, ranks: int, work: str) -> dict:
    """A real `torchrun --nproc-per-node RANKS` job of the script on gloo; rank 0's figures."""
    import json

    out = Path(work, "ranks")
    out.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(Path(__file__).resolve()), "--rank", str(out), str(SCRIPTS / script), *args]
    subprocess.run(argv, cwd=work, capture_output=True, text=True, check=True, env=_env(), timeout=1200)
    rank0 = json.loads((out / "rank0.json").read_text())
    return {"real": rank0["peak"], "at_end": rank0["at_end"], "real_s": rank0["seconds"]}


def run_case(script: str, args: tuple, ranks: int, work: str) -> dict:
    out = {}
    argv = ["python", str(SCRIPTS / script), *args]
    if ranks > 1:
        argv = ["torchrun", "--nproc_per_node", str(ranks), *argv[1:]]
        out.update(run_real_ranks(script, args, ranks, work))
    for mode in ("cpu", "cuda") if ranks > 1 else ("real", "cpu", "cuda"):
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--case", mode, *argv], cwd=work,
                              capture_output=True, text=True, check=True, env=_env())
        peak, seconds = done.stdout.strip().splitlines()[-1].split()
        out[mode], out[f"{mode}_s"] = int(peak), float(seconds)
    return {"real": out["real"], "at_end": out.get("at_end"), "traced": out["cpu"],
            "error": (out["cpu"] - out["real"]) / out["real"], "cuda": out["cuda"], "real_s": out["real_s"],
            "traced_s": out["cpu_s"]}


def table(rows: list[tuple[str, str, tuple, int, dict]]) -> str:
    lines = ["| framework | script | ranks | real CPU peak, rank 0 (B) | of it counted at the end (B) | "
             "script trace, CPU (B) | error | trace for H100 (B) | real s | trace s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, script, args, ranks, r in rows:
        at_end = "" if r["at_end"] is None else f"{r['at_end']:,}"
        command = " ".join((script, *args))
        lines.append(f"| {name} | `{command}` | {ranks} | {r['real']:,} | {at_end} | {r['traced']:,} | "
                     f"{r['error']:+.4%} | {r['cuda']:,} | {r['real_s']:.1f} | {r['traced_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if sys.argv[1:2] == ["--case"]:
        peak, seconds = measure(sys.argv[3:], sys.argv[2])
        print(peak, f"{seconds:.2f}")
        return
    if sys.argv[1:2] == ["--rank"]:
        measure_rank(sys.argv[2], ["python", *sys.argv[3:]])
        return
    chosen = [case for case in CASES if not sys.argv[1:] or case[1] in sys.argv[1:]]
    rows = []
    with tempfile.TemporaryDirectory() as work:  # HF Trainer's output_dir, Lightning's logs
        for name, script, args, ranks in chosen:
            rows.append((name, script, args, ranks, run_case(script, args, ranks, work)))
            print(f"{name}: {rows[-1][-1]['error']:+.4%}", file=sys.stderr)
    text = table(rows)
    print(text)
    if sys.argv[1:]:
        return
    RESULTS.write_text(
        "# Frameworks' scripts: `memfit trace -- python SCRIPT` vs the real CPU run\n\n"
        "Generated by `python bench/frameworks.py` (" + __doc__.split("\n\n")[1].replace("\n", " ") + ")\n\n"
        f"Steps: {STEPS} optimizer steps per run. Bytes are live tensor bytes at the peak.\n\n{text}\n{NOTES}")


if __name__ == "__main__":
    main()

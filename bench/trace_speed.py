"""memfit trace vs torch's MemTracker on the same fake-tensor Llama step; and the memory a 70B trace needs.

    python bench/trace_speed.py            # ~3-5 minutes on 2 CPU cores; writes bench/results/trace_speed.md

Each measurement runs in its own process (clean RSS, no shared caches): the same StepSession (llama-2-7b, B=1,
T=2048, fp32, SDPA, torch AdamW single-tensor) built on fake tensors, one warm-up iteration (it creates the optimizer
state), then one timed iteration. memfit's StepTracker and MemTracker both report the peak over the two iterations.
The 70B row runs the public `memfit.trace.trace` (two steps) and reads the process's peak RSS from getrusage.
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

SETUP = dict(micro_batch_size=1, seq_len=2048, precision="fp32", optimizer="adamw", attention="sdpa")
MODEL_7B = "llama-2-7b"
MODEL_70B = "llama-3.1-70b"
RESULTS = Path(__file__).parent / "results" / "trace_speed.md"
GIB, MIB = 1024**3, 1024**2


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _session(name: str):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit import TrainingSetup
    from memfit.trace.hf import resolve_config
    from memfit.trace.session import build_hf_session

    config, _ = resolve_config(name)
    setup = TrainingSetup(**SETUP)
    fake_mode = FakeTensorMode()
    with fake_mode:
        return build_hf_session(config, setup), fake_mode


def child_memfit() -> dict:
    from memfit.trace.run import run_traced
    from memfit.trace.tracker import StepTracker

    session, fake_mode = _session(MODEL_7B)
    times = []
    tracker = StepTracker()

    def timed(phase: str) -> None:
        if phase == "forward":
            times.append(time.perf_counter())

    original = session.run
    session.run = lambda callback: original(lambda phase: (timed(phase), callback(phase)))
    run_traced(session, tracker, fake_mode, steps=2)
    end = time.perf_counter()
    return {"seconds": end - times[1], "warmup_seconds": times[1] - times[0], "peak_bytes": tracker.peak_bytes,
            "rss_bytes": _rss_bytes()}


def child_memtracker() -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    session, fake_mode = _session(MODEL_7B)
    seconds = []
    with fake_mode:  # MemTracker must be entered inside the FakeTensorMode (FACTS.md)
        tracker = MemTracker()
        tracker.track_external(session.model, session.optimizer, session.batch)
        with tracker:
            for _ in range(2):
                start = time.perf_counter()
                session.run(lambda phase: None)
                seconds.append(time.perf_counter() - start)
                tracker.reset_mod_stats()
        peak = max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    return {"seconds": seconds[1], "warmup_seconds": seconds[0], "peak_bytes": peak, "rss_bytes": _rss_bytes()}


def child_70b() -> dict:
    from memfit import TrainingSetup
    from memfit.trace import trace

    start = time.perf_counter()
    estimate = trace(MODEL_70B, TrainingSetup(**SETUP))
    return {"seconds": time.perf_counter() - start, "peak_bytes": estimate.tensor_bytes, "rss_bytes": _rss_bytes()}


MOE_SETUP = dict(micro_batch_size=1, seq_len=1024, precision="bf16", optimizer="adamw", checkpointing="full")


def child_deepseek() -> dict:
    """The MoE target of the 'any model' issue: a DeepSeek-V3-shaped trace (61 layers, 256 routed experts, MLA)."""
    from memfit import TrainingSetup
    from memfit.sources import catalog_config
    from memfit.trace import trace

    start = time.perf_counter()
    estimate = trace(catalog_config("deepseek-v3"), TrainingSetup(**MOE_SETUP))
    return {"seconds": time.perf_counter() - start, "peak_bytes": estimate.tensor_bytes, "rss_bytes": _rss_bytes()}


CHILDREN = {"memfit": child_memfit, "memtracker": child_memtracker, "70b": child_70b, "deepseek": child_deepseek}


def _run_child(name: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: dict) -> str:
    ours, theirs, big = results["memfit"], results["memtracker"], results["70b"]
    ratio = theirs["seconds"] / ours["seconds"]
    rows = [
        ("memfit StepTracker", MODEL_7B, ours),
        ("torch MemTracker", MODEL_7B, theirs),
    ]
    lines = [
        "# memfit trace: speed and memory",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {_cpus()} CPU cores, Python "
        f"{platform.python_version()}, torch {_torch_version()}. Setup: B=1, T=2048, fp32, SDPA, "
        "AdamW (single-tensor). One timed iteration after one warm-up iteration (which creates the optimizer state), each tracker in its own "
        "process, on fake tensors.",
        "",
        "| tracker | model | s / iteration | warm-up s | peak (GiB) | peak (bytes) | max RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, model, row in rows:
        lines.append(f"| {label} | {model} | {row['seconds']:.2f} | {row['warmup_seconds']:.2f} | "
                     f"{row['peak_bytes'] / GIB:.3f} | {row['peak_bytes']} | {row['rss_bytes'] / MIB:.0f} |")
    same = "equal to the byte" if ours["peak_bytes"] == theirs["peak_bytes"] else (
        f"differ by {ours['peak_bytes'] - theirs['peak_bytes']:+d} bytes")
    lines += [
        "",
        f"**Speed-up: {ratio:.1f}x** faster than MemTracker per iteration; peaks {same}.",
        "",
        f"70B: `memfit.trace.trace('{MODEL_70B}', B=1, T=2048)` (two full steps, model build included): "
        f"{big['seconds']:.1f} s, peak {big['peak_bytes'] / GIB:.1f} GiB, "
        f"**max RSS {big['rss_bytes'] / MIB:.0f} MiB** ({big['rss_bytes'] / GIB:.2f} GiB).",
        "",
    ]
    moe = results.get("deepseek")
    if moe:
        lines += [f"DeepSeek-V3 (671B, MoE + MLA): `memfit.trace.trace(deepseek-v3 config, B=1, T=1024, bf16, AdamW, "
                  f"full checkpointing)`: {moe['seconds']:.1f} s, peak {moe['peak_bytes'] / GIB:.1f} GiB, "
                  f"**max RSS {moe['rss_bytes'] / MIB:.0f} MiB** ({moe['rss_bytes'] / GIB:.2f} GiB; target < 4 GiB).",
                  ""]
    return "\n".join(lines)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]]()))
        return
    results = {}
    for name in CHILDREN:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = _run_child(name)
    text = report(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()

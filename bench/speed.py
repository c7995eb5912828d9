"""Speed targets side by side in one run: a 70B plan in process (target < 50 ms), `memfit plan` end to end
(target < 1.5 s), and the anchor of Python's own start-up, so the ratio shows what memfit itself adds.

    python bench/speed.py    # writes bench/results/speed.md
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _wall(cmd: list[str], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    from memfit.api import typical_setup
    from memfit.hardware import make_hardware
    from memfit.plan import optimize, plan
    from memfit.sources import resolve_model

    spec, hw = resolve_model("llama-2-70b"), make_hardware("H100", gpus_per_node=8)
    setup = typical_setup(spec, hw)
    plan(spec, setup, hw)
    runs = []
    for _ in range(20):
        start = time.perf_counter()
        plan(spec, setup, hw)
        runs.append(time.perf_counter() - start)
    plan_ms = 1e3 * statistics.median(runs)
    start = time.perf_counter()
    optimize(spec, setup, hw)
    optimize_ms = 1e3 * (time.perf_counter() - start)
    python_s = _wall([sys.executable, "-c", "pass"])
    import_s = _wall([sys.executable, "-c", "import memfit, sys; assert 'torch' not in sys.modules"])
    cli_s = _wall(["memfit", "plan", "llama-2-70b", "--gpu", "H100"])
    rows = [
        ("plan(llama-2-70b, 8 x H100) in process", f"{plan_ms:.2f} ms", "< 50 ms", f"{50 / plan_ms:.0f}x under"),
        ("optimize() full search, in process", f"{optimize_ms:.1f} ms", "-", "-"),
        ("python -c pass (anchor)", f"{python_s:.3f} s", "-", "1.00x"),
        ("import memfit (no torch imported)", f"{import_s:.3f} s", "-", f"{import_s / python_s:.2f}x anchor"),
        ("memfit plan llama-2-70b --gpu H100", f"{cli_s:.3f} s", "< 1.5 s", f"{cli_s / python_s:.2f}x anchor"),
    ]
    lines = ["| what | median | target | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    text = "\n".join(lines)
    print(text)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "speed.md").write_text("# Speed (`python bench/speed.py`)\n\n" + text + "\n")
    return 0 if plan_ms < 50 and cli_s < 1.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""memfit.derive per architecture: the derived estimate against the full-depth trace, and how long the first
(deriving) and a cached call take. Prints the table and writes bench/results/derive.md.

    python bench/derive.py            # the tiny families and a 70B-class config
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-derive-bench-")
    from test_derive import NO_RECIPE  # the tiny configs the tests use

    from memfit.derive import cache
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.setup import Checkpointing, Precision, TrainingSetup
    from memfit.sources import resolve_model
    from memfit.trace import trace

    cpu = make_hardware(cpu_device(64 * 1024**3))
    families = dict(NO_RECIPE)
    families["falcon"] = dict(model_type="falcon", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              vocab_size=512)
    families["gptj"] = dict(model_type="gptj", n_embd=64, n_layer=3, n_head=4, vocab_size=512, n_positions=1024,
                            rotary_dim=8, bos_token_id=0, eos_token_id=0)
    families["qwen3-70b-class"] = dict(model_type="qwen3", hidden_size=8192, intermediate_size=29568,
                                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                       head_dim=128, vocab_size=152064, max_position_embeddings=32768)
    rows = []
    for family, config in families.items():
        big = family.endswith("70b-class")
        setups = [TrainingSetup(precision=p, checkpointing=c, micro_batch_size=4, seq_len=96 if not big else 4096)
                  for p in (Precision.FP32, Precision.BF16) for c in (Checkpointing.NONE, Checkpointing.FULL)]
        if big:
            setups = [setups[2]]  # bf16, no checkpointing
        cache.clear_memory()
        started = time.perf_counter()
        spec = resolve_model(dict(config))
        estimate(spec, setups[0], cpu)
        first = time.perf_counter() - started
        cache.clear_memory()
        started = time.perf_counter()
        spec = resolve_model(dict(config))
        estimate(spec, setups[0], cpu)
        cached = time.perf_counter() - started
        errors = []
        for setup in setups:
            predicted = estimate(spec, setup, cpu).tensor_bytes
            if big:
                continue
            traced = trace(dict(config), setup, kernels="cpu").tensor_bytes
            errors.append((setup, 100 * (predicted - traced) / traced))
        worst = max(errors, key=lambda e: abs(e[1])) if errors else None
        rows.append((family, worst, first, cached))
        detail = (f"{worst[1]:+.2f}% (worst of {len(errors)}: {worst[0].precision}, ckpt {worst[0].checkpointing})"
                  if worst else "not traced at full depth")
        print(f"{family:18s} {detail:50s} first {first:6.2f} s  cached {1000 * cached:7.1f} ms", flush=True)
    lines = ["# memfit.derive: derived estimate vs full-depth trace", "",
             "Tiny configs (hidden 64, 3 layers, vocab 512) at batch 4 x seq 96 (not a fit shape), CPU kernels, "
             "fp32 and bf16, checkpointing off and full; the error is the worst of the four against "
             "`memfit.trace` of the full-depth model. First call: spec + one kind derived (trace of 1- and 2-block "
             "copies at 5 shapes); cached: the same call in a fresh process state, read from the disk cache.", "",
             "| family | derived vs full trace (worst) | first call | cached call |", "|---|---|---|---|"]
    for family, worst, first, cached in rows:
        err = f"{worst[1]:+.2f}% ({worst[0].precision}, ckpt {worst[0].checkpointing})" if worst else "n/a"
        lines.append(f"| {family} | {err} | {first:.2f} s | {1000 * cached:.1f} ms |")
    out = HERE / "results" / "derive.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()

"""LoRA / QLoRA on families memfit sizes by derived formulas (OPT, Falcon, GPT-J, StableLM, Phi, Qwen3, Gemma 3):
memfit's estimate before (main's formulas, stored) and now vs real CPU steps (tests/lora_truth.py: the HF Trainer +
peft recipe, measured by memfit.measure with torch.profiler memory events).

    OMP_NUM_THREADS=1 python bench/lora_derived.py --measure     # measure the matrix into the JSON (~5 min)
    python bench/lora_derived.py --before                        # store the estimates of the code on the path as
                                                                 # the 'before' column (run once on main's src)
    python bench/lora_derived.py [--write]                       # the table; --write: bench/results/lora_derived.md

Cases: the seven families x q/v and all-linear targets x fp32 / bf16 (autocast) / NF4 (double quantization, peft's
k-bit preparation, autocast) bases x with and without (Trainer's non-reentrant) checkpointing, plus a few with
dropout, pure bf16, QLoRA without the k-bit preparation, eager attention and other shapes. Batch 2 x 64 tokens
unless the label says.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from lora_truth import LoraCase  # noqa: E402
from tiny_derived_configs import DERIVED_CONFIGS, QV_TARGETS  # noqa: E402

RESULTS = HERE / "results"
MEASURED = RESULTS / "lora_derived_measured.json"
FAMILIES = ("opt", "falcon", "gptj", "stablelm", "phi", "qwen3", "gemma3_text")
BASES = (("fp32", "fp32"), ("bf16", "amp-bf16"), ("nf4", "amp-bf16"))


def cases() -> list[LoraCase]:
    out = []
    for family, targets, (base, precision), ckpt in itertools.product(FAMILIES, ("qv", "all-linear"), BASES,
                                                                        (False, True)):
        out.append(LoraCase(family=family, rank=8, alpha=16, targets=QV_TARGETS[family] if targets == "qv" else
                            targets, base_dtype=base, double_quant=base == "nf4", precision=precision,
                            checkpointing=ckpt))
    for family in ("opt", "falcon"):
        out.append(LoraCase(family=family, rank=8, alpha=16, targets="all-linear", dropout=0.1, base_dtype="bf16",
                            precision="amp-bf16"))
        out.append(LoraCase(family=family, rank=8, alpha=16, targets="all-linear", base_dtype="bf16",
                            precision="bf16"))
        out.append(LoraCase(family=family, rank=8, alpha=16, targets="all-linear", base_dtype="nf4",
                            double_quant=True, precision="amp-bf16", kbit_prep=False))
    # other shapes (the fits are traced at sequences 16-48), eager attention, dropout under checkpointing
    out.append(LoraCase(family="gptj", rank=8, alpha=16, targets=QV_TARGETS["gptj"], base_dtype="nf4",
                        double_quant=True, precision="amp-bf16", batch=1, seq=128))
    out.append(LoraCase(family="falcon", rank=8, alpha=16, targets="all-linear", base_dtype="bf16",
                        precision="amp-bf16", checkpointing=True, batch=4, seq=32))
    out.append(LoraCase(family="stablelm", rank=8, alpha=16, targets=QV_TARGETS["stablelm"], attention="eager"))
    out.append(LoraCase(family="phi", rank=16, alpha=32, targets="all-linear", dropout=0.1, checkpointing=True))
    return out


def measure(selected: list[LoraCase]) -> int:
    import torch

    from lora_truth import measure_lora_case

    torch.set_num_threads(1)
    stored = {r["label"]: r for r in json.loads(MEASURED.read_text())} if MEASURED.exists() else {}
    failed = 0
    for index, case in enumerate(selected, 1):
        started = time.time()
        try:
            row = measure_lora_case(case)
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            row = {"label": case.label, **case.to_dict(), "error": f"{type(error).__name__}: {error}"[:400]}
            failed += 1
        stored[case.label] = {**row, **({"before": stored[case.label]["before"]}
                                        if "before" in stored.get(case.label, {}) else {})}
        print(f"[{index:3}/{len(selected)}] {time.time() - started:5.1f}s {case.label:<70} "
              f"{row.get('error') or format(row['peak_bytes_with_quant_state'], ',')}", flush=True)
    MEASURED.write_text(json.dumps(list(stored.values()), indent=1) + "\n")
    return 1 if failed else 0


def predict(case: dict) -> int | str:
    """memfit's total for one measured case, or the error line it refuses with."""
    from lora_accuracy import setup_of

    from memfit.errors import MemfitError
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.sources import resolve_model

    try:
        result = estimate(resolve_model(dict(DERIVED_CONFIGS[case["family"]])), setup_of(case),
                          make_hardware(cpu_device(64 * 1024**3)))
    except MemfitError as error:
        return str(error).splitlines()[0]
    return result.tensor_bytes


def store_before() -> int:
    rows = json.loads(MEASURED.read_text())
    for row in rows:
        if "error" not in row:
            row["before"] = predict(row)
    MEASURED.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _error(predicted, measured: int) -> float | None:
    return 100 * (predicted - measured) / measured if isinstance(predicted, int) else None


def _summary(errors: list[float]) -> str:
    if not errors:
        return "no cases"
    return (f"median |error| {statistics.median(abs(e) for e in errors):.2f}%, worst {max(errors, key=abs):+.2f}%, "
            f"within 2%: {sum(abs(e) <= 2 for e in errors)}/{len(errors)}, "
            f"within 5%: {sum(abs(e) <= 5 for e in errors)}/{len(errors)}")


def table() -> tuple[str, list[float]]:
    rows = [r for r in json.loads(MEASURED.read_text()) if "error" not in r]
    lines = ["| case | measured B | before B | before | now B | now |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    before_errors, now_errors = [], []
    for row in rows:
        measured = row["peak_bytes_with_quant_state"]
        before, now = row.get("before", "-"), predict(row)
        eb, en = _error(before, measured), _error(now, measured)
        if eb is not None:
            before_errors.append(eb)
        if en is not None:
            now_errors.append(en)

        def cell(value, error):
            return (f"{value:,} | {error:+.2f}%" if error is not None else f"{str(value)[:60]} | -")
        lines.append(f"| {row['label']} | {measured:,} | {cell(before, eb)} | {cell(now, en)} |")
    head = ["# LoRA / QLoRA on derived families: formulas vs measured CPU steps", "",
            "Generated by `bench/lora_derived.py` (measured: tests/lora_truth.py's HF Trainer + peft recipe, "
            "memfit.measure's profiler peak of step 2, plus bitsandbytes' QuantState bytes; `before`: main's "
            "formulas before the derivation ran under the LoRA setup; `now`: memfit on this tree). Tiny configs "
            "from tests/tiny_derived_configs.py (hidden 64, 2 layers, vocab 512), batch 2 x 64 unless the label says.", "",
            f"- before: {_summary(before_errors)}", f"- now: {_summary(now_errors)}", ""]
    return "\n".join(head + lines) + "\n", now_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure the cases (merged into the JSON)")
    parser.add_argument("--before", action="store_true", help="store this code's estimates as the 'before' column")
    parser.add_argument("--filter", default="", help="only cases whose label contains this text (--measure)")
    parser.add_argument("--write", action="store_true", help="write bench/results/lora_derived.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.measure:
        return measure([c for c in cases() if args.filter in c.label])
    if args.before:
        return store_before()
    text, errors = table()
    print(text)
    if args.write:
        (RESULTS / "lora_derived.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""memfit's LoRA / QLoRA formulas vs the measured CPU steps of bench/results/lora_measured.json
(bench/lora_measure.py: real peft + bitsandbytes models, profiler memory events).

    python bench/lora_accuracy.py           # prints the table and writes bench/results/lora_accuracy.md

Measured bytes include bitsandbytes' quantization state (absmax, codes), which is neither a parameter nor a buffer
(`peak_bytes_with_quant_state`); memfit counts it in the frozen parameters.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from lora_truth import ATTENTION_TARGETS  # noqa: E402
from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.finetune import Finetune  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

MEASURED = HERE / "results" / "lora_measured.json"


def setup_of(case: dict) -> TrainingSetup:
    """The memfit setup of one measured case."""
    targets = ("all-linear",) if case["targets"] == "all-linear" else tuple(
        ATTENTION_TARGETS[case["family"]] if case["targets"] == "attention" else case["targets"])
    quantized = case["base_dtype"] in ("nf4", "fp4", "int8")
    finetune = Finetune(method="qlora" if quantized else "lora", rank=case["rank"], alpha=case["alpha"],
                        dropout=case["dropout"], targets=targets, base=case["base_dtype"],
                        double_quant=case["double_quant"], modules_to_save=tuple(case["modules_to_save"]),
                        dora=case.get("dora", False),
                        kbit_prep=None if case.get("kbit_prep", True) or not quantized else False)
    return TrainingSetup(micro_batch_size=case["batch"], seq_len=case["seq"], precision=case["precision"],
                         optimizer=case["optimizer"], checkpointing="full" if case["checkpointing"] else "none",
                         attention=case["attention"], finetune=finetune)


def rows(cases: list[dict]) -> list[tuple]:
    hw = make_hardware(cpu_device(64 * 1024**3))
    out = []
    for case in cases:
        if case.get("error") or case.get("reentrant") or case.get("input_require_grads") is not None:
            continue
        try:
            setup = setup_of(case)
            predicted = estimate(resolve_model(TINY_CONFIGS[case["family"]]), setup, hw)
        except ConfigError as error:
            out.append((case["label"], case["peak_bytes_with_quant_state"], None, str(error)))
            continue
        measured = case["peak_bytes_with_quant_state"]
        out.append((case["label"], measured, predicted.tensor_bytes, predicted.peak_phase.value))
    return out


def main() -> int:
    cases = json.loads(MEASURED.read_text())
    table = rows(cases)
    errors = [100 * (p - m) / m for _, m, p, _ in table if p is not None]
    lines = ["| case | measured B | memfit B | error |", "| --- | ---: | ---: | ---: |"]
    for label, m, p, phase in table:
        lines.append(f"| {label} | {m:,} | {p:,} | {100 * (p - m) / m:+.2f}% |" if p is not None else
                     f"| {label} | {m:,} | refused | {phase} |")
    summary = (f"{len(errors)} cases: median |error| {statistics.median(abs(e) for e in errors):.2f}%, "
               f"worst {max(errors, key=abs):+.2f}%, within 2%: {sum(abs(e) <= 2 for e in errors)}, "
               f"within 5%: {sum(abs(e) <= 5 for e in errors)}")
    text = "# LoRA / QLoRA: formulas vs measured CPU steps\n\n" + summary + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if "--write" in sys.argv:
        (HERE / "results" / "lora_accuracy.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Sequence classifiers (BertForSequenceClassification, LlamaForSequenceClassification): the formulas and the trace
against real measured CPU steps of tiny classifiers, over precision x checkpointing x batch.

    python bench/seq_classification.py      # prints the table, writes bench/results/seq_classification.md

Measured: memfit.measure (profiler memory events, live tensor bytes) of the class transformers builds from the
config memfit.sources.task writes (oneDNN's bf16 matmul scratch is its own overhead term, not in the tensor bytes).
tests/estimate/test_sequence_classification.py asserts two of the 4 x 128 rows (bert fp32 none, llama amp-bf16 full).
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from tiny_configs import TINY_BERT, TINY_LLAMA  # noqa: E402

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.measure import measure  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402
from memfit.sources.task import task_config  # noqa: E402
from memfit.trace import trace  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))
FAMILIES = {"bert": TINY_BERT, "llama": TINY_LLAMA}
SHAPES = ((4, 128), (2, 256))


def _pct(pred: int, meas: int) -> str:
    return f"{100.0 * (pred - meas) / meas:+.2f}"


def rows():
    for family, (batch, seq), precision, ckpt in itertools.product(FAMILIES, SHAPES, ("fp32", "amp-bf16"),
                                                                   ("none", "full")):
        config = task_config(FAMILIES[family], 2)
        setup = TrainingSetup(micro_batch_size=batch, seq_len=seq, precision=precision, checkpointing=ckpt,
                              optimizer="adamw", attention="sdpa")
        measured = measure(config, setup, steps=2).tensor_bytes
        formulas = estimate(resolve_model(config), setup, CPU).tensor_bytes
        traced = trace(config, setup, kernels="cpu").tensor_bytes
        yield (family, f"{batch}x{seq}", precision, ckpt, f"{measured:,}", f"{formulas:,}",
               _pct(formulas, measured), f"{traced:,}", _pct(traced, measured))


def main() -> None:
    start = time.time()
    header = ("model", "B x T", "precision", "ckpt", "measured B", "formulas B", "formulas %", "trace B", "trace %")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows():
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    text = ("# Sequence classifiers: formulas and trace vs measured CPU steps\n\n"
            "Tiny BERT / Llama classifiers (2 labels, tests/tiny_configs.py), AdamW, SDPA, 2 steps.\n\n"
            + "\n".join(lines) + f"\n\n({time.time() - start:.0f} s)\n")
    out = HERE / "results" / "seq_classification.md"
    out.write_text(text)
    print(f"written to {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()

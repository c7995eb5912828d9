"""Chunked / fused loss and the optimizer step in backward: the formulas against real measured CPU steps of the tiny
Llama / Qwen2, over loss x precision x checkpointing x optimizer-in-backward x LoRA (the full matrix;
tests/estimate/test_loss_and_inbwd.py asserts one case of each technique).

    python bench/loss_inbwd.py      # prints the table, writes bench/results/loss_inbwd.md

Measured: memfit.measure (profiler memory events, live tensor bytes; oneDNN's bf16 matmul scratch is its own
overhead term, not in them). The fused loss runs memfit's pure-torch reference of Liger's kernel.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.finetune import Finetune  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.measure import measure  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))
BASE = dict(micro_batch_size=2, seq_len=128, precision="fp32", optimizer="adamw")
# (family, setup changes, tolerance the tests held it to): 1% where the formulas model every tensor at the peak; 3%
# for amp-bf16 moments that are the peak once the loss no longer is (block 0's recompute under checkpointing, the
# fused reference's chunk loop)
CASES = [
    ("llama", dict(loss="chunked"), 0.01),
    ("llama", dict(loss="chunked", precision="amp-bf16"), 0.01),
    ("llama", dict(loss="chunked", checkpointing="full"), 0.01),
    ("qwen2", dict(loss="chunked"), 0.01),
    ("qwen2", dict(loss="chunked", precision="amp-bf16"), 0.01),
    ("llama", dict(loss="fused"), 0.01),
    ("qwen2", dict(loss="fused"), 0.01),
    ("llama", dict(loss="fused", checkpointing="full"), 0.01),
    ("qwen2", dict(loss="chunked", checkpointing="full"), 0.01),
    ("qwen2", dict(loss="fused", optimizer_in_backward=True, checkpointing="full"), 0.01),
    ("llama", dict(loss="fused", optimizer_in_backward=True), 0.01),
    ("llama", dict(loss="chunked", precision="amp-bf16", checkpointing="full"), 0.03),
    ("qwen2", dict(loss="chunked", precision="amp-bf16", checkpointing="full"), 0.03),
    ("llama", dict(loss="fused", precision="amp-bf16"), 0.03),
    ("llama", dict(optimizer_in_backward=True), 0.01),
    ("qwen2", dict(optimizer_in_backward=True, precision="amp-bf16"), 0.01),
    ("llama", dict(optimizer_in_backward=True, checkpointing="full"), 0.01),
    ("llama", dict(optimizer_in_backward=True, loss="chunked"), 0.01),
    ("llama", dict(optimizer_in_backward=True, loss="fused", micro_batch_size=1, seq_len=32), 0.01),
    ("llama", dict(loss="fused", micro_batch_size=1, seq_len=32), 0.01),
    # LoRA with torchtune's chunked loss (its LoRA recipes' default): the frozen, tied head is no autocast-cached leaf
    ("qwen2", dict(loss="chunked", finetune=Finetune(method="lora", rank=8)), 0.01),
    ("qwen2", dict(loss="chunked", precision="amp-bf16", checkpointing="full", finetune=Finetune(method="lora", rank=8)),
     0.03),
    ("llama", dict(loss="chunked", precision="bf16",
                   finetune=Finetune(method="lora", rank=16, targets=("all-linear",), dropout=0.1)), 0.01),
]


def case_id(family: str, changes: dict) -> str:
    return f"{family}-{'-'.join(f'{k}={v}' for k, v in changes.items())}".replace(" ", "")


def run(family: str, changes: dict) -> tuple[int, int]:
    """(formulas, measured) tensor bytes of two real CPU steps."""
    setup = TrainingSetup(**{**BASE, **changes})
    measured = measure(TINY_CONFIGS[family], setup, steps=2).tensor_bytes
    return estimate(resolve_model(TINY_CONFIGS[family]), setup, CPU).tensor_bytes, measured


def main() -> None:
    start = time.time()
    lines = ["| case | formulas B | measured B | error | tolerance |", "|---|---:|---:|---:|---:|"]
    for family, changes, tolerance in CASES:
        predicted, measured = run(family, changes)
        error = 100.0 * (predicted - measured) / measured
        lines.append(f"| {case_id(family, changes)} | {predicted:,} | {measured:,} | {error:+.2f}% | "
                     f"{100 * tolerance:.0f}% |")
        print(lines[-1], flush=True)
    text = ("# Chunked / fused loss and the optimizer step in backward: formulas vs measured CPU steps\n\n"
            "`python bench/loss_inbwd.py`. Tiny Llama / Qwen2 (tests/tiny_configs.py), AdamW, B=2, T=128 unless the "
            "case says otherwise, 2 steps.\n\n" + "\n".join(lines) + f"\n\n({time.time() - start:.0f} s)\n")
    out = HERE / "results" / "loss_inbwd.md"
    out.write_text(text)
    print(f"written to {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()

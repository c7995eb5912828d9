"""torch.compile: what a block saves eager vs compiled, and the formulas vs real compiled CPU training steps.

    python bench/compile.py              # prints the tables, writes bench/results/compile.md
    python bench/compile.py --inductor   # also one real inductor row (needs a C++ compiler; minutes on CPU)
    python bench/compile.py --loss-only  # reruns the chunked-loss cases only and replaces that section

Saved bytes per layer: eager from memfit's activation recipes, compiled from AOTAutograd's min-cut partition of one
block on fake tensors (memfit.estimate.compiled). Measured: memfit.measure (profiler memory events) of 2 real steps
of the tiny model with every block compiled (memfit._torch.compiled.compile_blocks) by the 'partitioned' backend
(the min-cut partition run without codegen; the inductor row shows it saves the same tensors as inductor).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
from tiny_configs import TINY_CONFIGS  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from memfit._torch.step import build_hf_model  # noqa: E402
from memfit.estimate import activations as act  # noqa: E402
from memfit.estimate import compiled  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.measure import measure  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

CASES = [(family, precision, attention) for family in ("llama", "gpt2", "qwen2")
         for precision, attention in (("fp32", "sdpa"), ("fp32", "eager"), ("amp-bf16", "sdpa"), ("bf16", "sdpa"))]
BATCH, SEQ = 2, 64


def _pct(pred: int, meas: int) -> float:
    return 100.0 * (pred - meas) / meas if meas else 0.0


def spec_of(family: str, folder: Path):
    path = folder / f"{family}.json"
    path.write_text(json.dumps(TINY_CONFIGS[family]))
    return resolve_model(str(path))


def run_case(family: str, precision: str, attention: str, folder: Path, backend: str) -> dict:
    hw = make_hardware(cpu_device(64 * 1024**3))
    spec = spec_of(family, folder)
    row = {"case": f"{family} {precision} {attention}"}
    for on in (False, True):
        setup = TrainingSetup(precision=precision, attention=attention, micro_batch_size=BATCH, seq_len=SEQ,
                              optimizer="adamw", compile=on)
        saved = (compiled.layer_saved_bytes if on else act.layer_saved_bytes)(spec, setup, BATCH * SEQ, SEQ, True)
        predicted = estimate(spec, setup, hw)
        started = time.perf_counter()
        # a fresh dynamo per model: past torch._dynamo.config.recompile_limit frames of one code object, dynamo
        # runs the block eager without a word (this bench compiles dozens of blocks in one process)
        torch._dynamo.reset()
        counters.clear()
        model = build_hf_model(TINY_CONFIGS[family], setup, compile_backend=backend)
        measured = measure(model, setup, steps=2)
        tag = "compiled" if on else "eager"
        row.update({f"{tag}_layer": sum(saved.values()), f"{tag}_pred": predicted.tensor_bytes,
                    f"{tag}_meas": measured.tensor_bytes, f"{tag}_pred_act": predicted.activation_bytes,
                    f"{tag}_meas_act": measured.activation_bytes, f"{tag}_s": time.perf_counter() - started})
        if on and counters["stats"]["unique_graphs"] < 1:
            raise RuntimeError(f"{row['case']}: dynamo compiled no graph")
    row["graphs"] = counters["stats"]["unique_graphs"]
    return row


def table(rows: list[dict]) -> list[str]:
    lines = [f"| case (B={BATCH}, T={SEQ}) | eager B/layer | compiled B/layer | change | compiled formula | "
             "compiled measured | error | activations error | eager error | graphs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        change = _pct(r["compiled_layer"], r["eager_layer"])
        lines.append(f"| {r['case']} | {r['eager_layer']:,} | {r['compiled_layer']:,} | {change:+.1f}% | "
                     f"{r['compiled_pred']:,} | {r['compiled_meas']:,} | "
                     f"{_pct(r['compiled_pred'], r['compiled_meas']):+.2f}% | "
                     f"{_pct(r['compiled_pred_act'], r['compiled_meas_act']):+.2f}% | "
                     f"{_pct(r['eager_pred'], r['eager_meas']):+.2f}% | {r['graphs']} |")
    return lines


LOSS_CASES = [("llama", "bf16", "none", False), ("llama", "bf16", "full", False), ("llama", "bf16", "full", True),
              ("qwen2", "bf16", "none", False), ("gpt2", "bf16", "full", False), ("llama", "fp32", "full", False)]
LOSS_VOCAB = 2048
"""The tiny models with a vocabulary large enough that the loss is the peak, as in a 128k-vocabulary model."""


def run_loss_case(family: str, precision: str, checkpointing: str, tied: bool, folder: Path) -> dict:
    """torchtune's chunked loss under compile (its compute_cross_entropy compiled by inductor, the blocks by the
    partitioned backend): formula vs measured, and the formula with the eager loss beside it."""
    hw = make_hardware(cpu_device(64 * 1024**3))
    config = dict(TINY_CONFIGS[family], vocab_size=LOSS_VOCAB, tie_word_embeddings=tied)
    path = folder / f"{family}-loss.json"
    path.write_text(json.dumps(config))
    spec = resolve_model(str(path))
    setup = TrainingSetup(precision=precision, micro_batch_size=BATCH, seq_len=SEQ, optimizer="adamw",
                          loss="chunked", compile=True, checkpointing=checkpointing)
    predicted = estimate(spec, setup, hw).tensor_bytes
    from memfit.estimate import compiled_loss

    originals = {name: getattr(compiled_loss, name) for name in ("applies", "chunks", "whole")}
    for name in originals:  # the same step sized with the eager loss's formulas (analytic asks all three)
        setattr(compiled_loss, name, lambda _setup: False)
    try:
        eager_loss = estimate(spec, setup, hw).tensor_bytes
    finally:
        for name, function in originals.items():
            setattr(compiled_loss, name, function)
    torch._dynamo.reset()
    measured = measure(build_hf_model(config, setup, compile_backend="partitioned"), setup, steps=2).tensor_bytes
    return {"case": f"{family} {precision} ckpt {checkpointing}{' tied' if tied else ''}", "pred": predicted,
            "meas": measured, "eager_loss": eager_loss}


def loss_table(rows: list[dict]) -> list[str]:
    lines = [f"| case (B={BATCH}, T={SEQ}, V={LOSS_VOCAB}) | formula, eager loss | formula, compiled loss | "
             "measured | error |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['eager_loss']:,} | {r['pred']:,} | {r['meas']:,} | "
                     f"{_pct(r['pred'], r['meas']):+.2f}% |")
    return lines


def loss_section(loss_rows: list[dict]) -> list[str]:
    errors = sorted(abs(_pct(r["pred"], r["meas"])) for r in loss_rows)
    return ["## torchtune's chunked loss, compiled", "",
            "torchtune compiles its loss with the model (training.compile_loss): each chunk's cross-entropy by "
            "inductor (also here, on CPU), which keeps the chunk and two fp32 numbers per row instead of the fp32 "
            "log-softmax (memfit.estimate.compiled_loss). Formula with the eager loss: the same step sized as if "
            "the loss stayed eager. Measured: live tensor bytes (oneDNN's bf16 matmul scratch, on CPUs with native "
            "bf16, is the measurement's own overhead term).", "", *loss_table(loss_rows), "",
            f"Median error {errors[len(errors) // 2]:.2f}%, worst {errors[-1]:.2f}% over {len(errors)} cases."]


def loss_only() -> int:
    """`--loss-only`: rerun the chunked-loss cases and replace that section of results/compile.md."""
    with tempfile.TemporaryDirectory() as tmp:
        loss_rows = [run_loss_case(*case, Path(tmp)) for case in LOSS_CASES]
    out = HERE / "results" / "compile.md"
    text = out.read_text()
    head = text[:text.index("## torchtune's chunked loss, compiled")]
    out.write_text(head + "\n".join(loss_section(loss_rows)) + "\n")
    print(out.read_text())
    return 0


def main() -> int:
    if "--loss-only" in sys.argv:
        return loss_only()
    inductor = "--inductor" in sys.argv
    rows = []
    loss_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, precision, attention in CASES:
            rows.append(run_case(family, precision, attention, Path(tmp), "partitioned"))
            print(table(rows)[-1], flush=True)
        for case in LOSS_CASES:
            loss_rows.append(run_loss_case(*case, Path(tmp)))
            print(loss_table(loss_rows)[-1], flush=True)
        if inductor:
            row = run_case("llama", "fp32", "sdpa", Path(tmp), "inductor")
            row["case"] += " (inductor)"
            rows.append(row)
    lines = ["# torch.compile: saved bytes per block and the formulas vs real compiled CPU steps", "",
             "`python bench/compile.py" + (" --inductor" if inductor else "") + "`. Per layer: bytes one block keeps "
             "for backward (eager: memfit's recipes; compiled: AOTAutograd's min-cut partition of one block on fake "
             "tensors). Formula and measured: the whole step's peak of live tensor bytes (memfit.estimate vs "
             "memfit.measure of 2 real CPU steps, every block compiled; backend 'partitioned' = the min-cut "
             "partition run without codegen, or inductor where the row says so).", "", *table(rows), ""]
    worst = max(abs(_pct(r["compiled_pred"], r["compiled_meas"])) for r in rows)
    lines.append(f"Worst compiled error: {worst:.2f}% over {len(rows)} cases.")
    lines += ["", *loss_section(loss_rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    (HERE / "results" / "compile.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""torchtune's LoRA / QLoRA recipe (memfit.finetune.LoraRecipe.TORCHTUNE): memfit's formulas and trace vs real
CPU steps (profiler memory events, memfit.measure).

The measured model is what torchtune's lora_finetune_single_device trains, built from the libraries torchtune
builds it from: a tiny HF config in bf16, peft adapters kept in bf16 (no fp32 upcast), no
prepare_model_for_kbit_training, no enable_input_require_grads, and for QLoRA every block Linear stored as
torchao's NF4Tensor (memfit._torch.lora.quantize_torchao_nf4). Shapes are multiples of 16,384 elements, as
torchao's to_nf4 requires.

The measured figure is the step's tensors (MemoryEstimate.tensor_bytes): measure() runs it on one intra-op thread
(memfit._torch.threads) and keeps oneDNN's bf16 matmul scratch, which depends on the CPU and the thread count and
which no CUDA step has, out of it (measure_cpu).

    python bench/torchtune_lora.py            # prints the table, writes bench/results/torchtune_lora.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.finetune import Finetune  # noqa: E402
from memfit._torch.threads import MEASURE_THREADS  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

BASE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512}
CONFIGS = {
    "llama": dict(BASE, model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
}
TARGETS = {"attention": ("q_proj", "v_proj"), "all-linear": ("all-linear",)}


def setup_of(family: str, method: str, rank: int, targets: str, dropout: float, ckpt: bool,
             precision: str = "bf16", batch: int = 2, seq: int = 64) -> TrainingSetup:
    ft = Finetune(method=method, rank=rank, alpha=2 * rank, dropout=dropout, targets=TARGETS[targets],
                  recipe="torchtune")
    return TrainingSetup(micro_batch_size=batch, seq_len=seq, precision=precision, optimizer="adamw",
                         checkpointing="full" if ckpt else "none", attention="sdpa", finetune=ft)


def cases(quick: bool) -> list[tuple]:
    out = []
    families = ("llama",) if quick else tuple(CONFIGS)
    for family in families:
        for method in ("lora", "qlora"):
            for rank in ((8,) if quick else (4, 32)):
                for targets in (("all-linear",) if quick else ("attention", "all-linear")):
                    for dropout in ((0.0,) if quick else (0.0, 0.1)):
                        for ckpt in (False, True):
                            out.append((family, method, rank, targets, dropout, ckpt))
    return out


def measure_case(case: tuple) -> tuple[int, int]:
    from memfit.measure import measure

    setup = setup_of(*case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure(dict(CONFIGS[case[0]]), setup, steps=2, device="cpu")
    spec = resolve_model(dict(CONFIGS[case[0]]))
    formulas = estimate(spec, setup, make_hardware(cpu_device(64 * 1024**3)))
    return measured.tensor_bytes, formulas.tensor_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama only, one rank, all-linear, no dropout")
    parser.add_argument("--ckpt-only", action="store_true", help="only the checkpointed cases")
    parser.add_argument("--out", default=str(HERE / "results" / "torchtune_lora.md"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    lines = ["| case | measured B | memfit B | error |", "| --- | ---: | ---: | ---: |"]
    errors = []
    for case in cases(args.quick):
        if args.ckpt_only and not case[5]:
            continue
        measured, predicted = measure_case(case)
        err = 100 * (predicted - measured) / measured
        errors.append(err)
        name = "/".join([case[0], case[1], f"r{case[2]}", case[3], f"do{case[4]:g}", "ckpt" if case[5] else "no-ckpt"])
        lines.append(f"| {name} | {measured:,} | {predicted:,} | {err:+.2f}% |")
        print(lines[-1], flush=True)
    worst = max(errors, key=abs)
    head = (f"# torchtune's LoRA / QLoRA recipe: formulas vs measured CPU steps\n\n{len(errors)} cases (bf16 model, "
            f"bf16 adapters, torchao NF4 base for QLoRA, AdamW, 2 x 64 tokens; measured: tensor bytes of real CPU "
            f"steps on {MEASURE_THREADS} intra-op thread, oneDNN's scratch apart): median |error| "
            f"{statistics.median(abs(e) for e in errors):.2f}%, worst {worst:+.2f}%; "
            f"{time.perf_counter() - start:.0f} s\n\n")
    Path(args.out).write_text(head + "\n".join(lines) + "\n", encoding="utf-8")
    print(head)
    return 0


if __name__ == "__main__":
    sys.exit(main())

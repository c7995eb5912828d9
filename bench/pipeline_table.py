"""Pipeline parallelism on paper: every pipeline rank's peak for Llama-3.1-8B and -70B under GPipe, 1F1B and
interleaved 1F1B (memfit.estimate.pipeline), bf16 + FSDP2 over the data-parallel ranks, full checkpointing.
Prints a table and writes bench/results/pipeline.md.

    PYTHONPATH=src python bench/pipeline_table.py
"""

from __future__ import annotations

from pathlib import Path

from memfit.estimate import pipeline as ppm
from memfit.estimate import tensor_parallel as tpm
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.units import gib

CASES = [  # (model, world, tp, pp, schedule, virtual stages, micro-batches)
    ("llama-3.1-8b", 8, 1, 4, "gpipe", 1, 8), ("llama-3.1-8b", 8, 1, 4, "1f1b", 1, 8),
    ("llama-3.1-8b", 8, 1, 4, "interleaved-1f1b", 2, 8),
    ("llama-3.1-70b", 64, 8, 4, "1f1b", 1, 16), ("llama-3.1-70b", 64, 8, 4, "interleaved-1f1b", 2, 16),
    ("llama-3.1-70b", 64, 8, 8, "1f1b", 1, 16), ("llama-3.1-70b", 64, 8, 8, "interleaved-1f1b", 2, 16),
]


def rows() -> list[list[str]]:
    out = []
    for model, world, tp, pp, schedule, v, m in CASES:
        spec = resolve_model(model)
        setup = TrainingSetup(micro_batch_size=1, seq_len=8192, grad_accum_steps=m, precision="bf16",
                              optimizer="adamw-fused", checkpointing="full", engine="torch", num_gpus=world, tp=tp,
                              sequence_parallel=tp > 1, pp=pp, pp_schedule=schedule, pp_virtual_stages=v,
                              sharding="zero3" if world // (tp * pp) > 1 else "none")
        stages = ppm.stage_memories(tpm.rank_spec(spec, setup), setup)
        peaks = " / ".join(f"{gib(s.tensor_bytes):.1f}" for s in stages)
        flight = " / ".join(str(s.in_flight) for s in stages)
        out.append([model, f"{world}", f"tp{tp} pp{pp} dp{setup.dp_size}", f"{schedule} v{v}", str(m), flight,
                    peaks])
    return out


def main() -> None:
    header = ["model", "GPUs", "layout", "schedule", "micro-batches", "in flight per rank", "peak GiB per rank"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).parent / "results" / "pipeline.md"
    out.write_text("# Pipeline parallelism per rank (analytic, seq 8192, micro-batch 1, bf16, full checkpointing)\n\n"
                   + text + "\n")


if __name__ == "__main__":
    main()

"""Activation offloading (memfit.estimate.offload_activations): the formulas' host / offloaded / kept bytes against
the offload hooks' own counts on real tiny models (every family and precision memfit sizes, with and without
checkpointing), the same with LoRA / QLoRA adapters on a frozen base (memfit.estimate.offload_lora), then what it
does to full-size models on an H100. Prints the tables and writes bench/results/activation_offload.md.

    python bench/activation_offload.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
PRECISIONS = ("fp32", "amp-bf16", "bf16")
CHECKPOINTING = ("none", "full", "every-2")
FULL_SIZE = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b")
ADAPTERS = {"lora q,v": dict(method="lora", rank=4),
            "lora all d0.1": dict(method="lora", rank=4, dropout=0.1, targets=("all-linear",)),
            "qlora all d0.1": dict(method="qlora", rank=4, dropout=0.1, targets=("all-linear",))}


def hooks_table() -> list[tuple]:
    from test_activation_offload import packed_on_a_real_step, predicted, setup_of

    rows = []
    for family in FAMILIES:
        for precision in PRECISIONS:
            for mode in CHECKPOINTING:
                setup = setup_of(precision=precision, checkpointing=mode)
                counts, sizes = packed_on_a_real_step(family, setup), predicted(family, setup)
                rows.append((family, precision, mode, counts.packed_bytes, sizes.host_bytes, counts.offloaded_bytes,
                             sizes.offloaded_bytes, counts.kept_bytes, sizes.kept_bytes))
                print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def lora_hooks_table() -> list[tuple]:
    """The frozen-base cases: what the hooks pack against memfit.estimate.offload_lora (bitsandbytes' CPU 4-bit
    path on the Llama-shaped families; GPT-2's Conv1D 4-bit CPU path under autocast saves a dequantized weight)."""
    from test_activation_offload import packed_on_a_real_step, setup_of
    from test_offload_lora import predicted

    from memfit.finetune import Finetune

    rows = []
    for family in FAMILIES:
        for precision in PRECISIONS:
            for mode in ("none", "full"):
                for label, ft in ADAPTERS.items():
                    if ft["method"] == "qlora" and family == "gpt2":
                        continue
                    setup = setup_of(precision=precision, checkpointing=mode, finetune=Finetune(**ft))
                    counts, sizes = packed_on_a_real_step(family, setup), predicted(family, setup)
                    rows.append((family, precision, mode, label, counts.packed_bytes, sizes.host_bytes,
                                 counts.offloaded_bytes, sizes.offloaded_bytes, counts.weight_packed_bytes,
                                 sizes.weight_bytes))
                    print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def full_size_table() -> list[tuple]:
    from memfit.estimate.analytic import estimate
    from memfit.hardware import make_hardware
    from memfit.setup import TrainingSetup
    from memfit.sources import resolve_model
    from memfit.techniques.activation_offload import traffic_bytes as activation_offload_traffic_bytes
    from memfit.techniques.costs import host_link_seconds

    hw = make_hardware("h100")
    rows = []
    for name in FULL_SIZE:
        spec = resolve_model(name)
        for mode in ("none", "full"):
            setup = TrainingSetup(micro_batch_size=4, seq_len=4096, precision="bf16", optimizer="adamw-8bit",
                                  checkpointing=mode)
            plain = estimate(spec, setup, hw)
            offloaded = estimate(spec, setup.replace(activation_offload=True), hw)
            traffic = activation_offload_traffic_bytes(offloaded.cpu_bytes, offloaded.setup)
            rows.append((name, mode, plain.total_bytes, offloaded.total_bytes, offloaded.cpu_bytes, traffic,
                         host_link_seconds(traffic, hw)))
            print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main() -> None:
    from memfit.units import format_bytes

    hooks = hooks_table()
    adapters = lora_hooks_table()
    sized = full_size_table()
    exact = sum(r[3] == r[4] for r in hooks)
    lines = ["# Activation offloading: formulas vs the offload hooks, and full-size effect", "",
             "`python bench/activation_offload.py`. Tiny configs of tests/tiny_configs.py, micro-batch 2 x seq 128, "
             "one forward + loss on CPU under memfit._torch.offload_activations (torchtune's OffloadActivations "
             "rule: saved tensors >= 1024 B that are not nn.Parameter objects; the LM head and the loss kept). "
             "host = bytes packed (one copy per pack), offloaded = device storages that leave (each once), kept = "
             "saved storages left on the device. every-2: the rotary tables are packed by the plain block but held "
             "on the device by the checkpointed one's recompute: the hooks count their storage, the formulas do not.",
             "", f"Host bytes exact in {exact} of {len(hooks)} cases. The others are GPT-2 under amp-bf16 / bf16, off "
             "by 2-74 KiB (up to 1.4% of what moves; 12% of the 0.25 MiB that moves with full checkpointing): the "
             "per-layer recipes' CPU dtypes (the embedding dropout mask is kept in the embedding's fp32, sized in the "
             "compute dtype), not the offload rule; fp32 GPT-2 is exact.", "",
             "| family | precision | checkpointing | host (hooks) | host (formula) | offloaded (hooks) | "
             "offloaded (formula) | kept (hooks) | kept (formula) |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in r) + " |" for r in hooks]
    exact_lora = sum(r[4] == r[5] and r[6] == r[7] for r in adapters)
    lines += ["", "## LoRA / QLoRA (a frozen base: memfit.estimate.offload_lora)", "",
              "Rank 4; q,v = peft's default targets, all = all-linear; QLoRA = bitsandbytes NF4 + double "
              "quantization (its CPU path). weights = packed views of parameters (`weight.t()` saved for the input "
              f"gradient: copied, nothing freed). Host and offloaded bytes both exact in {exact_lora} of "
              f"{len(adapters)} cases; the others are GPT-2 under bf16 / amp-bf16, where its LayerNorm statistics "
              "are bf16 on CPU (under 1024 B each: kept) and sized fp32 by the per-layer recipe (the formula 2-8 KiB "
              "high, at most 1.6% of what moves).", "",
              "| family | precision | checkpointing | adapters | host (hooks) | host (formula) | offloaded (hooks) | "
              "offloaded (formula) | weights (hooks) | weights (formula) |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in r) + " |" for r in adapters]
    lines += ["", "## Full size: micro-batch 4 x seq 4096, pure bf16, 8-bit AdamW, one H100 (analytic)", "",
              "| model | checkpointing | peak without | peak with | pinned host RAM | PCIe per step | at 50 GB/s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {m} | {format_bytes(a)} | {format_bytes(b)} | {format_bytes(h)} | {format_bytes(t)} | "
              f"{s:.2f} s |" for n, m, a, b, h, t, s in sized]
    out = HERE / "results" / "activation_offload.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

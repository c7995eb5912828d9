"""Measured LoRA / QLoRA training steps on CPU: the ground truth memfit's LoRA formulas are checked against.

    OMP_NUM_THREADS=1 python bench/lora_measure.py            # the full matrix (~200 cases, a few minutes, 1 core)
    OMP_NUM_THREADS=1 python bench/lora_measure.py --quick    # 12 cases, printed (add --write to write them)
    OMP_NUM_THREADS=1 python bench/lora_measure.py --mechanisms   # one lora.Linear: saved bytes, measured vs formula
    OMP_NUM_THREADS=1 python bench/lora_measure.py --filter dora --merge   # re-measure some rows into the files

Writes bench/results/lora_measured.json (one object per case: the LoraCase fields, then what was measured) and
bench/results/lora_measured.md (a table). Each case is built by tests/lora_truth.py (the HF Trainer + peft recipe)
and measured by memfit.measure.measure (torch.profiler allocation events, two optimizer steps, step 2's peak).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from lora_truth import LoraCase  # noqa: E402

RESULTS = HERE / "results"
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "bert")


def full_matrix() -> list[LoraCase]:
    cases = []
    bases = (("fp32", "fp32"), ("bf16", "amp-bf16"))
    for family, rank, targets, dropout, ckpt, (base, precision) in itertools.product(
            FAMILIES, (4, 64), ("attention", "all-linear"), (0.0, 0.1), (False, True), bases):
        cases.append(LoraCase(family=family, rank=rank, alpha=2 * rank, targets=targets, dropout=dropout,
                              checkpointing=ckpt, base_dtype=base, precision=precision))
    cases += extra_rows()
    return cases


def extra_rows() -> list[LoraCase]:
    rows = []
    # pure bf16 (no autocast; peft still keeps the adapters fp32)
    for family, targets, ckpt in itertools.product(("llama", "gpt2"), ("attention", "all-linear"), (False, True)):
        rows.append(LoraCase(family=family, rank=16, alpha=32, targets=targets, base_dtype="bf16", precision="bf16",
                             checkpointing=ckpt))
    # optimizers over the adapters only
    for family, optimizer, precision in itertools.product(("llama", "qwen2"), ("adamw-foreach", "adamw-8bit", "sgd"),
                                                          ("fp32", "amp-bf16")):
        base = "fp32" if precision == "fp32" else "bf16"
        rows.append(LoraCase(family=family, rank=64, alpha=128, targets="all-linear", base_dtype=base,
                             precision=precision, optimizer=optimizer))
    # QLoRA: NF4 with/without double quant, FP4, compute dtype, checkpointing (Trainer's and peft's reentrant)
    for family, base, dq, ckpt, targets in itertools.product(("llama", "qwen2", "mistral", "gpt2"), ("nf4", "fp4"),
                                                             (False, True), (False, True),
                                                             ("attention", "all-linear")):
        if base == "fp4" and family != "llama":
            continue
        rows.append(LoraCase(family=family, rank=16, alpha=32, targets=targets, base_dtype=base, double_quant=dq,
                             precision="amp-bf16", checkpointing=ckpt))
    for precision, dropout in itertools.product(("fp32", "amp-bf16"), (0.0, 0.1)):
        rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="nf4",
                             double_quant=True, precision=precision, dropout=dropout))
    rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="nf4", double_quant=True,
                         precision="amp-bf16", compute_dtype="fp32"))
    rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="nf4", double_quant=True,
                         precision="amp-bf16", checkpointing=True, reentrant=True))
    rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="nf4", double_quant=True,
                         precision="amp-bf16", optimizer="adamw-8bit", checkpointing=True))
    # QLoRA without peft's prepare_model_for_kbit_training (fsdp_qlora, LitGPT, axolotl, LLaMA-Factory): the
    # embeddings, norms and head stay bf16, so the residual stream is bf16
    for family, ckpt in itertools.product(("llama", "qwen2"), (False, True)):
        rows.append(LoraCase(family=family, rank=16, alpha=32, targets="all-linear", base_dtype="nf4",
                             double_quant=True, precision="amp-bf16", checkpointing=ckpt, kbit_prep=False))
    # LLM.int8 base
    for precision, targets, ckpt in itertools.product(("fp32", "amp-bf16"), ("attention", "all-linear"),
                                                      (False, True)):
        rows.append(LoraCase(family="llama", rank=16, alpha=32, targets=targets, base_dtype="int8",
                             precision=precision, checkpointing=ckpt))
    # the embedding made to require grad without checkpointing, and a modules_to_save head
    for family in ("llama", "gpt2"):
        rows.append(LoraCase(family=family, rank=16, alpha=32, input_require_grads=True))
        rows.append(LoraCase(family=family, rank=16, alpha=32, base_dtype="bf16", precision="amp-bf16",
                             input_require_grads=True))
    rows.append(LoraCase(family="llama", rank=16, alpha=32, modules_to_save=("lm_head",)))
    rows.append(LoraCase(family="llama", rank=16, alpha=32, base_dtype="bf16", precision="amp-bf16",
                         modules_to_save=("lm_head",)))
    # longer sequence and bigger batch (scaling of the activation terms)
    # DoRA (peft use_dora): magnitude vectors, two more saved tensors per adapted Linear, the weight norm
    for family, rank, targets, dropout, (base, precision) in itertools.product(
            ("llama", "qwen2", "gpt2"), (8, 64), ("attention", "all-linear"), (0.0, 0.1),
            (("fp32", "fp32"), ("bf16", "amp-bf16"))):
        rows.append(LoraCase(family=family, rank=rank, alpha=2 * rank, targets=targets, dropout=dropout,
                             base_dtype=base, precision=precision, dora=True))
    rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="bf16", precision="bf16",
                         dora=True))
    # DoRA with (Trainer's non-reentrant) checkpointing: the weight norm is recomputed in each block's recompute
    for family, targets, (base, precision) in itertools.product(("llama", "qwen2", "gpt2", "bert"),
                                                                ("attention", "all-linear"),
                                                                (("fp32", "fp32"), ("bf16", "amp-bf16"))):
        rows.append(LoraCase(family=family, rank=8, alpha=16, targets=targets, base_dtype=base, precision=precision,
                             checkpointing=True, dora=True))
    rows.append(LoraCase(family="llama", rank=8, alpha=16, targets="all-linear", dropout=0.1, checkpointing=True,
                         dora=True))
    # DoRA on a bitsandbytes 4-bit base: peft dequantizes each weight for its norm (dequantize_module_weight)
    for family, targets, ckpt in itertools.product(("llama", "qwen2", "gpt2"), ("attention", "all-linear"),
                                                   (False, True)):
        rows.append(LoraCase(family=family, rank=8, alpha=16, targets=targets, base_dtype="nf4", double_quant=True,
                             precision="amp-bf16", checkpointing=ckpt, dora=True))
    rows.append(LoraCase(family="llama", rank=8, alpha=16, targets="all-linear", base_dtype="fp4",
                         precision="amp-bf16", dora=True))
    rows.append(LoraCase(family="llama", rank=8, alpha=16, targets="all-linear", base_dtype="nf4", double_quant=True,
                         precision="fp32", dora=True))
    for batch, seq in ((1, 128), (4, 32), (2, 256)):
        rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", batch=batch, seq=seq))
        rows.append(LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", batch=batch, seq=seq,
                             base_dtype="nf4", double_quant=True, precision="amp-bf16"))
    return rows


def quick_matrix() -> list[LoraCase]:
    return [
        LoraCase(family="llama", rank=4, alpha=8),
        LoraCase(family="llama", rank=64, alpha=128, targets="all-linear", dropout=0.1),
        LoraCase(family="llama", rank=64, alpha=128, targets="all-linear", checkpointing=True),
        LoraCase(family="qwen2", rank=4, alpha=8, base_dtype="bf16", precision="amp-bf16"),
        LoraCase(family="mistral", rank=64, alpha=128, targets="all-linear", base_dtype="bf16",
                 precision="amp-bf16", dropout=0.1, checkpointing=True),
        LoraCase(family="gpt2", rank=4, alpha=8, targets="all-linear", dropout=0.1),
        LoraCase(family="bert", rank=4, alpha=8, base_dtype="bf16", precision="amp-bf16"),
        LoraCase(family="llama", rank=16, alpha=32, base_dtype="bf16", precision="bf16", targets="all-linear"),
        LoraCase(family="llama", rank=64, alpha=128, targets="all-linear", optimizer="adamw-foreach"),
        LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="nf4", double_quant=False,
                 precision="amp-bf16"),
        LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="nf4", double_quant=True,
                 precision="amp-bf16", checkpointing=True),
        LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="fp4", precision="amp-bf16"),
    ]


def run(cases: list[LoraCase], *, out: Path | None, verbose: bool = True) -> list[dict]:
    import torch

    from lora_truth import measure_lora_case

    torch.set_num_threads(1)
    rows = []
    started = time.time()
    for index, case in enumerate(cases, 1):
        t0 = time.time()
        try:
            row = measure_lora_case(case)
        except Exception as error:  # noqa: BLE001 - a case that cannot run is reported, not fatal
            row = {"label": case.label, **case.to_dict(), "error": f"{type(error).__name__}: {error}"[:400]}
        row["seconds"] = round(time.time() - t0, 2)
        rows.append(row)
        if verbose:
            what = row.get("error") or f"{row['peak_bytes']:>10,} B  {row['peak_phase']}"
            print(f"[{index:3}/{len(cases)}] {row['seconds']:5.1f}s {case.label:<75} {what}", flush=True)
    if verbose:
        print(f"{len(cases)} cases in {time.time() - started:.0f}s", flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lora_measured.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "lora_measured.md").write_text(markdown(rows))
    return rows


COLUMNS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Measured LoRA / QLoRA training steps (CPU)",
        "",
        "Generated by `bench/lora_measure.py` (tests/lora_truth.py builds each case the HF Trainer + peft way; "
        "memfit.measure.measure measures two optimizer steps with torch.profiler, step 2's peak is shown). "
        "Tiny configs from tests/tiny_configs.py (hidden 64, 2 layers, vocab 512). Bytes are live tensor bytes at the "
        "peak; `quant` is bitsandbytes' QuantState / SCB tensors, which are not parameters or buffers and so are "
        "not inside `peak` (add them: `peak+quant`). `trainable` is the adapters' (and modules_to_save) bytes. "
        "`ckpt`: nr = non-reentrant (Trainer's default), re = reentrant. `irg`: the embedding output requires grad. "
        "`parameters` includes buffers, `activations` includes the batch (`inputs`, 2,048 B), `temporaries` includes "
        "`temporaries/preexisting`; the JSON keeps every memfit term apart, plus `optimizer_step_temporaries`.",
        "",
        "| case | peak | phase | " + " | ".join(COLUMNS) + " | trainable | quant | peak+quant | ckpt | irg |",
        "|---|" + "---:|" * 2 + "---:|" * len(COLUMNS) + "---:|" * 3 + "---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['label']} | error: {row['error'][:120]} |")
            continue
        terms = row["terms"]
        params = terms.get("parameters", 0) + terms.get("buffers", 0)
        values = [params] + [terms.get(name, 0) for name in COLUMNS[1:3]]
        values += [terms.get("activations", 0) + terms.get("inputs", 0),
                   terms.get("temporaries", 0) + terms.get("temporaries/preexisting", 0)]
        mode = {"off": "-", "non-reentrant": "nr", "reentrant": "re"}[row["checkpointing_mode"]]
        lines.append(f"| {row['label']} | {row['peak_bytes']:,} | {row['peak_phase']} | "
                     + " | ".join(f"{v:,}" for v in values)
                     + f" | {row['trainable_bytes']:,} | {row['quant_state_bytes']:,} | "
                       f"{row['peak_bytes_with_quant_state']:,} | {mode} | {'y' if row['input_require_grads_on'] else 'n'} |")
    errors = [r for r in rows if "error" in r]
    lines += ["", f"{len(rows)} cases, {len(errors)} errors."]
    return "\n".join(lines) + "\n"


def predicted_lora_linear_saved(tokens: int, d_in: int, d_out: int, rank: int, *, base: str, autocast: bool,
                                dropout: bool, x_needs_grad: bool = True) -> int:
    """Saved-for-backward bytes of ONE peft lora.Linear (non-parameter storages, its input x counted as its own),
    the formulas of bench/results/lora_mechanisms.md. base: 'fp32' | 'bf16' | 'nf4' (adapters fp32 in all)."""
    if autocast:  # every mm input cast to bf16 by autocast: own copies, never shared
        saved = tokens * (2 * d_in + 2 * rank)  # bf16 copy of (dropout(x)) for lora_A, bf16 rank-r for lora_B
        saved += 2 * rank * d_out  # lora_B's bf16 weight copy (its input always needs grad)
        if x_needs_grad:
            saved += 2 * d_in * rank + (2 * d_in * d_out if base == "fp32" else 0)  # lora_A / base bf16 weight copy
        if dropout and x_needs_grad:
            saved += tokens * 4 * d_in  # dropout's float mask (x upcast to the fp32 adapter dtype first)
        return saved
    saved = tokens * (4 * d_in + 4 * rank)  # x (or its fp32 copy / dropout output) for lora_A, rank-r for lora_B
    if dropout and x_needs_grad:
        saved += tokens * 4 * d_in  # the mask, fp32, same shape as x
    return saved


def mechanisms() -> int:
    """Print the saved tensors of one lora.Linear per base x autocast x dropout and the formula's prediction."""
    import torch

    from lora_truth import lora_linear, probe_linear, quantized_lora_linear

    torch.set_num_threads(1)
    print(f"{'base':<5} {'autocast':<8} {'dropout':<7} {'x.grad':<6} {'shape (N,in,out,r)':<22} "
          f"{'measured':>9} {'predicted':>9}")
    bad = 0
    for (batch, seq, d_in, d_out, rank) in ((2, 16, 96, 160, 8), (1, 64, 256, 512, 16), (4, 8, 64, 64, 4)):
        tokens = batch * seq
        for base, autocast, dropout, needs_grad in itertools.product(("fp32", "bf16", "nf4"), (False, True),
                                                                     (0.0, 0.1), (True, False)):
            if base == "nf4":
                model = quantized_lora_linear(d_in, d_out, base="nf4", rank=rank, dropout=dropout)
            else:
                model = lora_linear(d_in, d_out, rank=rank, dropout=dropout, dtype=base)
            dtype = torch.bfloat16 if base == "bf16" else torch.float32
            x = torch.randn(batch, seq, d_in, dtype=dtype, requires_grad=needs_grad)
            measured = probe_linear(model, x, autocast=autocast)["saved_bytes"]
            predicted = predicted_lora_linear_saved(tokens, d_in, d_out, rank, base=base, autocast=autocast,
                                                    dropout=bool(dropout), x_needs_grad=needs_grad)
            bad += measured != predicted
            print(f"{base:<5} {str(autocast):<8} {dropout:<7} {str(needs_grad):<6} "
                  f"{str((tokens, d_in, d_out, rank)):<22} {measured:>9,} {predicted:>9,}"
                  + ("" if measured == predicted else "  <-- differs"))
    print(f"{bad} differ")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 cases only")
    parser.add_argument("--mechanisms", action="store_true", help="one lora.Linear: saved bytes measured vs the formulas (writes nothing)")
    parser.add_argument("--no-write", action="store_true", help="measure but write no files")
    parser.add_argument("--write", action="store_true", help="with --quick or --filter: write the files anyway")
    parser.add_argument("--filter", default="", help="only cases whose label contains this text")
    parser.add_argument("--merge", action="store_true", help="write the measured rows into the existing files, "
                                                              "replacing rows of the same label")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.mechanisms:
        return mechanisms()
    cases = quick_matrix() if args.quick else full_matrix()
    if args.filter:
        cases = [c for c in cases if args.filter in c.label]
    if args.merge:
        rows = run(cases, out=None)
        fresh = {r["label"]: r for r in rows}
        stored = json.loads((RESULTS / "lora_measured.json").read_text())
        merged = [fresh.pop(r["label"], r) for r in stored] + list(fresh.values())
        (RESULTS / "lora_measured.json").write_text(json.dumps(merged, indent=1) + "\n")
        (RESULTS / "lora_measured.md").write_text(markdown(merged))
        return 1 if any("error" in r for r in rows) else 0
    partial = (args.quick or args.filter) and not args.write
    rows = run(cases, out=None if args.no_write or partial else RESULTS)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

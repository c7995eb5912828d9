"""What is live at the peak of a real checkpointed LoRA step: every allocation still alive at step 2's peak, named
by the autograd node and the modules / Python frames it was made under (torch.profiler memory events with
with_stack / with_modules), beside memfit's terms at its predicted peak. The timelines that
memfit.estimate.lora_checkpoint is read from.

    OMP_NUM_THREADS=1 python bench/lora_checkpoint.py                 # the default cases, writes bench/results/lora_checkpoint.md
    OMP_NUM_THREADS=1 python bench/lora_checkpoint.py family=bert rank=64 targets=attention base_dtype=bf16 \\
        precision=amp-bf16 checkpointing=True                        # one LoraCase (its fields), printed only
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from lora_truth import LoraCase  # noqa: E402

CASES = (
    LoraCase(family="gpt2", rank=4, alpha=8, targets="all-linear", dropout=0.1, checkpointing=True,
             base_dtype="bf16", precision="amp-bf16"),
    LoraCase(family="gpt2", rank=4, alpha=8, targets="attention", checkpointing=True),
    LoraCase(family="bert", rank=4, alpha=8, targets="attention", checkpointing=True),
    # DoRA: block 0's recompute peaks in down_proj's DoRA forward
    LoraCase(family="llama", rank=8, alpha=16, targets="all-linear", checkpointing=True, base_dtype="bf16",
             precision="amp-bf16", dora=True),
    # block 0's recompute peaks inside CPU SDPA's math path (autocast, attention dropout)
    LoraCase(family="bert", rank=64, alpha=128, targets="attention", checkpointing=True, base_dtype="bf16",
             precision="amp-bf16"),
)


def _label(node) -> str:
    """The innermost op, the autograd node it runs under, and the innermost modules / frames of one event."""
    from torch._C._profiler import _EventType

    frames, ops = [], []
    parent = node.parent
    while parent is not None:
        if parent.tag == _EventType.PyCall and len(frames) < 3:
            name = parent.name
            frames.append(name[len("nn.Module: "):] if name.startswith("nn.Module:") else name.split("/")[-1])
        elif parent.tag == _EventType.TorchOp:
            if not ops:
                ops.append(parent.name)
            elif parent.name.startswith("autograd::engine"):
                ops.append("bw:" + parent.name.split(": ")[-1])
        parent = parent.parent
    return " < ".join(ops[:2]) + " | " + " < ".join(frames)


def live_at_peak(case: LoraCase) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes incl. what was live before the step, [(bytes, label)] of the step's allocations live then)."""
    import torch
    from torch._C._profiler import _EventType

    from lora_truth import build_lora_model, make_batches, quiet, training_setup
    from memfit._torch import step as torch_step
    from memfit._torch.measure_cpu import storage_baseline

    torch.set_num_threads(1)
    torch.manual_seed(case.seed)
    model = build_lora_model(case)
    setup = training_setup(case)
    batches = make_batches(model, case)
    optimizer = torch_step.make_optimizer(model, setup)
    model.train()
    with quiet():
        torch_step.training_step(model, optimizer, batches, setup)  # step 1 makes the optimizer state
    before = sum(size for _, size, _ in storage_baseline(model, optimizer, batches))
    with quiet(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                         with_stack=True, with_modules=True) as prof:
        torch_step.training_step(model, optimizer, batches, setup)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, node))
    events.sort(key=lambda e: e[0])
    live, current, peak, snapshot = {}, 0, 0, {}
    for index, (_, size, ptr, _) in enumerate(events):
        if size > 0:
            live[ptr] = (size, index)
        else:
            live.pop(ptr, None)
        current += size
        if current > peak:
            peak, snapshot = current, dict(live)
    rows = [(size, _label(events[index][3])) for size, index in sorted(snapshot.values(), key=lambda v: v[1])]
    return before + peak, rows


def report(case: LoraCase) -> str:
    from lora_accuracy import setup_of
    from tiny_configs import TINY_CONFIGS

    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.sources import resolve_model

    peak, rows = live_at_peak(case)
    predicted = estimate(resolve_model(TINY_CONFIGS[case.family]), setup_of(case.to_dict()),
                         make_hardware(cpu_device(64 * 1024**3)))
    lines = [f"## {case.label}", "",
             f"measured peak {peak:,} B, memfit {predicted.tensor_bytes:,} B "
             f"({100 * (predicted.tensor_bytes - peak) / peak:+.2f}%)", "",
             "memfit's terms at its peak:", ""]
    lines += [f"    {t.num_bytes:>10,}  {t.name}" for t in predicted.terms]
    lines += ["", "the step's allocations live at the measured peak (bytes, op < autograd node | modules, frames):",
              ""]
    lines += [f"    {size:>10,}  {label[:150]}" for size, label in rows if size >= 256]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv:
        fields = {}
        for arg in argv:
            key, value = arg.split("=", 1)
            try:
                fields[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                fields[key] = value
        print(report(LoraCase(**fields)))
        return 0
    text = "# Checkpointed LoRA: what is live at the measured peak (CPU)\n\n" + "\n".join(report(c) for c in CASES)
    print(text)
    (HERE / "results" / "lora_checkpoint.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

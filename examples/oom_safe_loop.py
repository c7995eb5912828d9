"""OOM-safe training on a simulated device: memfit plans the cheapest changes for a memory budget the step does not fit
in, and `FitLoop` trains through the out-of-memory errors -- moving down the plan and replaying the batch -- with the
same effective batch and the optimizer state intact.

On a GPU, drop the DeviceBudget: the loop reacts to torch.OutOfMemoryError the same way.

    python examples/oom_safe_loop.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import memfit
from memfit._torch.budget import DeviceBudget
from memfit.fit import FitLoop
from memfit.hardware import cpu_device, make_hardware
from memfit.plan import plan
from memfit.units import MiB, format_bytes

GLOBAL_BATCH, SEQ_LEN, VOCAB_SIZE = 8, 64, 512


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB_SIZE, max_position_embeddings=512, use_cache=False)
    model = LlamaForCausalLM(config)
    setup = memfit.TrainingSetup(micro_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32", optimizer="adamw")
    limit = 4 * MiB  # the unmodified step peaks near 10 MB
    the_plan = plan(memfit.as_spec(model), setup, make_hardware(cpu_device(limit)))
    print(f"plan for {format_bytes(limit)}: " + " -> ".join(step.title for step in the_plan.steps))

    ids = torch.randint(0, VOCAB_SIZE, (2, GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": chunk, "labels": chunk.clone()} for chunk in ids]  # one global batch per step
    with DeviceBudget(limit) as device:
        device.track(model, batches)
        loop = FitLoop(model, None, the_plan, on_change=lambda event: print(f"  {event}"))
        for step in range(6):
            loop.step(batches[step % 2])
    report = loop.report()
    print(report.summary().splitlines()[0])
    print(device.summary())
    final = report.setup
    print(f"memfit example: {len(report.steps)} steps of {GLOBAL_BATCH} sequences under {format_bytes(limit)}, "
          f"{len(report.events)} out-of-memory errors handled, now micro-batch {final.micro_batch_size} x "
          f"{final.grad_accum_steps} checkpointing {final.checkpointing}, loss on the first batch "
          f"{report.losses[0]:.3f} -> {report.losses[4]:.3f}")


if __name__ == "__main__":
    main()

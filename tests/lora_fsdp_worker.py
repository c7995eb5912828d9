"""One rank of a 2-rank FSDP2 LoRA job on gloo (run by tests/lora/test_lora_sharded.py under torchrun): for each setup
given, the tiny Llama with peft LoRA / QLoRA adapters (memfit._torch.step.build_hf_model), sharded by memfit's
engine (`fully_shard` per block, then the root), AdamW, a few real steps under memfit's PeakMeter. Writes
OUT/<name>/rank<R>.json: each parameter's local elements and bytes (frozen / trainable), the QuantState bytes, the
optimizer's state bytes, the peak, the losses, each step's collective payloads (memfit._torch.comm_count)."""

from __future__ import annotations

import contextlib
import sys

import torch
from torchrun_job import serve_setups, token_batches


def run(config: dict, setup, steps: int) -> dict:
    from memfit._torch.comm_count import CollectiveCounter
    from memfit._torch.engine import prepare
    from memfit._torch.rank_memory import PeakMeter
    from memfit._torch.step import build_hf_model
    from memfit._torch.storage import storage_nbytes
    torch.manual_seed(0)
    batches = token_batches(config, setup, steps)
    with PeakMeter() as meter:
        model = build_hf_model(config, setup)
        prepared = prepare(model, setup)
        losses, comm = [], []
        # under CPU offload only the last step is metered: the optimizer states (host side) exist all through it
        offloaded = setup.offload.value != "none"
        with contextlib.nullcontext() if offloaded else meter.window():
            for index, batch in enumerate(batches):
                last = offloaded and index == len(batches) - 1
                with meter.window() if last else contextlib.nullcontext(), CollectiveCounter() as counter:
                    losses.append(prepared.train_step(batch))
                comm.append(counter.payload_bytes())
        local = {}
        for name, param in prepared.module.named_parameters():
            shard = param.to_local() if hasattr(param, "to_local") else param
            local[name] = {"numel": shard.numel(), "bytes": storage_nbytes(shard), "trainable": param.requires_grad}
        quant = quant_state_bytes(prepared.module)
        states = sum((v.to_local() if hasattr(v, "to_local") else v).untyped_storage().nbytes()
                     for state in prepared.optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    alive = [*prepared.module.parameters(), *prepared.module.buffers(),
             *(v for state in prepared.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    meter.account_unseen_frees(alive)
    return {"local": local, "optimizer_bytes": states, "quant_state_bytes": quant, "peak_bytes": meter.peak_bytes,
            "unseen_at_peak_bytes": meter.unseen_at_peak_bytes, "end_bytes": meter.end_bytes, "losses": losses,
            "comm_payload_bytes": comm}


def host_side_bytes(rank: dict) -> int:
    """Under FSDP2's CPUOffloadPolicy, what a rank's result says is on the host: every parameter shard, the optimizer
    states and one gradient shard per trainable shard (fp32 adapters: the same bytes)."""
    shards = sum(p["bytes"] for p in rank["local"].values())
    return shards + rank["optimizer_bytes"] + sum(p["bytes"] for p in rank["local"].values() if p["trainable"])


def compute_side_interval(rank: dict) -> tuple[int, int]:
    """On a CPU run the host and the "device" are one memory: the compute side of the peak is the peak (of the last
    step, when the optimizer states exist: `run`) less the host-side tensors, an interval because gloo frees some
    buffers unseen (`unseen_at_peak_bytes`) and some gradient shards may not exist yet at the peak."""
    grads = sum(p["bytes"] for p in rank["local"].values() if p["trainable"])
    return (rank["peak_bytes"] - rank["unseen_at_peak_bytes"] - host_side_bytes(rank),
            rank["peak_bytes"] - host_side_bytes(rank) + grads)


def quant_state_bytes(model) -> int:
    """bitsandbytes' QuantState tensors (absmax, codes, offset), each storage once: Linear4bit keeps its own
    reference (module.quant_state) beside the weight's, which FSDP2 replaces by its shard."""
    from lora_truth import quant_state_tensors, storage_bytes

    return storage_bytes([t for m in model.modules() for t in quant_state_tensors(getattr(m, "quant_state", None))])


if __name__ == "__main__":
    sys.exit(serve_setups(run, *sys.argv[1:]))

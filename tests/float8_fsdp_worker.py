"""One rank of a 2-rank FSDP2 float8 job on gloo (run by tests/estimate/test_float8.py under torchrun): for each setup given,
the tiny Llama with torchao Float8Linear (memfit._torch.step.build_hf_model: memfit._torch.float8), sharded by
memfit's engine (`fully_shard` per block, then the root), AdamW, real steps under memfit's PeakMeter and
CollectiveCounter. Writes OUT/<name>/rank<R>.json: the peak and the all-gather payload bytes of the last step (any
dtype: FSDP2 gathers a float8 block as one uint8 buffer)."""

from __future__ import annotations

import sys

import torch
from torchrun_job import serve_setups, token_batches


def run(config: dict, setup, steps: int) -> dict:
    from memfit._torch.comm_count import CollectiveCounter
    from memfit._torch.engine import prepare
    from memfit._torch.rank_memory import PeakMeter
    from memfit._torch.step import build_hf_model

    torch.manual_seed(0)
    batches = token_batches(config, setup, steps)
    with PeakMeter() as meter:
        prepared = prepare(build_hf_model(config, setup), setup)
        for batch in batches[:-1]:
            prepared.train_step(batch)
        with meter.window(), CollectiveCounter() as counter:
            loss = prepared.train_step(batches[-1])
    gathers = [c for c in counter.calls if c.kind == "all-gather" and c.num_elements > 1024]  # FSDP2's, any dtype
    return {"peak_bytes": meter.peak_bytes, "all_gather_bytes": sum(c.payload_bytes for c in gathers),
            "loss": loss}


if __name__ == "__main__":
    sys.exit(serve_setups(run, *sys.argv[1:]))

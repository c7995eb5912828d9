"""One rank of a 2-rank FSDP2 float8 job on gloo (run by tests/test_float8.py under torchrun): for each setup given,
the tiny Llama with torchao Float8Linear (memfit._torch.step.build_hf_model: memfit._torch.float8), sharded by
memfit's engine (`fully_shard` per block, then the root), AdamW, real steps under memfit's PeakMeter and
CollectiveCounter. Writes OUT/<name>/rank<R>.json: the peak and the all-gather payload bytes of the last step (any
dtype: FSDP2 gathers a float8 block as one uint8 buffer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(config_path: str, out: str, setups_json: str, steps: str) -> int:
    from memfit import TrainingSetup
    from memfit._torch.engine import init_process_group

    config = json.loads(Path(config_path).read_text())
    rank, ranks = init_process_group()
    for name, fields in json.loads(setups_json).items():
        result = run(config, TrainingSetup(**fields), int(steps))
        (Path(out) / name).mkdir(parents=True, exist_ok=True)
        (Path(out) / name / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": ranks, **result}))
        dist.barrier()
    dist.destroy_process_group()
    return 0


def run(config: dict, setup, steps: int) -> dict:
    from memfit._torch.comm_count import CollectiveCounter
    from memfit._torch.engine import prepare
    from memfit._torch.rank_memory import PeakMeter
    from memfit._torch.step import build_hf_model

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1234)
    batches = [{"input_ids": ids, "labels": ids} for ids in
               (torch.randint(0, config["vocab_size"], (setup.micro_batch_size, setup.seq_len), generator=generator)
                for _ in range(steps))]
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
    sys.exit(main(*sys.argv[1:]))

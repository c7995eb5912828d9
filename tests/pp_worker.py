"""One rank of a 2-rank pipeline-parallel job on gloo (run by tests/estimate/test_pipeline.py under torchrun): the tiny Llama
cut into one stage per rank (memfit._torch.pipeline, as torchtitan splits it), torch.distributed.pipelining's GPipe
or 1F1B schedule over the micro-batches, AdamW, a few real steps under memfit's PeakMeter. Writes OUT/rank<R>.json:
the rank's parameter elements, optimizer state bytes, peak, the bytes it sent per step and the losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(config_path: str, out: str, schedules: str, steps: str, micro: str, seq: str, chunks: str) -> int:
    from memfit._torch.engine import init_process_group

    config = json.loads(Path(config_path).read_text())
    rank, ranks = init_process_group()
    for name in schedules.split(","):
        result = run(config, rank, ranks, name, int(steps), int(micro), int(seq), int(chunks))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}_rank{rank}.json").write_text(json.dumps(result) + "\n")
        dist.barrier()
    dist.destroy_process_group()
    return 0


def run(config: dict, rank: int, ranks: int, schedule_name: str, steps: int, micro: int, seq: int,
        num_chunks: int) -> dict:
    """`steps` optimizer steps of `num_chunks` micro-batches under the schedule, metered; what the rank held."""
    from memfit import TrainingSetup
    from memfit._torch.pipeline import P2PCounter, schedule, shifted_labels, stage_module
    from memfit._torch.rank_memory import PeakMeter
    from memfit._torch.step import build_hf_model

    setup = TrainingSetup(micro_batch_size=micro, seq_len=seq, precision="fp32", optimizer="adamw")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, config["vocab_size"], (setup.micro_batch_size * num_chunks, setup.seq_len),
                             generator=generator) for _ in range(steps)]
    with PeakMeter() as meter:
        module = stage_module(build_hf_model(config, setup), rank, ranks)
        pipe = schedule(module, rank, ranks, schedule_name, num_chunks)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=False)
        losses, sent = [], []
        with meter.window():
            for ids in batches:
                counter = P2PCounter()
                step_losses: list[torch.Tensor] = []
                with counter.counting():
                    if rank == 0:
                        pipe.step(ids, return_outputs=False)
                    else:
                        pipe.step(target=shifted_labels(ids), losses=step_losses, return_outputs=False)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sent.append(counter.sent_bytes)
                losses.append([float(loss) for loss in step_losses])
                del step_losses
        numel = sum(p.numel() for p in module.parameters())
        states = sum(v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    stage = pipe._stage
    buffers = [info.buffer for table in (stage.args_recv_info, stage.grad_recv_info) for infos in table.values()
               for info in infos if getattr(info, "buffer", None) is not None]
    alive = [*module.parameters(), *module.buffers(), *buffers,
             *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    meter.account_unseen_frees(alive)
    return {"rank": rank, "schedule": schedule_name, "num_params": numel, "optimizer_bytes": states,
            "peak_bytes": meter.peak_bytes, "unseen_at_peak_bytes": meter.unseen_at_peak_bytes,
            "end_bytes": meter.end_bytes, "recv_buffer_bytes": sum(b.untyped_storage().nbytes() for b in buffers),
            "sent_bytes": sent, "losses": losses}


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""One rank of a 2-rank tensor-parallel job on gloo (run by tests/estimate/test_tensor_parallel.py under torchrun): the tiny
Llama parallelized with DTensor as torchtitan does (memfit._torch.tensor_parallel), AdamW, a few real steps under
memfit's PeakMeter. Writes OUT/rank<R>.json: per-parameter local elements, what the rank holds, its peak, losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(config_path: str, out: str, sequence_parallel: str, steps: str, micro: str, seq: str,
         checkpointing: str = "none") -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from memfit import TrainingSetup
    from memfit._torch.comm_count import CollectiveCounter
    from memfit._torch.engine import init_process_group
    from memfit._torch.rank_memory import PeakMeter
    from memfit._torch.step import build_hf_model
    from memfit._torch.tensor_parallel import forward_loss, local_numel, parallelize_llama

    config = json.loads(Path(config_path).read_text())
    rank, ranks = init_process_group()
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
    setup = TrainingSetup(micro_batch_size=int(micro), seq_len=int(seq), precision="fp32", optimizer="adamw",
                          checkpointing=checkpointing)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, config["vocab_size"], (setup.micro_batch_size, setup.seq_len), generator=generator)
               for _ in range(int(steps))]
    with PeakMeter() as meter:
        model = build_hf_model(config, setup)
        parallelize_llama(model, mesh, sequence_parallel=sequence_parallel == "1")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        losses, comm = [], []
        with meter.window():
            for ids in batches:
                with CollectiveCounter() as counter, loss_parallel():
                    loss = forward_loss(model, ids)
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                comm.append(counter.payload_bytes())
                losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
                del loss
        numel = local_numel(model)
        states = sum((v.to_local() if hasattr(v, "to_local") else v).untyped_storage().nbytes()
                     for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    alive = [*model.parameters(), *model.buffers(),
             *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    meter.account_unseen_frees(alive)
    result = {"rank": rank, "unseen_at_peak_bytes": meter.unseen_at_peak_bytes, "world_size": ranks, "local_numel": numel, "param_bytes": 4 * sum(numel.values()),
              "optimizer_bytes": states, "peak_bytes": meter.peak_bytes, "end_bytes": meter.end_bytes,
              "losses": losses, "comm_payload_bytes": comm}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

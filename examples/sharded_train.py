"""Train a small Llama sharded over every rank of a job, the way `memfit launch` starts it, and report what each
rank holds and its peak memory as one JSON line per rank.

    memfit launch examples/sharded_train.py --gpus 2 --zero zero3 -b 2 -s 128 --precision fp32 --optimizer adamw
    memfit launch examples/sharded_train.py --gpus 2 --zero zero2 --engine deepspeed -b 2 -s 128
    python examples/sharded_train.py            # one process, no sharding: the reference run

memfit launch puts the setup and engine in the environment (MEMFIT_SETUP, MEMFIT_ENGINE); the commands `memfit plan`
prints name the memfit_setup.json that `--emit DIR` writes instead (MEMFIT_SETUP_FILE). Run under plain torchrun or
the deepspeed launcher without either, pass them with --setup/--engine. Every rank builds the same model from the same
seed and trains on its slice of the same global batch, so the loss equals a one-process run on the whole batch.
Each rank also reports the bytes its collectives covered in every step (memfit._torch.comm_count), which
tests/test_launch.py compares with memfit's communication model (memfit.estimate.comm).

With --out DIR each rank writes DIR/rank<R>.json, then DIR/rank<R>.done once it is written: a job that is killed
or aborts after that point (DeepSpeed on CPU sometimes does, at interpreter exit) still has complete results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from memfit import TrainingSetup
from memfit._torch.comm_count import CollectiveCounter
from memfit._torch.engine import init_process_group
from memfit._torch.rank_memory import PeakMeter
from memfit._torch.step import build_hf_model
from memfit.launch import engine_from_env, prepare, setup_from_env

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512,
              "tie_word_embeddings": False}
REFERENCE = TrainingSetup(micro_batch_size=2, seq_len=128, precision="fp32", optimizer="adamw")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="an HF config.json (default: a tiny Llama)")
    parser.add_argument("--setup", help="TrainingSetup fields as JSON (default: MEMFIT_SETUP, else one process, "
                                        "micro-batch 2 x seq 128, fp32, AdamW)")
    parser.add_argument("--engine", help="torch or deepspeed (default: MEMFIT_ENGINE, else torch)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, help="directory for rank<R>.json and rank<R>.done")
    return parser.parse_args(argv)


def global_batch(config: dict, setup: TrainingSetup, ranks: int, step: int) -> dict:
    """The whole job's batch for one step, the same on every rank: micro_batch_size x ranks rows."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, config["vocab_size"], (setup.micro_batch_size * ranks, setup.seq_len),
                        generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def rank_slice(batch: dict, setup: TrainingSetup, rank: int, device) -> dict:
    rows = slice(rank * setup.micro_batch_size, (rank + 1) * setup.micro_batch_size)
    return {key: value[rows].to(device) for key, value in batch.items()}


def mean_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    if torch.cuda.is_available():
        tensor = tensor.cuda()
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def train(config: dict, setup: TrainingSetup, engine, *, steps: int, lr: float) -> dict:
    """Build, shard and train on this rank; return what it held, its peak, the payload bytes of its collectives per
    step and the job's mean loss per step."""
    rank, ranks = init_process_group()
    torch.manual_seed(0)  # the same initial weights on every rank
    with PeakMeter() as meter:  # entered before the model exists, so every byte the job allocates is counted
        model = build_hf_model(config, setup.replace(sharding="none", offload="none", num_gpus=1))
        prepared = prepare(model, setup, engine=engine, lr=lr)
        device = next(prepared.module.parameters()).device
        batches = [global_batch(config, setup, ranks, step) for step in range(steps)]
        losses, comm = [], []
        with meter.window():
            for step in range(steps):
                local = rank_slice(batches[step], setup, rank, device)
                with CollectiveCounter() as counter:
                    loss = prepared.train_step(local)
                comm.append(counter.payload_bytes())
                losses.append(mean_over_ranks(loss))
        held = prepared.local_bytes()
    return {"rank": rank, "world_size": ranks, "engine": prepared.engine.value, "runtime": prepared.runtime.name,
            "setup": prepared.setup.to_dict(), "losses": losses, "comm_payload_bytes": comm,
            "peak_bytes": meter.peak_bytes, "end_bytes": meter.end_bytes, **held, "notes": prepared.notes}


def main(argv=None) -> int:
    args = parse_args(argv)
    config = json.loads(args.config.read_text()) if args.config else dict(TINY_LLAMA)
    setup = TrainingSetup(**json.loads(args.setup)) if args.setup else (setup_from_env() or REFERENCE)
    engine = args.engine or engine_from_env()
    result = train(config, setup, engine, steps=args.steps, lr=args.lr)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{result['rank']}.json").write_text(line + "\n")
        (args.out / f"rank{result['rank']}.done").write_text("training completed, results written\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

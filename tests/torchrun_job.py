"""One helper for the tests that run real multi-rank jobs on CPU: `torchrun --standalone` over a worker script in
tests/, with gloo, offline, one thread per rank, memfit's own tree first on the path. The worker writes its
per-rank JSON results under the output folder it is given (its second argument, after the model config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_ranks(worker: Path, config: dict, tmp: Path, *args: str, ranks: int = 2, timeout: int = 300) -> Path:
    """Run `worker CONFIG OUT *args` on `ranks` local gloo ranks in `tmp`; returns OUT. A failed job fails the test
    with the tail of its output."""
    config_path, out = tmp / "config.json", tmp / "out"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(worker), str(config_path), str(out), *args]
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out


def rank_results(folder: Path, ranks: int = 2, prefix: str = "") -> list[dict]:
    """The per-rank JSON files a worker wrote: FOLDER/<prefix>rank<R>.json."""
    return [json.loads((folder / f"{prefix}rank{rank}.json").read_text()) for rank in range(ranks)]


# ---- the worker side: what every setups-driven worker script does on its rank


def serve_setups(run, config_path: str, out: str, setups_json: str, steps: str) -> int:
    """A worker's main: join the gloo group, `run(config, TrainingSetup(**fields), steps)` for each named setup and
    write its result to OUT/<name>/rank<R>.json, in step with the other ranks."""
    import torch.distributed as dist

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


def token_batches(config: dict, setup, steps: int) -> list[dict]:
    """`steps` causal-LM batches of random token ids (labels = inputs), the same on every rank (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    return [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(0, config["vocab_size"], (setup.micro_batch_size, setup.seq_len), generator=generator)
             for _ in range(steps))]

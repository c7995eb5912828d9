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

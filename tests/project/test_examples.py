"""The examples run as a user would run them (a fresh `python examples/x.py`) and finish with their result line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def _run(script: str) -> str:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.processes
def test_hf_trainer_example_trains_three_steps_with_memfits_setup():
    out = _run("hf_trainer_finetune.py")
    assert re.search(r"^memfit example: Trainer ran 3 steps with \w+, checkpointing on, final loss \d", out, re.M)
    assert "checkpointing: changed - turned on" in out


@pytest.mark.processes
def test_plain_pytorch_example_measures_less_after_apply_and_learns():
    out = _run("plain_pytorch_loop.py")
    line = re.search(r"^memfit example: peak ([\d.]+) MiB -> ([\d.]+) MiB, loss ([\d.]+) -> ([\d.]+)$", out, re.M)
    assert line, out
    before, after, first_loss, last_loss = map(float, line.groups())
    assert after < 0.5 * before
    assert last_loss < first_loss

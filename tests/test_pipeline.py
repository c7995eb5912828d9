"""Pipeline parallelism (memfit.estimate.pipeline): the formulas against real 2-rank gloo runs of the tiny Llama cut
into two stages with torch.distributed.pipelining (GPipe and 1F1B, 4 micro-batches; peak within 2% per rank, the
p2p bytes per step equal to the communication model's), the schedules' micro-batches in flight against torch's own
schedule tables and Narayanan et al. / Korthikanti et al., static memory per stage on paper, the CLI and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.estimate import pipeline as ppm
from memfit.estimate.analytic import estimate
from memfit.estimate.comm import comm_volume, pipeline_collectives
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from tiny_configs import TINY_LLAMA

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "pp_worker.py"
RANKS, STEPS, MICRO, SEQ, CHUNKS = 2, 2, 2, 128, 4
SCHEDULES = ("gpipe", "1f1b")
SPEC = resolve_model(TINY_LLAMA)
HARDWARE = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=RANKS)
PEAK_TOLERANCE = 0.02


def _setup(schedule: str = "1f1b", **changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=MICRO, seq_len=SEQ, grad_accum_steps=CHUNKS, precision="fp32",
                         optimizer="adamw", engine="torch", num_gpus=RANKS, pp=RANKS,
                         pp_schedule=schedule).replace(**changes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One torchrun job: both schedules, one after the other, on a fresh model each."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("pp")
    config, out = tmp / "config.json", tmp / "out"
    config.write_text(json.dumps(TINY_LLAMA))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
            str(WORKER), str(config), str(out), ",".join(SCHEDULES), str(STEPS), str(MICRO), str(SEQ), str(CHUNKS)]
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {name: [json.loads((out / f"{name}_rank{rank}.json").read_text()) for rank in range(RANKS)]
            for name in SCHEDULES}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_gloo_stages_peak_within_two_percent_of_the_formulas(runs, schedule):
    """Each rank's measured peak (the interval PeakMeter allows for buffers gloo's thread freed unseen) against
    that rank's stage estimate; its parameters, optimizer states and receive buffers exactly."""
    setup = _setup(schedule)
    stages = ppm.stage_memories(SPEC, setup, on_cpu=True)
    for rank, stage in zip(runs[schedule], stages):
        high, unseen = rank["peak_bytes"], rank["unseen_at_peak_bytes"]
        low, predicted = high - unseen, stage.tensor_bytes
        print(f"{schedule} rank {rank['rank']}: measured {low:,}..{high:,} B, predicted {predicted:,} B "
              f"({low / predicted - 1:+.2%}..{high / predicted - 1:+.2%}) at its {stage.moment}")
        assert low <= predicted * (1 + PEAK_TOLERANCE), (low, predicted)
        assert high >= predicted * (1 - PEAK_TOLERANCE), (high, predicted)
        own = ppm.stage_spec(SPEC, stage.held)
        assert rank["num_params"] == own.num_params
        scalars = 4 * sum(p.count for p in own.params)  # AdamW's 0-d 'step' tensors, left out of the worker's count
        terms = {t.name: t.num_bytes for t in stage.terms}
        assert rank["optimizer_bytes"] == terms["optimizer/states"] - scalars
        assert rank["recv_buffer_bytes"] == terms["activations/p2p_buffers"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_p2p_bytes_per_step_are_the_communication_model(runs, schedule):
    setup = _setup(schedule)
    for rank in runs[schedule]:
        sends = pipeline_collectives(SPEC, setup, rank["rank"])
        assert rank["sent_bytes"] == [sum(c.payload_bytes for c in sends)] * STEPS
    assert comm_volume(SPEC, setup).pipeline_parallel_bytes == CHUNKS * MICRO * SEQ * TINY_LLAMA["hidden_size"] * 4


def test_schedules_give_the_same_losses(runs):
    """The two schedules compute the same step (same data, same initial weights): their losses agree."""
    for gpipe, one_f_one_b in zip(runs["gpipe"][1]["losses"], runs["1f1b"][1]["losses"]):
        assert gpipe == pytest.approx(one_f_one_b, rel=1e-5)
    assert len(runs["gpipe"][1]["losses"][0]) == CHUNKS

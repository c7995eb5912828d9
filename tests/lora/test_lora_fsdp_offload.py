"""FSDP-QLoRA with CPU offload: FSDP2's CPUOffloadPolicy over a LoRA / bitsandbytes 4-bit base on 2 real gloo ranks
(memfit's engine: `fully_shard(..., offload_policy=CPUOffloadPolicy())` per block and root, tests/lora_fsdp_worker.py)
against memfit's device / host split (memfit.estimate.static._offloaded, lora_sharded.frozen_kept_on_device_bytes).

On a CPU run "device" and "host" are one memory, so the split cannot be read off an allocator. What is measured:
- the host side by identity: each rank's parameter shards (frozen packed 4-bit shards, norms, fp32 adapter shards),
  the AdamW states and the fp32 gradient shards (the size of the adapter shards) must equal memfit's cpu_bytes to the
  byte, and the QuantState (an attribute FSDP never moves) is what memfit leaves of the base on the device;
- the compute side as the rest: the rank's peak over the last step (profiler events, memfit's PeakMeter; the states
  exist all through it) minus those host tensors lies within 2% of memfit's device peak (an interval: gloo frees some
  buffers unseen, and some gradient shards may not exist yet at the peak).
It does not prove the timing of FSDP2's host-to-device copies on a GPU (each shard's `.to(device)` in
FSDPParam.all_gather_inputs is a transient of the all-gather copy-in, freed before the unit computes): on CPU that
copy is a no-op.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_fsdp_worker import compute_side_interval, host_side_bytes
from tiny_configs import TINY_LLAMA
from torchrun_job import rank_results, run_ranks
# the 2-rank model, hardware, adapters and tolerance of the FSDP2 LoRA tests, shared
from test_lora_sharded import HARDWARE, LORA, QLORA, RANKS, SPEC, STEPS, WORKER
from test_lora_sharded import PEAK_TOLERANCE as TOLERANCE

from memfit.estimate.analytic import estimate
from memfit.setup import TrainingSetup

pytestmark = [pytest.mark.slow, pytest.mark.processes]

JOBS = {
    "lora-amp-bf16": dict(precision="amp-bf16", finetune=LORA),
    "qlora-amp-bf16": dict(precision="amp-bf16", finetune=QLORA),
    "qlora-amp-bf16-ckpt": dict(precision="amp-bf16", finetune=QLORA, checkpointing="full"),
    "qlora-fp32": dict(precision="fp32", finetune=QLORA),
}


def offloaded(**changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=2, seq_len=128, optimizer="adamw", engine="torch", num_gpus=RANKS,
                         sharding="zero3", offload="optimizer+params", **changes)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    setups = {name: {k: v for k, v in offloaded(**job).to_dict().items() if k != "notes"}
              for name, job in JOBS.items()}
    return run_ranks(WORKER, TINY_LLAMA, tmp_path_factory.mktemp("lora-fsdp-offload"), json.dumps(setups),
                     str(STEPS), ranks=RANKS, timeout=900)


@pytest.fixture(params=sorted(JOBS))
def job(request, jobs):
    return offloaded(**JOBS[request.param]), rank_results(jobs / request.param, RANKS)


def _term(predicted, name: str) -> int:
    return sum(t.num_bytes for t in predicted.terms if t.name == name)


def test_the_host_holds_exactly_the_shards_states_and_gradients_memfit_moves(job):
    setup, ranks = job
    predicted = estimate(SPEC, setup, HARDWARE)
    for rank in ranks:
        assert host_side_bytes(rank) == predicted.cpu_bytes
        assert rank["quant_state_bytes"] == _term(predicted, "parameters/frozen")  # 0 for a 16-bit base
        assert _term(predicted, "parameters") == _term(predicted, "optimizer/states") == 0
    assert (_term(predicted, "parameters/frozen") > 0) == (setup.finetune.method.value == "qlora")
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_the_rest_of_each_rank_peak_is_memfit_device_peak(job):
    setup, ranks = job
    device = estimate(SPEC, setup, HARDWARE).tensor_bytes
    for rank in ranks:
        low, high = compute_side_interval(rank)
        print(f"{setup.finetune.method} {setup.precision} ckpt {setup.checkpointing} rank {rank['rank']}: compute "
              f"side {low:,}..{high:,} B, memfit device {device:,} B")
        assert low * (1 - TOLERANCE) <= device <= high * (1 + TOLERANCE), (low, device, high)


def test_offload_moves_what_the_unoffloaded_step_keeps_on_the_device():
    """The same step without offload: memfit's device figure falls by exactly the adapter shards, the frozen shards
    but the QuantState, and the optimizer states; the gathered units and activations stay."""
    for job in JOBS.values():
        kept = estimate(SPEC, offloaded(**job).replace(offload="none"), HARDWARE)
        moved = estimate(SPEC, offloaded(**job), HARDWARE)
        shards = _term(kept, "parameters") + _term(kept, "parameters/frozen") - _term(moved, "parameters/frozen")
        assert moved.tensor_bytes == kept.tensor_bytes - shards - _term(kept, "optimizer/states")
        assert _term(moved, "parameters/gathered") == _term(kept, "parameters/gathered") > 0

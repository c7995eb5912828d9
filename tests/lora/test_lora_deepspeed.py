"""LoRA under DeepSpeed ZeRO-2 with the optimizer offloaded (ZeRO-Offload): only the adapters are in the optimizer,
so only their fp32 partitions, gradients and Adam states go to the host; the frozen base stays whole on each device.
Checked on a real 2-rank gloo DeepSpeed job (tests/lora_fsdp_worker.py runs whatever engine the setup names): the
whole job's peak (on CPU, device and host are one memory) against the formulas' device + host bytes, and the
collectives against memfit.estimate.comm (the adapters' gradients alone are reduced and gathered)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_configs import TINY_LLAMA
from torchrun_job import rank_results, run_ranks

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.estimate.comm import comm_volume
from memfit.estimate.lora import adapted_spec
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.zero_knobs import ZeroKnobs
from memfit.sources import resolve_model

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
SPEC = resolve_model(TINY_LLAMA)
HARDWARE = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=RANKS)
SETUP = TrainingSetup(micro_batch_size=2, seq_len=128, precision="fp32", optimizer="adamw", engine="deepspeed",
                      num_gpus=RANKS, sharding="zero2", offload="optimizer",
                      finetune=dict(method="lora", rank=8, alpha=16, targets=["all-linear"]))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    setups = {"offload": {k: v for k, v in SETUP.to_dict().items() if k != "notes"}}
    out = run_ranks(REPO / "tests" / "lora_fsdp_worker.py", TINY_LLAMA, tmp_path_factory.mktemp("lora-ds"),
                    json.dumps(setups), "2", ranks=RANKS, timeout=600)
    return rank_results(out / "offload", RANKS)


@pytest.mark.slow
@pytest.mark.processes
def test_offloaded_lora_peak_is_device_plus_host_bytes(ranks):
    predicted = estimate(SPEC, SETUP, HARDWARE)
    trained = adapted_spec(SPEC, SETUP).num_params
    assert predicted.term("parameters/frozen").num_bytes == adapted_spec(SPEC, SETUP).frozen_bytes  # whole
    assert predicted.cpu_bytes > 8 * trained // RANKS  # the adapters' Adam states (and master) on the host
    whole = predicted.tensor_bytes + predicted.cpu_bytes
    for rank in ranks:
        assert rank["optimizer_bytes"] == 8 * trained // RANKS  # exp_avg, exp_avg_sq of the rank's partition
        low, high = rank["peak_bytes"] - rank["unseen_at_peak_bytes"], rank["peak_bytes"]
        print(f"rank {rank['rank']}: measured {low:,}..{high:,} B, predicted {whole:,} B")
        assert low * 0.98 <= whole <= high * 1.02


@pytest.mark.slow
@pytest.mark.processes
def test_only_the_adapters_are_reduced_and_gathered(ranks):
    expected = comm_volume(SPEC, SETUP).payload_bytes()
    assert expected == {"all-reduce": 4 * adapted_spec(SPEC, SETUP).num_params,
                        "all-gather": 4 * adapted_spec(SPEC, SETUP).num_params}
    for rank in ranks:
        assert rank["comm_payload_bytes"][-1] == expected


def test_lora_offload_on_the_torch_engine_says_where_it_is_sized():
    """FSDP2 offloads the optimizer only with the parameters: both ways out are setups memfit sizes."""
    with pytest.raises(ConfigError, match=r"use --offload optimizer\+params --zero zero3, or --engine deepspeed"):
        SETUP.replace(engine="torch")
    assert SETUP.replace(engine="torch", offload="optimizer+params", sharding="zero3").offload.value != "none"


# ---- ZeRO-3 (frozen base partitioned, kept gathered into backward) and DeepSpeed's bf16 mode (16-bit adapters)

ZERO3 = {"zero2-bf16": SETUP.replace(offload="none", precision="amp-bf16"),
         "zero3-fp32": SETUP.replace(sharding="zero3", offload="none"),
         "zero3-bf16": SETUP.replace(sharding="zero3", offload="none", precision="amp-bf16"),
         # the user's own buffer sizes (memfit.zero_knobs): a 200k-element reduce bucket (hidden^2 is 4,096 here),
         # no persistent tensors, and a reuse distance of 0 (every module released after its forward)
         "zero3-fp32-knobs": SETUP.replace(sharding="zero3", offload="none", zero_knobs=ZeroKnobs(
             reduce_bucket_size=200_000, param_persistence_threshold=0, max_reuse_distance=0))}


@pytest.fixture(scope="module")
def zero3_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """One 2-rank job per setup: a ZeRO-3 job changes its process for the next one (zero.Init replaces
    torch.nn.functional.linear for good; a later job in the same process measured 2-3% higher). 3 steps: DeepSpeed
    records its module trace in step 1 and releases by reuse distance from step 2 on."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    out = {}
    for name, setup in ZERO3.items():
        fields = {name: {k: v for k, v in setup.to_dict().items() if k != "notes"}}
        folder = run_ranks(REPO / "tests" / "lora_fsdp_worker.py", TINY_LLAMA, tmp_path_factory.mktemp(name),
                           json.dumps(fields), "3", ranks=RANKS, timeout=600)
        out[name] = rank_results(folder / name, RANKS)
    return out


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("name", list(ZERO3))
def test_zero3_and_bf16_peaks_match_the_formulas(zero3_ranks, name):
    """ZeRO-2 within 2%. A ZeRO-3 rank's peak moves by up to 3% between runs of the very same job on gloo (the
    bf16 one here: 3,398,797 to 3,472,797 B on rank 0 over six runs; bench/results/lora_deepspeed.md), which the
    formulas do not model: ZeRO-3 is held to 5% per rank."""
    predicted = estimate(SPEC, ZERO3[name], HARDWARE).tensor_bytes
    tolerance = 0.05 if ZERO3[name].sharding.stage == 3 else 0.02
    for rank in zero3_ranks[name]:
        low, high = rank["peak_bytes"] - rank["unseen_at_peak_bytes"], rank["peak_bytes"]
        print(f"{name} rank {rank['rank']}: measured {low:,}..{high:,} B, predicted {predicted:,} B")
        assert low * (1 - tolerance) <= predicted <= high * (1 + tolerance)


def test_zero3_keeps_what_is_reused_in_backward_gathered():
    """The tiny model is far under stage3_max_reuse_distance: all of it stays gathered at the head's backward but
    the persistent tensors (whole anyway), the frozen embedding and block 0's q/k/v bases (no gradient reaches
    them); measured on 2 ranks: 120,128 elements AVAILABLE there, 11,584 of them persistent."""
    from memfit.estimate.deepspeed_zero3 import gathered_elems, persistence_threshold, persistent_elems

    spec = adapted_spec(SPEC, ZERO3["zero3-fp32"])
    threshold = persistence_threshold(spec, ZERO3["zero3-fp32"])
    assert persistent_elems(threshold, (*spec.params, *spec.frozen)) == 11_584
    assert gathered_elems(spec, ZERO3["zero3-fp32"]) == 120_128 - 11_584
    everything = spec.num_params + spec.num_frozen_params
    checkpointed = ZERO3["zero3-bf16"].replace(checkpointing="full")
    assert gathered_elems(spec, checkpointed) == everything - 11_584  # the recompute fetches them all (measured)

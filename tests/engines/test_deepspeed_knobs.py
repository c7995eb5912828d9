"""DeepSpeed's ZeRO knobs as the user's JSON sets them (memfit.zero_knobs, issue 21): the reader (each knob, "auto",
the ones that change no GPU bytes listed as ignored with the reason), the emitted config DeepSpeed parses back, the
formulas (bucket count and lifetime, ZeRO-3 on one rank) and real DeepSpeed ranks on CPU (gloo) against them. The
whole matrix, 1 and 2 ranks: bench/deepspeed_knobs.py (bench/results/deepspeed_knobs.md)."""

from __future__ import annotations

import json

import pytest

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.readers import read_config
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.zero_knobs import DEEPSPEED_DEFAULTS, ZeroKnobs
from tiny_configs import TINY_LLAMA

SPEC = resolve_model(TINY_LLAMA)
P = SPEC.num_params
H = TINY_LLAMA["hidden_size"]
CPU = make_hardware(cpu_device(64 * 1024**3))
BASE = TrainingSetup(micro_batch_size=2, seq_len=128, optimizer="adamw", engine="deepspeed", precision="fp32")


def _read(tmp_path, zero: dict):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return read_config(str(path), num_gpus=2)


# --- the reader ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,field,expected", [
    ("stage3_prefetch_bucket_size", 123_456, "prefetch_bucket_size", 123_456),
    ("stage3_prefetch_bucket_size", "auto", "prefetch_bucket_size", None),
    ("stage3_max_live_parameters", 3e8, "max_live_parameters", 300_000_000),
    ("sub_group_size", 1e7, "sub_group_size", 10_000_000),
    ("reduce_bucket_size", "auto", "reduce_bucket_size", None),
    ("contiguous_gradients", False, "contiguous_gradients", False),
    ("overlap_comm", False, "overlap_comm", False),
])
def test_zero3_knobs_are_read_with_auto_as_the_hf_trainer_fills_it(tmp_path, key, value, field, expected):
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", key: value}
    reading = _read(tmp_path, zero)
    knobs = reading.overrides.get("zero_knobs", ZeroKnobs())
    assert getattr(knobs, field) == expected
    # "auto" gives the HF Trainer's number from the model: 0.9 x hidden^2 prefetch, hidden^2 bucket
    assert knobs.prefetch_elems(H) == (int(0.9 * H * H) if knobs.prefetch_bucket_size is None else
                                       knobs.prefetch_bucket_size)


def test_a_left_out_knob_takes_deepspeeds_default_and_the_rest_of_stage2_is_read(tmp_path):
    knobs = _read(tmp_path, {"stage": 3}).overrides["zero_knobs"]
    assert knobs.prefetch_bucket_size == DEEPSPEED_DEFAULTS.prefetch_bucket_size == 50_000_000
    assert knobs.reduce_bucket_size == 500_000_000 and knobs.max_live_parameters == 1_000_000_000
    knobs = _read(tmp_path, {"stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True,
                             "contiguous_gradients": True}).overrides["zero_knobs"]
    assert (knobs.reduce_bucket_size, knobs.overlap_comm, knobs.prefetch_bucket_size) == (200_000_000, True, None)
    assert knobs.reduce_buckets(2) == 2  # setup_buckets' double buffer


@pytest.mark.parametrize("key,value,stage,why", [
    ("allgather_bucket_size", 2e8, 2, "all_gather_into_tensor"),
    ("round_robin_gradients", True, 2, "same sizes"),
    ("stage3_gather_16bit_weights_on_model_save", True, 3, "save time only"),
    ("overlap_comm", True, 3, "one ipg bucket either way"),
    ("sub_group_size", 1e6, 2, "below ZeRO-3"),
    ("stage3_max_live_parameters", 1e6, 2, "nothing below stage 3"),
])
def test_a_knob_that_changes_no_gpu_bytes_is_listed_as_ignored_with_the_reason(tmp_path, key, value, stage, why):
    reading = _read(tmp_path, {"stage": stage, key: value})
    (entry,) = [e for e in reading.ignored if e.field == f"zero_optimization.{key}"]
    assert why in entry.why
    if key in ("allgather_bucket_size", "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save"):
        # still carried, so the emitted config writes back what the user asked for
        from memfit.emit import deepspeed_config

        setup = BASE.replace(sharding=f"zero{stage}", num_gpus=2, zero_knobs=reading.overrides["zero_knobs"])
        assert deepspeed_config(setup)["zero_optimization"][key] == value


def test_offload_pin_memory_is_host_ram_only(tmp_path):
    reading = _read(tmp_path, {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                               "offload_param": {"device": "cpu", "pin_memory": True}})
    assert reading.overrides["zero_knobs"].offload_pin_memory is False
    (entry,) = [e for e in reading.ignored if e.field == "zero_optimization.offload_optimizer.pin_memory"]
    assert "host RAM only" in entry.why
    setup = TrainingSetup(sharding="zero3", offload="optimizer+params", num_gpus=2, engine="deepspeed")
    pinned = estimate(SPEC, setup, CPU)
    unpinned = estimate(SPEC, setup.replace(zero_knobs=ZeroKnobs(offload_pin_memory=False)), CPU)
    assert (pinned.tensor_bytes, pinned.cpu_bytes) == (unpinned.tensor_bytes, unpinned.cpu_bytes)


@pytest.mark.parametrize("zero", [{"stage": 2, "overlap_comm": "yes"}, {"stage": 3, "sub_group_size": "auto"},
                                  {"stage": 3, "stage3_max_live_parameters": -5}])
def test_a_bad_knob_is_one_clear_line(tmp_path, zero):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    with pytest.raises(ConfigError, match="zero_optimization"):
        read_config(str(path), num_gpus=2)


# --- the emitted config -------------------------------------------------------------------------------------------

def test_deepspeed_parses_the_knobs_memfit_writes_back(monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    from memfit.emit import deepspeed_config

    monkeypatch.setattr(ds_comm, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(ds_comm, "get_world_size", lambda *args, **kwargs: 2)
    knobs = ZeroKnobs(prefetch_bucket_size=12_345, max_live_parameters=67_890, sub_group_size=4_096,
                      overlap_comm=False, contiguous_gradients=False, max_reuse_distance=0)
    parsed = DeepSpeedConfig(deepspeed_config(BASE.replace(sharding="zero3", num_gpus=2, zero_knobs=knobs)),
                             mpu=None).zero_config
    assert (parsed.prefetch_bucket_size, parsed.max_live_parameters, parsed.sub_group_size, parsed.overlap_comm,
            parsed.contiguous_gradients, parsed.max_reuse_distance) == (12_345, 67_890, 4_096, False, False, 0)


# --- the formulas -------------------------------------------------------------------------------------------------

def test_zero_on_one_gpu_without_offload_runs_on_deepspeed_only():
    one = BASE.replace(sharding="zero2", num_gpus=1)
    assert one.sharding.stage == 2
    with pytest.raises(ConfigError, match="--engine deepspeed"):
        one.replace(engine="torch")
    # world size 1: the fp32 partition copy (4 B / param even for fp32 weights) is whole
    full = estimate(SPEC, BASE.replace(sharding="zero3", num_gpus=1), CPU)
    assert full.term("parameters").num_bytes == 4 * P  # the partition is the parameter: nothing more persists
    assert "parameters/gathered" not in {t.name for t in full.terms}  # gathering points at the partition


def test_zero2_buckets_follow_the_knobs_and_live_only_while_gradients_are_made():
    bucket = 1_000_000
    setup = BASE.replace(sharding="zero2", num_gpus=2, zero_knobs=ZeroKnobs(reduce_bucket_size=bucket))
    est = estimate(SPEC, setup, make_hardware(cpu_device(64 * 1024**3), gpus_per_node=2))
    assert est.term("gradients/comm_buffers").num_bytes == 4 * bucket
    doubled = estimate(SPEC, setup.replace(zero_knobs=ZeroKnobs(reduce_bucket_size=bucket, overlap_comm=True)),
                       make_hardware(cpu_device(64 * 1024**3), gpus_per_node=2))
    assert doubled.term("gradients/comm_buffers").num_bytes == 8 * bucket
    none = estimate(SPEC, setup.replace(zero_knobs=ZeroKnobs(reduce_bucket_size=bucket, contiguous_gradients=False)),
                    make_hardware(cpu_device(64 * 1024**3), gpus_per_node=2))
    assert "gradients/comm_buffers" not in {t.name for t in none.terms}
    # the default bucket (hidden^2) is not alive at the loss's backward, where the tiny model peaks
    default = estimate(SPEC, setup.replace(zero_knobs=ZeroKnobs()), make_hardware(cpu_device(64 * 1024**3),
                                                                                  gpus_per_node=2))
    assert "gradients/comm_buffers" not in {t.name for t in default.terms}


# --- real DeepSpeed ranks -----------------------------------------------------------------------------------------

MEASURED = {"zero2-default": BASE.replace(sharding="zero2", num_gpus=1),
            "zero2-bucket-overlap": BASE.replace(sharding="zero2", num_gpus=1, zero_knobs=ZeroKnobs(
                reduce_bucket_size=500_000, overlap_comm=True)),
            "zero2-no-contiguous": BASE.replace(sharding="zero2", num_gpus=1, zero_knobs=ZeroKnobs(
                reduce_bucket_size=500_000, contiguous_gradients=False))}


@pytest.mark.slow
@pytest.mark.processes
def test_one_rank_zero2_peaks_equal_the_formulas(tmp_path):
    pytest.importorskip("deepspeed")
    from torchrun_job import REPO, rank_results, run_ranks

    fields = {name: {k: v for k, v in s.to_dict().items() if k != "notes"} for name, s in MEASURED.items()}
    out = run_ranks(REPO / "tests" / "lora_fsdp_worker.py", TINY_LLAMA, tmp_path, json.dumps(fields), "3", ranks=1,
                    timeout=600)
    for name, setup in MEASURED.items():
        (rank,) = rank_results(out / name, ranks=1)
        predicted = estimate(SPEC, setup, CPU).tensor_bytes
        low, high = rank["peak_bytes"] - rank["unseen_at_peak_bytes"], rank["peak_bytes"]
        print(f"{name}: measured {low:,}..{high:,} B, memfit {predicted:,} B")
        assert low * 0.98 <= predicted <= high * 1.02, (name, low, high, predicted)


def test_zero3_steps_one_sub_group_at_a_time():
    """stage3.py _create_fp16_sub_groups closes a sub-group once it reaches sub_group_size: on the tiny Llama the
    largest is the last one, the final norm (64) and the 32,768-element LM head; the step holds its fp32 flat
    gradient and AdamW's two temporaries (12 B per element; measured on 1 CPU rank in
    bench/results/deepspeed_knobs.md, b1s8 rows)."""
    from memfit.estimate.deepspeed_zero3 import largest_sub_group

    setup = BASE.replace(sharding="zero3", num_gpus=1, micro_batch_size=1, seq_len=8)
    small = setup.replace(zero_knobs=ZeroKnobs(sub_group_size=8192))
    assert largest_sub_group(SPEC, setup) == P  # 1e9 by default: the whole partition
    last = H + TINY_LLAMA["vocab_size"] * H
    assert largest_sub_group(SPEC, small) == last == 32_832
    whole, sub = estimate(SPEC, setup, CPU), estimate(SPEC, small, CPU)
    assert whole.term("temporaries/optimizer_step").num_bytes == 12 * P
    assert sub.term("temporaries/optimizer_step").num_bytes == 12 * last
    assert whole.tensor_bytes - sub.tensor_bytes == 12 * (P - last)

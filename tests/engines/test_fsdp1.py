"""FSDP1 (FullyShardedDataParallel, flat parameters; memfit.estimate.fsdp1) against real 2-rank gloo steps of the
tiny Llama on CPU (tests/fsdp1_worker.py, wrapped by memfit._torch.fsdp1.wrap as accelerate / Lightning wrap it):
each rank's flat shards, the optimizer states and the peak within 2%; the frozen base's gradient shard of a
Lightning-style LoRA block; the setup's refusals. The full matrix is bench/fsdp1.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_configs import TINY_LLAMA
from torchrun_job import rank_results, run_ranks

from memfit.errors import ConfigError
from memfit.estimate import fsdp1
from memfit.estimate.analytic import estimate
from memfit.estimate.lora import adapted_spec
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "fsdp1_worker.py"
RANKS, STEPS = 2, 2
SPEC = resolve_model(TINY_LLAMA)
HARDWARE = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=RANKS)
LORA = {"method": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]}
JOBS = {  # full fine-tune with checkpointing (fp32, ZeRO-3); peft's units (HF Trainer) and Lightning's mixed blocks
    "full-zero3-fp32-ckpt": dict(sharding="zero3", precision="fp32", checkpointing="full", fsdp_version="1"),
    "lora-v1-zero2-amp-bf16": dict(sharding="zero2", precision="amp-bf16", fsdp_version="1", finetune=LORA),
    "lora-blocks-zero3-amp-bf16": dict(sharding="zero3", precision="amp-bf16", fsdp_version="1-blocks",
                                       finetune=LORA),
}


def _setup(**fields) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=2, seq_len=128, optimizer="adamw", engine="torch", num_gpus=RANKS, **fields)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    setups = {name: {k: v for k, v in _setup(**job).to_dict().items() if k != "notes"} for name, job in JOBS.items()}
    return run_ranks(WORKER, TINY_LLAMA, tmp_path_factory.mktemp("fsdp1"), json.dumps(setups), str(STEPS),
                     ranks=RANKS, timeout=600)


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(JOBS))
def test_fsdp1_per_rank_memory_matches_the_formulas(jobs, name):
    setup = _setup(**JOBS[name])
    ranks = rank_results(jobs / name, RANKS)
    sized = setup.replace(precision="bf16-master") if setup.precision.is_autocast else setup  # as analytic runs it
    units = fsdp1.units(adapted_spec(SPEC, setup), sized)
    flat = sorted((u.shard(RANKS), u.trainable > 0) for u in units for _ in range(u.count))
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert sorted((f["numel"], f["trainable"]) for f in rank["flat"]) == flat  # one flat shard per unit
        assert sum(f["bytes"] for f in rank["flat"]) == sum(
            u.count * u.shard(RANKS) * u.storage_bytes for u in units)
    predicted = estimate(SPEC, setup, HARDWARE)
    for rank in ranks:
        low, high = rank["peak_bytes"] - rank["unseen_at_peak_bytes"], rank["peak_bytes"]
        error = 0.0 if low <= predicted.tensor_bytes <= high else (predicted.tensor_bytes - high) / high
        assert abs(error) <= 0.02, (name, predicted.tensor_bytes, low, high)
    # AdamW over the original parameters' views (use_orig_params=True): the ranks' states add up to the adapters'
    states = sum(rank["optimizer_bytes"] for rank in ranks)
    trained = adapted_spec(SPEC, setup)
    assert states == 2 * 4 * trained.num_params


def test_mixed_blocks_keep_a_gradient_shard_of_the_frozen_base():
    """Lightning / LitGPT (1-blocks): the block's flat parameter requires grad, so its gradient shard covers the
    frozen base; peft's units (1) keep only the adapters' gradients. FSDP2 sized the adapters' alone."""
    mixed = _setup(sharding="zero3", precision="amp-bf16", fsdp_version="1-blocks", finetune=LORA)
    own = mixed.replace(fsdp_version="1")
    spec = adapted_spec(SPEC, mixed)
    block = sum(t.numel for t in (*spec.params, *spec.frozen) if ".*." in t.name)
    flat = [u for u in fsdp1.units(spec, mixed.replace(precision="bf16-master")) if u.in_block]
    assert len(flat) == 1 and flat[0].numel == block and flat[0].requires_grad
    own_units = fsdp1.units(spec, own.replace(precision="bf16-master"))
    assert not next(u for u in own_units if u.name == "block").requires_grad
    assert sum(u.count * u.trainable for u in own_units) == spec.num_params
    layout = estimate(SPEC, mixed, HARDWARE)
    assert layout.tensor_bytes > estimate(SPEC, own, HARDWARE).tensor_bytes > estimate(
        SPEC, mixed.replace(fsdp_version="2"), HARDWARE).tensor_bytes


@pytest.mark.parametrize("fields,words", [
    (dict(engine="deepspeed"), "needs --engine torch"),
    (dict(sharding="zero1"), "no ZeRO-1"),
    (dict(finetune=dict(LORA, method="qlora")), "not QLoRA"),
    (dict(offload="optimizer"), "CPUOffload"),
])
def test_fsdp1_refuses_what_it_does_not_size(fields, words):
    base = dict(micro_batch_size=2, seq_len=128, engine="torch", num_gpus=2, sharding="zero3", fsdp_version="1")
    with pytest.raises(ConfigError, match=words):
        TrainingSetup(**{**base, **fields})


@pytest.mark.parametrize("finetune", [{}, LORA])
def test_cpu_offload_keeps_the_gradient_shards_on_the_device_through_backward(finetune):
    """CPUOffload(offload_params=True) (read off torch 2.13: `_offload_grad` copies each shard to `_cpu_grad`, the
    device's `_saved_grad_shard` lives to the end of backward): the host holds the flat shards, a gradient copy and
    AdamW's states; the device no shard at rest but every gradient shard late in backward. LoRA is sized too."""
    setup = _setup(sharding="zero3", precision="amp-bf16", fsdp_version="1", offload="optimizer+params",
                   finetune=finetune or "full")
    sized = setup.replace(precision="bf16-master")
    spec = adapted_spec(SPEC, setup)
    units = fsdp1.units(spec, sized)
    shards = sum(u.count * u.shard(RANKS) * u.storage_bytes for u in units)
    grads = sum(u.count * u.shard(RANKS) * u.storage_bytes for u in units if u.requires_grad)
    result = estimate(SPEC, setup, HARDWARE)
    assert result.cpu_bytes == shards + grads + 2 * 4 * spec.num_params // RANKS + 4 * sum(p.count for p in spec.params)
    assert "parameters" not in {t.name for t in result.terms}  # no shard at rest on the device

"""LoRA / QLoRA under FSDP2 (memfit.estimate.lora_sharded): the formulas against real 2-rank gloo FSDP2 steps of a
tiny peft LoRA Llama on CPU (each parameter's local shard, the optimizer states, the peak within 2% per rank), the
FSDP-QLoRA shard against bitsandbytes' own Params4bit(quant_storage=bf16), the emitters and readers, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_truth import real_4bit_bytes
from tiny_configs import TINY_LLAMA
from torchrun_job import rank_results, run_ranks

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.estimate.lora import adapted_spec
from memfit.estimate.lora_sharded import frozen_shard_bytes
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "lora_fsdp_worker.py"
RANKS, STEPS = 2, 2
SPEC = resolve_model(TINY_LLAMA)
HARDWARE = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=RANKS)
PEAK_TOLERANCE = 0.02
LORA = {"method": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]}
QLORA = dict(LORA, method="qlora")
JOBS = {  # ZeRO-3 in fp32 (the frozen base fp32), ZeRO-2 under amp-bf16 (a bf16 base, fp32 adapters, bf16 compute),
    # FSDP-QLoRA (NF4 + double quantization, bf16 quant_storage) at ZeRO-3
    "zero3-fp32": dict(sharding="zero3", precision="fp32"),
    "zero2-amp-bf16": dict(sharding="zero2", precision="amp-bf16"),
    "qlora-zero3-fp32": dict(sharding="zero3", precision="fp32", finetune=QLORA),
    # FSDP2 mixed precision all-gathers the fp32 norms in bf16: a bf16 residual stream over the 4-bit base
    "qlora-zero3-amp-bf16": dict(sharding="zero3", precision="amp-bf16", finetune=QLORA),
    # DoRA: FSDP2 gathers each block's weights, so the weight norm is the unsharded one; the magnitudes shard
    "dora-zero3-amp-bf16": dict(sharding="zero3", precision="amp-bf16", finetune=dict(LORA, dora=True)),
}


def _setup(sharding: str, precision: str, **changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=2, seq_len=128, precision=precision, optimizer="adamw", engine="torch",
                         num_gpus=RANKS, sharding=sharding, finetune=dict(LORA)).replace(**changes)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    """Every JOBS setup, one after the other in one 2-rank torchrun (one start-up for all)."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    setups = {name: {k: v for k, v in _setup(**job).to_dict().items() if k != "notes"} for name, job in JOBS.items()}
    return run_ranks(WORKER, TINY_LLAMA, tmp_path_factory.mktemp("lora-fsdp"), json.dumps(setups), str(STEPS),
                     ranks=RANKS, timeout=600)


@pytest.fixture(params=sorted(JOBS))
def job(request, jobs) -> tuple[TrainingSetup, list[dict]]:
    return _setup(**JOBS[request.param]), rank_results(jobs / request.param, RANKS)


@pytest.mark.slow
@pytest.mark.processes
def test_each_rank_holds_the_frozen_base_and_adapter_shards_the_formulas_give(job):
    """Each parameter's local shard, by storage; a 4-bit base's QuantState (not a parameter) whole on each rank."""
    setup, ranks = job
    predicted = estimate(SPEC, setup, HARDWARE)
    spec = adapted_spec(SPEC, setup)
    for rank in ranks:
        frozen = sum(p["bytes"] for p in rank["local"].values() if not p["trainable"]) + rank["quant_state_bytes"]
        trainable = sum(p["bytes"] for p in rank["local"].values() if p["trainable"])
        assert frozen == predicted.term("parameters/frozen").num_bytes == frozen_shard_bytes(spec, setup, RANKS)
        if setup.finetune.method.value == "lora":
            assert frozen == spec.frozen_bytes // RANKS and rank["quant_state_bytes"] == 0
        else:  # the QuantStates are replicated: more than half of the unsharded bytes
            assert spec.frozen_bytes // RANKS < frozen < spec.frozen_bytes // RANKS + rank["quant_state_bytes"]
        assert trainable == predicted.term("parameters").num_bytes == 4 * spec.num_params // RANKS
        assert all(p["trainable"] == ("lora_" in name) for name, p in rank["local"].items())
        assert rank["optimizer_bytes"] == 2 * trainable  # exp_avg and exp_avg_sq of the fp32 adapter shards
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.slow
@pytest.mark.processes
def test_two_gloo_ranks_peak_within_two_percent_of_the_formulas(job):
    """As in tests/estimate/test_tensor_parallel.py: gloo's worker threads free some buffers where the profiler cannot see,
    so the meter gives an interval [peak - unseen, peak] and the formulas must be within 2% of it on every rank."""
    setup, ranks = job
    predicted = estimate(SPEC, setup, HARDWARE).tensor_bytes
    for rank in ranks:
        high, unseen = rank["peak_bytes"], rank["unseen_at_peak_bytes"]
        low = high - unseen
        print(f"{setup.sharding} {setup.precision} rank {rank['rank']}: measured {low:,}..{high:,} B, predicted "
              f"{predicted:,} B ({low / predicted - 1:+.2%}..{high / predicted - 1:+.2%})")
        assert low <= predicted * (1 + PEAK_TOLERANCE), (low, predicted)
        assert high >= predicted * (1 - PEAK_TOLERANCE), (high, predicted)


@pytest.mark.slow
@pytest.mark.processes
def test_only_the_adapters_gradients_are_reduce_scattered(job):
    """The collectives each rank issued (memfit._torch.comm_count) against memfit.estimate.comm: the frozen base is
    all-gathered with the adapters, but only the adapters' gradients are reduce-scattered. (A 4-bit base's gather
    is counted as its elements, an over-count: its bf16-packed storage is a quarter of that.)"""
    from memfit.estimate.comm import comm_volume

    setup, ranks = job
    predicted = comm_volume(SPEC, setup).payload_bytes()
    trained = adapted_spec(SPEC, setup).num_params
    assert predicted["reduce-scatter"] == trained * 4  # reduce_dtype fp32
    for rank in ranks:
        for step in rank["comm_payload_bytes"]:
            assert step["reduce-scatter"] == predicted["reduce-scatter"]
            if setup.finetune.method.value == "lora":
                assert step["all-gather"] == predicted["all-gather"]


def test_fsdp2_shards_the_frozen_base_where_ddp_replicates_it():
    ddp = estimate(SPEC, _setup("none", "fp32"), HARDWARE)
    for sharding in ("zero2", "zero3"):
        fsdp = estimate(SPEC, _setup(sharding, "fp32"), HARDWARE)
        assert fsdp.term("parameters/frozen").num_bytes == ddp.term("parameters/frozen").num_bytes // RANKS
        # gathered: every tensor of the root and one block (zero3) or all blocks (zero2), frozen ones included
    spec = adapted_spec(SPEC, _setup("zero3", "fp32"))
    per_layer = sum(t.numel for t in (*spec.params, *spec.frozen) if ".*." in t.name)
    root = sum(t.total for t in (*spec.params, *spec.frozen) if ".*." not in t.name)
    zero3 = estimate(SPEC, _setup("zero3", "fp32"), HARDWARE).term("parameters/gathered").num_bytes
    zero2 = estimate(SPEC, _setup("zero2", "fp32"), HARDWARE).term("parameters/gathered").num_bytes
    assert zero3 == 4 * (root + per_layer) and zero2 == 4 * (root + SPEC.num_layers * per_layer)


@pytest.mark.parametrize("double_quant", [True, False])
def test_fsdp_qlora_shard_is_bitsandbytes_bf16_storage_split_over_the_ranks(double_quant):
    """FSDP-QLoRA: bnb_4bit_quant_storage=bf16 makes the packed weight a bf16 Params4bit of numel / 4 elements;
    FSDP2 shards its dim 0 (torch.chunk over the ranks); its QuantState stays whole on each rank."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    setup = _setup("zero3", "fp32", finetune=dict(QLORA, double_quant=double_quant))
    spec = adapted_spec(SPEC, setup)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 64),
              "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
    real = 0
    for t in spec.frozen:
        name = next((n for n in shapes if f".{n}." in t.name), None)
        if name is None:  # unquantized: embeddings, head, norms (fp32 after prepare_model_for_kbit_training)
            real += t.count * 4 * t.numel // RANKS
            continue
        parts = real_4bit_bytes(*shapes[name], double_quant=double_quant, quant_storage=torch.bfloat16)
        assert parts["weight_dtype"] == "bfloat16" and parts["weight_shape"] == [t.numel // 4, 1]
        rows = torch.empty(parts["weight_shape"], dtype=torch.bfloat16).chunk(RANKS, dim=0)[0]
        assert parts["total"] == t.nbytes  # the unsharded bytes are the same as uint8 storage's
        real += t.count * (rows.numel() * 2 + parts["total"] - parts["packed_weight"])
    assert frozen_shard_bytes(spec, setup, RANKS) == real
    assert estimate(SPEC, setup, HARDWARE).term("parameters/frozen").num_bytes == real


def test_emitted_configs_say_what_was_sized():
    from memfit.emit.accelerate import accelerate_file
    from memfit.emit.peft import bnb_config_kwargs

    qlora = _setup("zero3", "fp32", finetune=QLORA)
    assert bnb_config_kwargs(qlora)["bnb_4bit_quant_storage"] == "bfloat16"
    assert "bnb_4bit_quant_storage" not in bnb_config_kwargs(qlora.replace(sharding="none", num_gpus=1))
    fsdp = accelerate_file(qlora, HARDWARE, backend="fsdp").content["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and "fsdp_use_orig_params" not in fsdp  # obsolete in FSDP2 (accelerate)
    from transformers import BitsAndBytesConfig

    assert str(BitsAndBytesConfig(**bnb_config_kwargs(qlora)).bnb_4bit_quant_storage) == "torch.bfloat16"
    lora = _setup("zero3", "amp-bf16")
    comment = accelerate_file(lora, HARDWARE, backend="fsdp").comments["fsdp_config.fsdp_version"]
    assert "only the adapters' gradients" in comment


def test_axolotl_fsdp_qlora_reads_as_the_sharded_setup(tmp_path, monkeypatch):
    from memfit.readers import read_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "qlora_fsdp.yaml").write_text(
        "base_model: m\nadapter: qlora\nload_in_4bit: true\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n"
        "micro_batch_size: 2\nsequence_len: 128\nfsdp:\n  - full_shard\n  - auto_wrap\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n")
    overrides = read_config("qlora_fsdp.yaml", num_gpus=RANKS).overrides
    assert str(overrides["sharding"]) == "zero3" and str(overrides["engine"]) == "torch"
    setup = TrainingSetup(**{**overrides, "precision": "fp32", "num_gpus": RANKS})
    assert setup.finetune.method.value == "qlora"
    assert estimate(SPEC, setup, HARDWARE).term("parameters/frozen").num_bytes == frozen_shard_bytes(
        adapted_spec(SPEC, setup), setup, RANKS)


def test_what_is_not_sized_is_refused_with_the_way_out():
    with pytest.raises(ConfigError, match="--engine torch"):
        _setup("zero3", "amp-bf16", engine="deepspeed", finetune=QLORA)  # LoRA there: tests/lora/test_lora_deepspeed.py
    with pytest.raises(ConfigError, match="a quantized base has no master weights"):
        _setup("none", "bf16-master", finetune=QLORA, num_gpus=1)


def test_qlora_under_fsdp2_mixed_precision_plans():
    """What was refused: QLoRA at ZeRO-3 under amp-bf16 (FSDP2 MixedPrecisionPolicy) sizes and plans."""
    from memfit.plan import plan

    setup = _setup("zero3", "amp-bf16", finetune=QLORA)
    assert estimate(SPEC, setup, HARDWARE).tensor_bytes > 0
    assert plan(SPEC, setup, HARDWARE).final_setup.finetune.method.value == "qlora"

"""Each rung on its own: what it proposes, what it leaves alone, and why it passes."""

from __future__ import annotations

import pytest

from memfit.diagnose import Bottleneck, diagnose
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import make_hardware
from memfit.setup import FieldChange, TrainingSetup, parse_keep, setup_changes
from memfit.sources import resolve_model
from memfit.techniques import REGISTRY, Context, Proposal, Skip


def context(model: str, setup: TrainingSetup, gpu: str, gpus: int = 1, **kwargs) -> Context:
    spec, hw = resolve_model(model), make_hardware(gpu, gpus_per_node=gpus)
    est = estimate(spec, setup, hw)
    return Context(spec, hw, setup, est, diagnose(est, hw), 0.05, **kwargs)


def test_setup_changes_lists_every_field_in_order():
    a = TrainingSetup()
    b = a.replace(precision="bf16", micro_batch_size=2, grad_accum_steps=4, notes=("ignored",))
    assert [c.text for c in setup_changes(a, b)] == ["micro-batch 8 -> 2", "accum 1 -> 4", "precision amp-bf16 -> bf16"]
    assert setup_changes(a, a.replace(notes=("x",))) == ()


def test_parse_keep_maps_names_and_rejects_unknown_ones():
    assert parse_keep("precision, batch,seq,gpus,zero") == {"precision", "micro_batch_size", "seq_len", "num_gpus",
                                                            "sharding"}
    assert parse_keep(None) == frozenset()
    with pytest.raises(ConfigError, match="cannot keep 'speed': choose from precision, optimizer"):
        parse_keep("precision,speed")


def test_zero_prefers_a_stage_the_users_engine_can_run():
    setup = TrainingSetup(precision="bf16-master", optimizer="adamw-fused", engine="torch", num_gpus=4,
                          checkpointing="full")
    free = REGISTRY["zero"].propose(context("llama-3.1-8b", setup, "H100", 4))
    assert isinstance(free, Proposal) and free.setup.engine.value == "deepspeed"  # ZeRO-1 needs DeepSpeed here
    asked = REGISTRY["zero"].propose(context("llama-3.1-8b", setup, "H100", 4, explicit=frozenset({"engine"})))
    assert isinstance(asked, Proposal)
    assert asked.setup.engine.value == "torch" and asked.setup.sharding.value in ("zero2", "zero3")


def test_a_rung_whose_every_candidate_changes_a_pin_is_skipped_naming_it():
    setup = TrainingSetup(micro_batch_size=8)
    ctx = context("llama-3.1-8b", setup, "H100", keep=frozenset({"grad_accum_steps"}))
    result = REGISTRY["micro_batch"].propose(ctx)
    assert isinstance(result, Skip) and result.reason.endswith("which --keep accum pins")


def test_zero_on_one_gpu_says_so():
    result = REGISTRY["zero"].propose(context("llama-3.1-8b", TrainingSetup(), "H100"))
    assert isinstance(result, Skip) and result.reason == "ZeRO shards over GPUs and this setup has 1"


@pytest.mark.parametrize("gpu", ["T4", "V100-16GB", "V100-32GB"])
@pytest.mark.parametrize("start", ["fp32", "amp-fp16"])
@pytest.mark.parametrize("model,batch", [("llama-3.1-8b", 8), ("gpt2", 64), ("gpt2", 1)])
def test_mixed_precision_never_proposes_bf16_without_bf16(gpu, start, model, batch):
    ctx = context(model, TrainingSetup(precision=start, micro_batch_size=batch, seq_len=1024), gpu)
    result = REGISTRY["mixed_precision"].propose(ctx)
    if start == "fp32":
        assert isinstance(result, Proposal) and result.setup.precision.value == "amp-fp16"
        assert "fp16=True" in result.change
    else:
        assert isinstance(result, Skip) and "has no bf16" in result.reason


def test_offload_explains_why_it_turns_8bit_and_pure_bf16_back():
    setup = TrainingSetup(precision="bf16", optimizer="adamw-8bit", checkpointing="full", micro_batch_size=1)
    ctx = context("llama-3.1-8b", setup, "RTX-4090")
    assert ctx.diagnosis.bottleneck is not Bottleneck.FITS
    result = REGISTRY["cpu_offload"].propose(ctx)
    assert isinstance(result, Proposal)
    assert (result.setup.optimizer.value, result.setup.precision.value) == ("adamw", "bf16-master")
    assert "takes neither 8-bit states nor pure bf16 weights" in result.why
    plain = REGISTRY["cpu_offload"].propose(context("llama-3.1-8b", setup.replace(precision="bf16-master",
                                                                                  optimizer="adamw"), "RTX-4090"))
    assert isinstance(plain, Proposal) and "takes neither" not in plain.why


def test_field_change_text():
    assert FieldChange("num_gpus", 1, 8).text == "gpus 1 -> 8"

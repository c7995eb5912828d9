"""Selective activation checkpointing (selective-op, every-N, attention): the formulas against real measured CPU
steps, the fake-tensor trace against the same real step, the ladder's choice, and the emitted FSDP2 code run on a
tiny model. CPU only, offline.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit import ConfigError, TrainingSetup  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import Checkpointing  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.measure import measure  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))
MODES = ("selective-op", "every-2", "attention")
VARIANTS = {"fp32-sdpa": {}, "amp-sdpa": {"precision": "amp-bf16"}, "fp32-eager": {"attention": "eager"},
            "amp-eager": {"attention": "eager", "precision": "amp-bf16"}}
# Where the block-backward moment sets the peak, the variants inherit the error the full-checkpointing model has
# there (bench/results/selective_checkpointing.md lists both); everywhere else they are within 1%. Selective-op with
# eager attention is 0.8-2.4% high in that moment, and each checkpointed block's CPU RNG state (5,056 B, stashed by
# torch.utils.checkpoint's preserve_rng_state and now counted) adds 0.1-0.25% on these tiny models: within 3%.
LOOSE = {("llama", "every-2", "fp32-eager"), ("llama", "every-2", "amp-eager"), ("llama", "selective-op", "amp-eager"),
         ("llama", "selective-op", "fp32-eager"),
         ("qwen2", "every-2", "fp32-eager"), ("qwen2", "every-2", "amp-eager"),
         ("qwen2", "selective-op", "amp-eager")} | {("gpt2", m, v) for m in ("selective-op", "every-2")
                                                     for v in VARIANTS}


def setup_of(**changes) -> TrainingSetup:
    return TrainingSetup(**{"micro_batch_size": 2, "seq_len": 128, "precision": "fp32", "optimizer": "adamw",
                            **changes})


CASES = [("llama", mode, variant) for mode in MODES for variant in VARIANTS] + [
    (family, mode, variant) for family in ("qwen2", "gpt2") for mode in MODES for variant in ("fp32-sdpa", "amp-eager")]


@pytest.mark.parametrize("family,mode,variant", CASES, ids=["-".join(c) for c in CASES])
def test_formulas_match_the_measured_step(family, mode, variant):
    setup = setup_of(checkpointing=mode, **VARIANTS[variant])
    measured = measure(copy.deepcopy(TINY_CONFIGS[family]), setup, steps=2)
    predicted = estimate(resolve_model(TINY_CONFIGS[family]), setup, CPU)
    error = (predicted.tensor_bytes - measured.tensor_bytes) / measured.tensor_bytes
    tolerance = (0.03 if mode == "selective-op" and "eager" in variant else 0.025) if (family, mode, variant) in LOOSE \
        else 0.01
    assert abs(error) < tolerance, (predicted.tensor_bytes, measured.tensor_bytes)


@pytest.mark.parametrize("changes", [dict(checkpointing="selective-op"), dict(checkpointing="every-2"),
                                     dict(checkpointing="attention", attention="eager"),
                                     dict(checkpointing="selective-op", precision="amp-bf16")],
                         ids=["selective-op", "every-2", "attention-eager", "selective-op-amp"])
def test_trace_equals_the_measured_step(changes):
    from memfit.trace import trace
    from memfit.trace.session import build_hf_session
    from test_trace import measured_peak

    setup = setup_of(**changes)
    traced = trace(copy.deepcopy(TINY_CONFIGS["llama"]), setup, kernels="cpu")
    torch.manual_seed(0)
    real = measured_peak(build_hf_session(copy.deepcopy(TINY_CONFIGS["llama"]), setup))
    assert abs(traced.tensor_bytes - real) <= 0.005 * real, (traced.tensor_bytes, real)


def test_setup_parses_every_n_and_refuses_nonsense():
    assert TrainingSetup(checkpointing="every-3").checkpointing.every == 3
    assert TrainingSetup(checkpointing="every_3").checkpointing is Checkpointing.parse("every-3")
    assert Checkpointing.parse("every-1") is Checkpointing.FULL
    assert Checkpointing.parse("sac") is Checkpointing.SELECTIVE_OP
    assert [Checkpointing.parse("every-3").checkpointed(i) for i in range(6)] == [False, False, True] * 2
    for bad in ("every-0", "sometimes"):
        with pytest.raises(ConfigError, match="every-"):
            TrainingSetup(checkpointing=bad)
    with pytest.raises(ConfigError, match="not sized yet"):
        TrainingSetup(checkpointing="selective-op", finetune="lora")


def test_cli_bad_checkpointing_is_one_line_exit_2():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["estimate", "gpt2", "--checkpointing", "every-0"])
    assert result.exit_code == 2
    assert result.stdout.strip() == "" or "error" in result.output


def test_ladder_picks_the_cheapest_variant_that_fits():
    from memfit.plan import plan
    from memfit.setup import parse_keep
    from memfit.techniques.costs import recompute_fraction

    spec = resolve_model("llama-3.1-8b")
    base = TrainingSetup(micro_batch_size=8, seq_len=2048, precision="bf16", optimizer="adamw-8bit")
    sizes = {m: estimate(spec, base.replace(checkpointing=m), make_hardware("H100")).total_bytes
             for m in ("none", "selective-op", "every-2", "full")}
    assert sizes["none"] > sizes["every-2"] > sizes["selective-op"] > sizes["full"]
    costs = {m: recompute_fraction(spec, base.replace(checkpointing=m)) for m in ("selective-op", "every-2", "full")}
    assert costs["selective-op"] < costs["every-2"] < costs["full"] == pytest.approx(1 / 3)
    # a GPU between the selective-op and none sizes: the rung takes selective-op, not full
    gib = -(-(sizes["selective-op"] + sizes["none"]) // 2 // 2**30)
    result = plan(spec, base, make_hardware(f"{gib}GiB"), keep=parse_keep("precision,optimizer,micro_batch,seq"))
    steps = [s for s in result.steps if s.technique == "checkpointing"]
    assert steps and steps[0].setup.checkpointing is Checkpointing.SELECTIVE_OP, [
        (s.technique, s.setup.checkpointing) for s in result.steps]
    assert steps[0].typed_cost.recompute_fraction == costs["selective-op"]
    assert "TrainingArguments' checkpointing is full only" in steps[0].change


@pytest.mark.parametrize("mode", ["selective-op", "attention"])
def test_emitted_fsdp2_code_applies_the_same_policy(mode):
    """The emitted enable_checkpointing(model, blocks), run on a tiny model, gives the step memfit's wrapper does."""
    from memfit.emit.fsdp import fsdp2_code
    from memfit.emit.hf_trainer import hf_trainer_file, hf_trainer_kwargs

    setup = setup_of(checkpointing=mode, attention="eager", sharding="zero3", num_gpus=2, engine="torch")
    code = fsdp2_code(setup)
    namespace: dict = {}
    exec(compile(code, "fsdp2_shard.py", "exec"), namespace)  # noqa: S102 - the file memfit writes
    from memfit._torch.step import build_hf_model

    plain = setup.replace(sharding="none", num_gpus=1, checkpointing="none")
    torch.manual_seed(0)
    model = build_hf_model(copy.deepcopy(TINY_CONFIGS["llama"]), plain)
    namespace["enable_checkpointing"](model, namespace["transformer_blocks"](model))
    emitted = measure(model, plain, steps=2).tensor_bytes
    ours = measure(copy.deepcopy(TINY_CONFIGS["llama"]), setup.replace(sharding="none", num_gpus=1),
                   steps=2).tensor_bytes
    assert abs(emitted - ours) <= 0.005 * ours, (emitted, ours)
    kwargs = hf_trainer_kwargs(setup.replace(sharding="none", num_gpus=1, engine="deepspeed"))
    assert not any("checkpointing" in key for key in kwargs)
    notes = hf_trainer_file(setup.replace(sharding="none", num_gpus=1, engine="deepspeed")).notes
    assert any("cannot express" in note for note in notes), notes

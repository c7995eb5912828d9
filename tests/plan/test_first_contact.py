"""The flagship questions get one consistent answer: what the ladder says, what "what would fit" says and what the
plan on the suggested hardware says agree, by memfit's own formulas (issue: first contact)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.diagnose import diagnose, static_floor_bytes
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.finetune import Finetune, Method
from memfit.hardware import make_hardware
from memfit.ladder import rung_reason
from memfit.plan import plan
from memfit.setup import Engine, Optimizer, Precision, Sharding, TrainingSetup
from memfit.solve import describe_held, fewest_gpus
from memfit.sources import resolve_model
from memfit.units import format_bytes

QLORA = Finetune(method=Method.QLORA, rank=16, targets=("all-linear",))


def _qlora_70b(gpu: str, gpus: int = 1):
    spec = resolve_model("llama-3.1-70b")
    hw = make_hardware(gpu, gpus_per_node=gpus)
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048, finetune=QLORA, num_gpus=gpus)
    return spec, setup, hw


@pytest.mark.parametrize("gpu,gpus", [("48GB", 1), ("RTX-3090", 1)])
def test_the_more_gpus_answer_is_a_count_memfit_plans_to_a_fit(gpu, gpus):
    spec, setup, hw = _qlora_70b(gpu, gpus)
    result = plan(spec, setup, hw)
    assert not result.fits
    found = result.more_gpus
    assert found is not None and found.num_gpus > gpus
    # the suggested setup fits by the estimator ...
    assert diagnose(estimate(spec, found.setup, found.hardware), found.hardware).fits
    # ... and the plan of the recipe as given on that many GPUs reaches a fit too
    again = plan(spec, setup.replace(num_gpus=found.num_gpus), found.hardware)
    assert again.fits
    assert json.loads(json.dumps(result.to_dict()))["more_gpus"]["num_gpus"] == found.num_gpus


def test_8bit_adapter_states_are_taken_when_they_bring_static_memory_under_the_budget():
    # 70B QLoRA on 48 GB: peft's k-bit preparation keeps the 128k-vocabulary embedding and head in fp32, so static
    # memory is just over the budget; the adapters' 8-bit states are the only static rung left, and they suffice
    spec, setup, hw = _qlora_70b("48GB")
    result = plan(spec, setup, hw)
    budget = result.initial_diagnosis.budget_bytes
    assert static_floor_bytes(result.initial_estimate) > budget
    first = result.steps[0]
    assert first.technique == "adam_8bit" and first.setup.optimizer is Optimizer.ADAMW_8BIT
    assert static_floor_bytes(first.estimate) < budget
    # static memory fits now, so the activation rungs are taken after it
    assert "checkpointing" in [s.technique for s in result.steps]


def test_the_fsdp_qlora_recipe_fits_70b_on_two_24gb_cards():
    # FSDP2 shards the packed base, checkpointing, and CPUOffloadPolicy moves the shards to the host
    spec, setup, hw = _qlora_70b("RTX-3090", 2)
    result = plan(spec, setup, hw)
    assert result.fits
    final = result.final_setup
    assert (final.engine, final.sharding, final.offload.value) == (Engine.TORCH, Sharding.ZERO3, "optimizer+params")
    assert final.checkpointing.is_on


def test_the_zero_rung_shards_a_packed_base_on_fsdp2_when_deepspeed_cannot():
    spec, setup, hw = _qlora_70b("RTX-3090", 2)
    with pytest.raises(ConfigError):
        setup.replace(sharding=Sharding.ZERO3)  # DeepSpeed (the default engine) does not size a packed base
    result = plan(spec, setup, hw)
    zero = next(s for s in result.steps if s.technique == "zero")
    assert zero.setup.engine is Engine.TORCH and zero.setup.sharding is Sharding.ZERO3
    # the step's estimate is the FSDP2 layout's: each rank keeps about half of the packed base at rest
    frozen = {e: next(t.num_bytes for t in est.terms if t.name == "parameters/frozen")
              for e, est in (("before", result.initial_estimate), ("after", zero.estimate))}
    assert frozen["after"] == pytest.approx(frozen["before"] / 2, rel=0.03)


def test_a_plan_with_no_rung_taken_does_not_say_it_fits():
    runner = CliRunner()
    args = ["plan", "llama-3.1-70b", "--gpu", "RTX-3090", "--method", "qlora", "-b", "1", "-s", "2048",
            "--keep", "optimizer,gpus"]
    out = runner.invoke(app, args + ["--json"])
    data = json.loads(out.stdout)
    assert not data["fits"] and data["steps"] == [] and data["skipped"]
    text = runner.invoke(app, args).stdout
    assert "fits as given" not in text and "Rungs passed over" in text


def test_the_diagnosis_names_what_to_cut_and_by_how_much():
    spec, setup, hw = _qlora_70b("RTX-3090", 2)
    diag = plan(spec, setup, hw).initial_diagnosis
    assert diag.static_bytes > diag.budget_bytes
    assert format_bytes(diag.static_bytes - diag.budget_bytes) in diag.what_to_cut()
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("RTX-4090")
    lora = TrainingSetup(finetune=Finetune(method=Method.LORA))
    diag = diagnose(estimate(spec, lora, hw), hw)
    assert diag.static_bytes < diag.budget_bytes
    assert diag.activation_bytes >= -diag.headroom_bytes
    assert format_bytes(-diag.headroom_bytes) in diag.what_to_cut() and "activations" in diag.what_to_cut()


def test_fewest_gpus_with_the_ladder_keeps_the_method():
    spec, hw = resolve_model("llama-3.1-70b"), make_hardware("H100")
    plain = fewest_gpus(spec, TrainingSetup(), hw)
    assert not plain.fits  # the default setup held fixed: no checkpointing, micro-batch 8
    laddered = fewest_gpus(spec, TrainingSetup(), hw, with_ladder=True, keep=frozenset({"finetune"}))
    assert laddered.fits and not laddered.best.setup.finetune.adapters
    assert laddered.value <= 32
    runner = CliRunner()
    out = runner.invoke(app, ["fit", "llama-3.1-70b", "--gpu", "H100", "--max", "gpus", "--json"])
    data = json.loads(out.stdout)
    assert out.exit_code != 0 and not data["fits"]
    assert any(f"{laddered.value} x H100" in note for note in data["notes"])


def test_held_fixed_reads_as_words():
    held = {**TrainingSetup(finetune=QLORA).to_dict(), "gpu": "H100-80GB", "margin": 0.05}
    text = describe_held(held)
    assert "{" not in text and "qlora r=16" in text and "float8" not in text


def test_a_rung_never_asks_to_drop_an_option_it_set_itself():
    assert rung_reason("activation offloading is sized for decoders; 'x' is not one: drop --activation-offload") == \
        "activation offloading is sized for decoders; 'x' is not one"
    assert rung_reason("no advice here") == "no advice here"


def test_mixtral_under_deepspeed_amp_is_sized_as_the_engine_runs_it():
    # DeepSpeed's bf16 engine runs amp-bf16 with 16-bit parameters and fp32 master partitions (bf16-master's
    # layout): the MoE recipe's fp32-parameter formulas do not apply there, the derived model does
    spec, hw = resolve_model("mixtral-8x7b"), make_hardware("H100", gpus_per_node=8)
    amp = TrainingSetup(num_gpus=8, sharding=Sharding.ZERO2, precision=Precision.AMP_BF16)
    master = amp.replace(precision=Precision.BF16_MASTER)
    assert estimate(spec, amp, hw).total_bytes == estimate(spec, master, hw).total_bytes


def test_expert_parallelism_is_offered_with_its_figure():
    spec, hw = resolve_model("mixtral-8x7b"), make_hardware("A100-40GB", gpus_per_node=8)
    setup = TrainingSetup(num_gpus=8)
    with pytest.raises(ConfigError, match="expert-data-parallel"):
        setup.replace(expert_parallel=8, sharding=Sharding.ZERO3)
    result = plan(spec, setup, hw, keep=frozenset({"finetune", "precision"}))
    (line,) = [s for s in result.suggestions if s.startswith("expert parallelism")]
    ep = estimate(spec, result.final_setup.replace(expert_parallel=8, sharding=Sharding.NONE), hw)
    assert format_bytes(ep.total_bytes) in line

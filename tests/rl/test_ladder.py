"""The RL ladder and solver (memfit.rl.ladder): every rung re-estimated, the walk ends on a fit, the solver's answer
fits and one more does not (checked by estimating both), and the emitted settings read back through the framework's
own reader give the recipe the plan ended on."""

from __future__ import annotations

import json

import pytest

from memfit.api import as_spec
from memfit.diagnose import DEFAULT_MARGIN
from memfit.hardware import make_hardware
from memfit.rl import RLSetup, estimate_rl
from memfit.rl.frameworks import flatten, verl_settings
from memfit.rl.ladder import emit, fewest_gpus, hardware_for, largest, plan_rl
from memfit.rl.reader import build_setup, trl_settings

H100 = make_hardware("H100")


@pytest.fixture(scope="module")
def qwen():
    return as_spec("qwen2.5-7b")


GRPO = RLSetup(trainer="grpo", per_device_train_batch_size=8, num_generations=8, max_completion_length=1024,
               beta=0.04, use_vllm=True, vllm_gpu_memory_utilization=0.5, gradient_accumulation_steps=4)


def test_plan_walks_to_a_fit_and_emits_trl_settings(qwen):
    plan = plan_rl(qwen, GRPO, H100, margin=DEFAULT_MARGIN)
    assert not plan.start.fits and plan.fits
    for rung in plan.rungs:  # every rung's estimate is the estimate of its setup
        again = estimate_rl(qwen, rung.setup, hardware_for(H100, rung.gpus), margin=DEFAULT_MARGIN)
        assert again.peak.total_bytes == rung.estimate.peak.total_bytes
    assert list(plan.settings)[0] == "vllm_gpu_memory_utilization"
    # the settings read back as TRL config keys give the plan's final recipe
    settings, _ = trl_settings({**{k: v for k, v in plan.settings.items() if not k.startswith("#")}}, "plan")
    final = build_setup("grpo", {**_trl_fields(GRPO), **settings})
    assert final == plan.rungs[-1].setup


def _trl_fields(rl: RLSetup) -> dict:
    keys = ("per_device_train_batch_size", "num_generations", "max_completion_length", "beta", "use_vllm",
            "vllm_gpu_memory_utilization", "gradient_accumulation_steps")
    return {k: getattr(rl, k) for k in keys}


def test_plan_for_verl_offloads_and_reads_back(qwen):
    flat = {"algorithm.adv_estimator": "grpo", "data.train_batch_size": 512, "data.max_prompt_length": 1024,
            "data.max_response_length": 4096, "actor_rollout_ref.rollout.n": 8,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
            "actor_rollout_ref.rollout.free_cache_engine": False, "trainer.n_gpus_per_node": 8,
            "actor_rollout_ref.model.enable_gradient_checkpointing": True,
            "actor_rollout_ref.actor.use_kl_loss": True}
    rl = RLSetup(**verl_settings(flat, "run.sh").settings)
    hardware = make_hardware("A100-40GB", gpus_per_node=8)
    plan = plan_rl(qwen, rl, hardware, margin=DEFAULT_MARGIN, framework="verl")
    assert plan.fits and plan.rungs
    back = RLSetup(**verl_settings({**flat, **plan.settings}, "run.sh").settings)
    final = plan.rungs[-1].setup
    for name in ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "param_offload", "optimizer_offload",
                 "ref_offload", "per_device_train_batch_size", "generation_batch"):
        assert getattr(back, name) == getattr(final, name), name


@pytest.mark.parametrize("name", ["num_generations", "max_completion_length", "per_device_train_batch_size"])
def test_largest_is_the_edge(qwen, name):
    rl = GRPO.replace(lora=True, vllm_gpu_memory_utilization=0.3)
    value, result = largest(qwen, rl, H100, name, margin=DEFAULT_MARGIN)
    assert value is not None and result.fits
    for probe, fits in ((value, True), (value + 1, False)):
        changes = {name: probe}
        if name == "num_generations":
            changes["steps_per_generation"] = max(-(-probe // rl.per_device_train_batch_size), 4)
        est = estimate_rl(qwen, rl.replace(**changes), H100, margin=DEFAULT_MARGIN)
        holds = est.fits and est.vllm.kv_tokens >= est.vllm.needed_kv_tokens
        assert holds is fits, (probe, est.peak.total_bytes)


def test_fewest_gpus(qwen):
    rl = GRPO
    count, result = fewest_gpus(qwen, rl, H100, margin=DEFAULT_MARGIN)
    assert count is not None and count > 1 and result.fits
    fewer = estimate_rl(qwen, rl.replace(sharding="zero3" if count > 2 else "none"),
                        hardware_for(H100, count // 2), margin=DEFAULT_MARGIN)
    assert not fewer.fits


def test_emit_spells_each_framework():
    before = RLSetup(trainer="ppo", use_vllm=True, vllm_gpu_memory_utilization=0.5, per_device_train_batch_size=8,
                     gradient_accumulation_steps=2)
    after = before.replace(vllm_gpu_memory_utilization=0.42, vllm_enable_sleep_mode=True, param_offload=True,
                           optimizer_offload=True, per_device_train_batch_size=4, gradient_accumulation_steps=4,
                           steps_per_generation=4)
    verl = emit(before, after, 8, 8, "verl")
    assert list(verl)[0] == "actor_rollout_ref.rollout.gpu_memory_utilization"
    assert verl["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] is True
    assert verl["data.train_batch_size"] == 4 * 4 * 8 // 8
    openrlhf = emit(before, after, 8, 16, "openrlhf")
    assert openrlhf["--vllm_enable_sleep"] is True and openrlhf["--actor_num_nodes"] == 2
    trl = emit(before, after, 1, 1, "trl")
    assert "param_offload" in trl["#"]  # TRL has no key for it, and says so


def test_cli_plan_and_solver():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["rl", "qwen2.5-7b", "--trainer", "grpo", "--vllm", "--vllm-util", "0.5",
                                 "--beta", "0.04", "--completion-len", "1024", "--accum", "4", "--gpu", "H100",
                                 "--plan", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["plan"]["fits"] and not data["fits"]
    result = runner.invoke(app, ["rl", "qwen2.5-7b", "--vllm", "--lora", "-r", "8", "--gpu", "H100", "--max",
                                 "num_generations", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["largest"] > 1
    result = runner.invoke(app, ["rl", "qwen2.5-7b", "--max", "temperature"])
    assert result.exit_code == 2 and "--max takes one of" in result.output

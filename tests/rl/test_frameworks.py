"""verl's trainer config (YAML and a launch script's Hydra overrides) and OpenRLHF's train_ppo_ray arguments as
RLSetup fields (memfit.rl.frameworks), on real-shaped files in tests/data/configs/rl: every key is either mapped or
ignored with its reason; a value of the wrong type is one line; `memfit rl --config` reads each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memfit.errors import ConfigError
from memfit.rl import RLSetup
from memfit.rl.frameworks import (OPENRLHF, VERL, detect, flatten, openrlhf_settings, read_openrlhf, read_verl,
                                  verl_settings)

DATA = Path(__file__).resolve().parents[1] / "data" / "configs" / "rl"


def _keys(reading) -> set[str]:
    """The keys a reading accounted for (mapped: 'key=value ... -> field', ignored: 'key=value: why')."""
    return {line.split("=", 1)[0] for line in reading.mapped + reading.ignored + reading.read}


def test_detect_tells_the_three_formats_apart():
    assert detect(DATA / "verl_ppo.yaml") == VERL
    assert detect(DATA / "verl_grpo_qwen2_7b.sh") == VERL
    assert detect(DATA / "openrlhf_ppo_colocate.sh") == OPENRLHF
    assert detect(DATA / "trl_grpo.yaml") is None


def test_verl_yaml_every_key_accounted_for():
    reading = read_verl(DATA / "verl_ppo.yaml")
    flat = flatten(yaml.safe_load((DATA / "verl_ppo.yaml").read_text()))
    assert _keys(reading) == set(flat)
    s = reading.settings
    assert (s["trainer"], reading.gpus, s["per_device_train_batch_size"]) == ("ppo", 8, 4)
    # 256 prompts x n 1 / 8 GPUs = 32 responses per GPU generated at once = 8 micro-batches of 4
    assert s["steps_per_generation"] == 8
    assert s["param_offload"] and s["optimizer_offload"] and s["ref_offload"] and s["reward_model"]
    assert s["beta"] == 0.001 and s["vllm_enable_sleep_mode"] and s["sharding"] == "zero3"
    setup = RLSetup(**s)
    assert setup.has_critic and setup.has_reference_model and setup.generation_batch == 32


def test_verl_launch_script_overrides():
    reading = read_verl(DATA / "verl_grpo_qwen2_7b.sh")
    s = reading.settings
    assert reading.model == "Qwen/Qwen2-7B-Instruct"
    assert (s["trainer"], s["num_generations"], s["vllm_tensor_parallel_size"]) == ("grpo", 5, 2)
    assert (s["vllm_gpu_memory_utilization"], s["beta"], s["ref_offload"]) == (0.6, 0.001, True)
    # the yaml's rollout defaults where the script is silent
    assert s["vllm_enable_sleep_mode"] and s["vllm_enforce_eager"]
    assert s["steps_per_generation"] == 1024 * 5 // 8 // 16
    assert any(line.startswith("trainer.project_name=") for line in reading.ignored)


def test_verl_dynamic_batch_interpolation_and_errors():
    flat = {"data.max_prompt_length": 1024, "data.max_response_length": 3072, "actor_rollout_ref.actor.use_dynamic_bsz":
            True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384, "algorithm.adv_estimator": "rloo",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
            "critic.ppo_micro_batch_size_per_gpu": 2}
    reading = verl_settings(flat, "x.yaml")
    assert reading.settings["per_device_train_batch_size"] == 16384 // 4096
    assert reading.settings["trainer"] == "rloo"
    assert any("no critic" in line for line in reading.ignored)
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.n must be an integer"):
        verl_settings({"actor_rollout_ref.rollout.n": "five"}, "x.yaml")
    with pytest.raises(ConfigError, match="sizes vLLM and HF rollouts"):
        verl_settings({"actor_rollout_ref.rollout.name": "sglang"}, "x.yaml")


def test_openrlhf_arguments():
    reading = read_openrlhf(DATA / "openrlhf_ppo_colocate.sh")
    s = reading.settings
    assert reading.model == "OpenRLHF/Llama-3-8b-sft-mixture" and reading.gpus == 8
    assert (s["trainer"], s["vllm_mode"], s["vllm_gpu_memory_utilization"]) == ("ppo", "colocate", 0.5)
    assert (s["sharding"], s["per_device_train_batch_size"], s["beta"]) == ("zero3", 8, 0.01)
    assert s["param_offload"] and s["optimizer_offload"] and s["reward_model"] and s["vllm_enable_sleep_mode"]
    assert s["steps_per_generation"] == 1024 // 8 // 8
    # ray's own words before `-- python3 -m openrlhf.cli.train_ppo_ray` are not the trainer's arguments
    assert not any(line.startswith("--address") for line in reading.ignored)
    assert any(line.startswith("--actor_learning_rate") for line in reading.ignored)


def test_openrlhf_separate_gpus_and_defaults():
    words = ["python3", "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", "m", "--vllm_num_engines", "2",
             "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--init_kl_coef", "0.001"]
    s = openrlhf_settings(words, "run.sh").settings
    # not colocated: the engines have GPUs of their own, the reference too (no --colocate_actor_ref)
    assert (s["vllm_mode"], s["beta"], s["sharding"], s["trainer"]) == ("server", 0.0, "zero2", "grpo")
    assert s["vllm_gpu_memory_utilization"] == 0.95 and s["gradient_checkpointing"] is False
    with pytest.raises(ConfigError, match="--micro_train_batch_size must be an integer"):
        openrlhf_settings(["--micro_train_batch_size", "four"], "run.sh")


def test_cli_reads_each_format(tmp_path):
    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner()
    for name, model in (("verl_ppo.yaml", "llama-3.1-8b"), ("verl_grpo_qwen2_7b.sh", "qwen2.5-7b"),
                        ("openrlhf_ppo_colocate.sh", "llama-3.1-8b"), ("trl_grpo.yaml", None)):
        args = ["rl"] + ([model] if model else []) + ["--config", str(DATA / name), "--gpu", "H100", "--json"]
        result = runner.invoke(app, args)
        assert result.exit_code in (0, 1), result.output
        data = json.loads(result.output)
        assert data["framework"] == {"verl_ppo.yaml": "verl", "verl_grpo_qwen2_7b.sh": "verl",
                                     "openrlhf_ppo_colocate.sh": "openrlhf"}.get(name, "trl")
        assert data["peak_bytes"] == max(p["total_bytes"] for p in data["phases"])
    ppo = json.loads(runner.invoke(app, ["rl", "llama-3.1-8b", "--config", str(DATA / "verl_ppo.yaml"),
                                         "--gpu", "H100", "--json"]).output)
    assert [p["name"] for p in ppo["phases"]] == ["generation", "log-probs", "training", "critic"]
    bad = tmp_path / "run.sh"
    bad.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=lots\n")
    result = runner.invoke(app, ["rl", "llama-3.1-8b", "--config", str(bad)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "actor_rollout_ref.rollout.n must be an integer" in result.output


@pytest.mark.parametrize("words", [
    "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=2 trainer.n_gpus_per_node=0",
    "python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0",
    "python3 -m openrlhf.cli.train_ppo_ray --pretrain m --actor_num_nodes 0",
    "python3 -m openrlhf.cli.train_ppo_ray --pretrain m --micro_train_batch_size 0",
])
def test_a_zero_count_is_one_line_not_a_division_by_zero(tmp_path, words):
    """GPUs, nodes and the micro-batch divide the batch: 0 is refused by name (it once raised ZeroDivisionError)."""
    from typer.testing import CliRunner

    from memfit.cli.app import app

    bad = tmp_path / "run.sh"
    bad.write_text(words + "\n")
    result = CliRunner().invoke(app, ["rl", "llama-3.1-8b", "--config", str(bad)])
    key = words.split()[-1].split("=")[0] if "=" in words else words.split()[-2]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"{key} must be at least 1, got 0" in result.output

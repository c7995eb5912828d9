"""memfit.rl's second slice of trainers against real steps on CPU (profiler memory events): TRL's RLOOTrainer and
KTOTrainer (trl 1.16), and PPO's critic update as verl's dp_critic runs it (trl 1.16 has no PPOTrainer); PPO's
phases and the offloads' effect on which model is alive in which phase."""

from __future__ import annotations

import pytest

from tiny_configs import TINY_LLAMA, TINY_QWEN2

from memfit.api import as_spec
from memfit.estimate.result import Category
from memfit.estimate.terms import TermKey
from memfit.hardware import cpu_device, make_hardware
from memfit.rl import RLSetup, estimate_rl
from memfit.rl.phases import critic_fraction

CPU = make_hardware(cpu_device(1 << 36))
TOLERANCE = 0.03


def _rl(trainer: str, **fields) -> RLSetup:
    return RLSetup(trainer=trainer, gradient_checkpointing=False, bf16=False, triton=False, lora_rank=8, **fields)


def _errors(config: dict, rl: RLSetup, measured: dict[str, int]) -> dict[str, float]:
    result = estimate_rl(as_spec(dict(config)), rl, CPU)
    names = {"log-probs": "reference"}
    errors = {p.name: p.tensor_bytes / measured[names.get(p.name, p.name)] - 1 for p in result.phases}
    assert {names.get(n, n) for n in errors} == set(measured)
    return errors


@pytest.fixture
def trl_measure(torch_cpu, tmp_path):
    pytest.importorskip("trl")
    from memfit.rl import measure

    return measure, str(tmp_path)


def test_rloo_phases_match_a_measured_trl_step(trl_measure):
    """RLOOTrainer always takes the old policy's log-probs under no_grad (rloo_trainer.py), beta 0.05 its default:
    generation, log-probs (old + reference), training."""
    measure, out = trl_measure
    measured = measure.measure_grpo(TINY_LLAMA, batch=4, num_generations=4, prompt_len=16, completion_len=32,
                                    beta=0.05, output_dir=out, trainer="rloo")
    errors = _errors(TINY_LLAMA, _rl("rloo", per_device_train_batch_size=4, num_generations=4,
                                     max_prompt_length=16, max_completion_length=32, beta=0.05), measured)
    assert set(errors) == {"generation", "log-probs", "training"}
    assert all(abs(e) < TOLERANCE for e in errors.values()), errors


def test_kto_phases_match_a_measured_trl_step(trl_measure):
    """KTOTrainer: unpaired rows (no chosen / rejected doubling), the KL rows through the policy before its grad
    forward ('kl'), the reference inside compute_loss; TRL appends EOS to each completion (+1 token)."""
    measure, out = trl_measure
    measured = measure.measure_kto(TINY_LLAMA, batch=4, prompt_len=16, completion_len=24, output_dir=out)
    errors = _errors(TINY_LLAMA, _rl("kto", per_device_train_batch_size=4, max_prompt_length=16,
                                     max_completion_length=25, beta=0.1), measured)
    assert set(errors) == {"kl", "log-probs", "training"}
    assert all(abs(e) < TOLERANCE for e in errors.values()), errors


@pytest.mark.slow
@pytest.mark.parametrize("trainer, config, fields", [
    ("rloo", TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64, lora=True)),
    ("rloo", TINY_QWEN2, dict(batch=8, num_generations=4, prompt_len=32, completion_len=32, beta=0.0)),
    ("kto", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, lora=True)),
    ("kto", TINY_QWEN2, dict(batch=8, prompt_len=16, completion_len=32)),
])
def test_trainer_variants_match_measured(trl_measure, trainer, config, fields):
    measure, out = trl_measure
    beta = fields.pop("beta", 0.05 if trainer == "rloo" else 0.1)
    if trainer == "rloo":
        measured = measure.measure_grpo(config, beta=beta, output_dir=out, trainer="rloo", **fields)
    else:
        measured = measure.measure_kto(config, output_dir=out, **fields)
    rl = _rl(trainer, per_device_train_batch_size=fields["batch"], num_generations=fields.get("num_generations", 8),
             max_prompt_length=fields["prompt_len"],
             max_completion_length=fields["completion_len"] + (trainer == "kto"), beta=beta,
             lora=fields.get("lora", False))
    errors = _errors(config, rl, measured)
    assert all(abs(e) < TOLERANCE for e in errors.values()), errors


def test_ppo_critic_update_matches_a_measured_value_model_step(torch_cpu):
    """The value model's update (AutoModelForTokenClassification, num_labels=1, a clipped value loss, fused AdamW)
    against memfit's critic phase with the policy and reference offloaded, less the rollout buffers (the measured
    step holds its ids, old values and returns instead)."""
    from memfit.rl import measure

    batch, prompt, completion = 4, 32, 64
    measured = measure.measure_critic(TINY_LLAMA, batch=batch, prompt_len=prompt, completion_len=completion)
    rl = _rl("ppo", per_device_train_batch_size=batch, num_generations=1, max_prompt_length=prompt,
             max_completion_length=completion, beta=0.0, param_offload=True, optimizer_offload=True)
    phase = next(p for p in estimate_rl(as_spec(dict(TINY_LLAMA)), rl, CPU).phases if p.name == "critic")
    rollout = sum(t.num_bytes for t in phase.terms if t.name == TermKey.ROLLOUT_INPUTS)
    predicted = phase.tensor_bytes - rollout + batch * (prompt + completion) * 8 + 2 * batch * completion * 4
    assert abs(predicted / measured - 1) < TOLERANCE


def test_critic_is_the_backbone_with_a_score_head(torch_cpu):
    """critic_fraction against a real AutoModelForTokenClassification(num_labels=1) and AutoModelForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    for config in (TINY_LLAMA, TINY_QWEN2):
        lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        value = AutoModelForTokenClassification.from_config(AutoConfig.for_model(**config, num_labels=1))
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731  (tied weights once)
        assert critic_fraction(as_spec(dict(config))) == pytest.approx(count(value) / count(lm), rel=1e-9)


def test_ppo_phases_and_offloads():
    """PPO: the critic's update is a phase of its own; offloads take each model off the GPU outside its phases
    (verl param / optimizer offload, ref param_offload); a phase's peak is never a sum of phases."""
    spec = as_spec("llama-3.1-8b")
    gpu = make_hardware("H100")
    base = RLSetup(trainer="ppo", per_device_train_batch_size=2, num_generations=1, max_prompt_length=256,
                   max_completion_length=256, beta=0.05, reward_model=True, use_vllm=True, lora=True)
    plain = estimate_rl(spec, base, gpu)
    assert [p.name for p in plain.phases] == ["generation", "log-probs", "training", "critic"]
    assert set(plain.phases[-1].models) >= {"policy", "critic", "reward"}

    def names(result, phase):
        return {t.name for t in next(p for p in result.phases if p.name == phase).terms}

    off = estimate_rl(spec, base.replace(param_offload=True, optimizer_offload=True, ref_offload=True), gpu)
    assert TermKey.CRITIC_OPTIMIZER not in names(off, "training")
    assert TermKey.CRITIC_OPTIMIZER in names(off, "critic")
    assert TermKey.REWARD_MODEL not in names(off, "training") and TermKey.REWARD_MODEL in names(off, "log-probs")
    for phase in ("generation", "training", "critic"):
        before = next(p for p in plain.phases if p.name == phase).total_bytes
        assert next(p for p in off.phases if p.name == phase).total_bytes < before
    optimizer = {p.name: p.by_category().get(Category.OPTIMIZER.value, 0) for p in off.phases}
    assert optimizer["generation"] == optimizer["log-probs"] == 0 < optimizer["training"]


def test_critic_runs_its_own_micro_batch(tmp_path):
    """verl's critic.ppo_micro_batch_size_per_gpu sizes the critic phase alone; the actor's phases keep theirs."""
    from memfit.rl.frameworks import read_verl

    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gae data.max_prompt_length=512 "
                      "data.max_response_length=512 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
                      "critic.ppo_micro_batch_size_per_gpu=16 trainer.n_gpus_per_node=1\n")
    reading = read_verl(script)
    assert (reading.settings["per_device_train_batch_size"], reading.settings["critic_micro_batch_size"]) == (4, 16)
    spec, gpu = as_spec("llama-3.1-8b"), make_hardware("H100")
    base = RLSetup(trainer="ppo", per_device_train_batch_size=4, max_prompt_length=512, max_completion_length=512,
                   beta=0.0, gradient_checkpointing=False)
    same, own = estimate_rl(spec, base, gpu), estimate_rl(spec, base.replace(critic_micro_batch_size=16), gpu)
    phase = lambda result, name: next(p for p in result.phases if p.name == name)  # noqa: E731
    assert phase(own, "training").total_bytes == phase(same, "training").total_bytes
    activations = lambda p: p.by_category()[Category.ACTIVATIONS.value]  # noqa: E731
    assert activations(phase(own, "critic")) > 3 * activations(phase(same, "critic"))


def test_cli_critic_batch_sizes_the_critic_phase():
    from memfit.rl import rl_inputs

    inputs = rl_inputs(model="llama-3.1-8b", trainer="ppo", batch=2, critic_batch=8)
    assert (inputs.rl.per_device_train_batch_size, inputs.rl.critic_batch) == (2, 8)
    assert rl_inputs(model="llama-3.1-8b", trainer="ppo", batch=2).rl.critic_batch == 2

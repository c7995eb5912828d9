"""ORPO, CPO and SimPO (trl.experimental, trl 1.16) against real steps on CPU (profiler memory events): one training
phase, chosen and rejected concatenated through the policy alone, the logits materialised; and their configs as
TrlParser reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_configs import TINY_LLAMA, TINY_QWEN2

from memfit.api import as_spec
from memfit.errors import ConfigError
from memfit.estimate.terms import TermKey
from memfit.hardware import cpu_device, make_hardware
from memfit.rl import RLSetup, estimate_rl, rl_inputs
from memfit.rl.reader import build_setup, trl_settings

CPU = make_hardware(cpu_device(1 << 36))
TOLERANCE = 0.03
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs" / "rl"


def _predicted(config: dict, trainer: str, *, batch: int, prompt_len: int, completion_len: int,
               lora: bool = False) -> int:
    # TRL appends EOS to chosen and rejected (`add_eos_token_if_needed`): + 1 token
    rl = RLSetup(trainer=trainer, per_device_train_batch_size=batch, max_prompt_length=prompt_len,
                 max_completion_length=completion_len + 1, gradient_checkpointing=False, bf16=False, triton=False,
                 lora=lora, lora_rank=8)
    phases = estimate_rl(as_spec(dict(config)), rl, CPU).phases
    assert [p.name for p in phases] == ["training"] and phases[0].models == ("policy",)
    return phases[0].tensor_bytes


@pytest.mark.parametrize("trainer, config, fields", [
    ("orpo", TINY_LLAMA, dict(batch=4, prompt_len=16, completion_len=24)),
    ("cpo", TINY_QWEN2, dict(batch=2, prompt_len=32, completion_len=16)),
    ("simpo", TINY_LLAMA, dict(batch=4, prompt_len=16, completion_len=24, lora=True)),
])
def test_reference_free_trainers_match_a_measured_trl_step(torch_cpu, tmp_path, trainer, config, fields):
    pytest.importorskip("trl")
    from memfit.rl import measure

    measured = measure.measure_preference(config, trainer=trainer, output_dir=str(tmp_path), **fields)
    assert set(measured) == {"training"}
    error = _predicted(config, trainer, **fields) / measured["training"] - 1
    assert abs(error) < TOLERANCE, error


def test_simpo_drops_the_nll_log_softmax_and_no_trainer_loads_a_reference():
    spec = as_spec("llama-3.1-8b")
    gpu = make_hardware("H100")
    terms = {}
    for trainer in ("orpo", "cpo", "simpo"):
        rl = RLSetup(trainer=trainer, per_device_train_batch_size=2, max_prompt_length=512, max_completion_length=512,
                     gradient_checkpointing=False)
        assert not rl.has_reference_model and not rl.needs_reference_logprobs
        phase = estimate_rl(spec, rl, gpu).phases[0]
        terms[trainer] = {t.name: t.num_bytes for t in phase.terms}
    # the NLL's fp32 log-softmax of the chosen half: [B, T - 1, V] x 4
    assert terms["orpo"][TermKey.NLL_LOG_SOFTMAX] == 2 * 1023 * 128256 * 4
    assert terms["cpo"] == terms["orpo"]
    assert TermKey.NLL_LOG_SOFTMAX not in terms["simpo"]
    assert TermKey.REFERENCE not in terms["orpo"]


def test_orpo_and_simpo_configs_read_as_trl_parses_them():
    orpo = rl_inputs(trainer="orpo", config=CONFIGS / "trl_orpo.yaml", resolve=lambda name: as_spec("llama-3.1-8b"))
    assert (orpo.rl.trainer, orpo.rl.per_device_train_batch_size, orpo.rl.seq_len) == ("orpo", 4, 2048)
    simpo = rl_inputs(trainer="cpo", config=CONFIGS / "trl_simpo.yaml", resolve=lambda name: as_spec("llama-3.1-8b"))
    assert (simpo.rl.trainer, simpo.rl.gradient_accumulation_steps) == ("simpo", 16)
    # CPOConfig's loss_type alphapo is simpo without the NLL (cpo_config.py __post_init__); cpo_alpha 1 keeps it
    assert build_setup("cpo", trl_settings({"loss_type": "alphapo"}, "cpo.yaml")[0]).trainer == "simpo"
    assert build_setup("cpo", trl_settings({"cpo_alpha": 1.0}, "cpo.yaml")[0]).trainer == "cpo"
    # max_completion_length is read by ORPO / CPO only for encoder-decoder models: max_length bounds the pair
    settings = trl_settings({"max_length": 1024, "max_prompt_length": 256, "max_completion_length": 64}, "o.yaml")[0]
    assert build_setup("orpo", settings).max_completion_length == 768
    with pytest.raises(ConfigError, match="decoder-only"):
        trl_settings({"is_encoder_decoder": True}, "orpo.yaml")
    with pytest.raises(ConfigError, match="cpo_alpha must be a number"):
        trl_settings({"cpo_alpha": "none"}, "cpo.yaml")


def test_orpo_plan_on_a_24gb_card_reads_back():
    """ORPO has no reference rung and no fused-head rung (its logits are always materialised): LoRA, then smaller
    micro-batches; the emitted TRL settings read back to the plan's final recipe."""
    from memfit.diagnose import DEFAULT_MARGIN
    from memfit.rl.ladder import plan_rl

    spec = as_spec("llama-3.1-8b")
    orpo = RLSetup(trainer="orpo", per_device_train_batch_size=4, max_prompt_length=1024, max_completion_length=1024,
                   gradient_accumulation_steps=8)
    plan = plan_rl(spec, orpo, make_hardware("L4"), margin=DEFAULT_MARGIN)
    assert plan.fits and [r.name for r in plan.rungs] == ["lora", "micro-batch", "micro-batch"]
    fields = {k: getattr(orpo, k) for k in ("per_device_train_batch_size", "max_prompt_length",
                                            "max_completion_length", "gradient_accumulation_steps")}
    settings, _ = trl_settings(dict(plan.settings), "plan")
    assert build_setup("orpo", {**fields, **settings}) == plan.rungs[-1].setup

"""memfit.rl: RL post-training phases against real TRL runs on CPU (profiler memory events), vLLM's KV-cache page
and budget arithmetic against vLLM's own formulas and published logs, the TRL config reader and `memfit rl`."""

from __future__ import annotations

import json

import pytest

from tiny_configs import TINY_LLAMA, TINY_MISTRAL, TINY_QWEN2

from memfit.api import as_spec
from memfit.errors import ConfigError
from memfit.hardware import cpu_device, make_hardware
from memfit.rl import RLSetup, estimate_rl
from memfit.rl.generation import (GiB, SAMPLER_BYTES_PER_SEQ_VOCAB, KVLayer, VllmBudget, hf_kv_cache_bytes,
                                  kv_dtype_bytes, kv_layers, vllm_bytes_per_token, vllm_page_size_bytes)
from memfit.rl.reader import build_setup, trl_settings

CPU = make_hardware(cpu_device(1 << 36))
TOLERANCE = 0.03  # per phase: the 3% median / 8% worst, held per phase here


def _rl(trainer: str, **fields) -> RLSetup:
    """The measured runs' recipe: fp32 (bf16=False), no checkpointing, TRL's torch fallback head (CPU)."""
    return RLSetup(trainer=trainer, gradient_checkpointing=False, bf16=False, triton=False, lora_rank=8, **fields)


def _compare(config: dict, rl: RLSetup, measured: dict[str, int]) -> dict[str, float]:
    result = estimate_rl(as_spec(dict(config)), rl, CPU)
    names = {"log-probs": "reference"}
    errors = {phase.name: phase.tensor_bytes / measured[names.get(phase.name, phase.name)] - 1
              for phase in result.phases}
    assert set(names.get(n, n) for n in errors) == set(measured)
    return errors


@pytest.fixture
def trl_measure(torch_cpu, tmp_path):
    pytest.importorskip("trl")
    from memfit.rl import measure

    return measure, str(tmp_path)


def test_grpo_phases_match_a_measured_trl_step(trl_measure):
    """TRL's GRPOTrainer (HF generate, beta 0.04: a reference model) on a tiny Llama, one step measured per phase."""
    measure, out = trl_measure
    measured = measure.measure_grpo(TINY_LLAMA, batch=4, num_generations=4, prompt_len=16, completion_len=32,
                                    output_dir=out)
    errors = _compare(TINY_LLAMA, _rl("grpo", per_device_train_batch_size=4, num_generations=4,
                                      max_prompt_length=16, max_completion_length=32, beta=0.04), measured)
    assert set(errors) == {"generation", "log-probs", "training"}
    assert all(abs(e) < TOLERANCE for e in errors.values()), errors


def test_dpo_phases_match_a_measured_trl_step(trl_measure):
    """TRL's DPOTrainer, online reference: its forward runs inside compute_loss with the policy's activations alive,
    so that phase is policy activations + the reference's no-grad forward."""
    measure, out = trl_measure
    measured = measure.measure_dpo(TINY_LLAMA, batch=2, prompt_len=16, completion_len=24, output_dir=out)
    errors = _compare(TINY_LLAMA, _rl("dpo", per_device_train_batch_size=2, max_prompt_length=16,
                                      max_completion_length=24), measured)
    assert set(errors) == {"log-probs", "training"}
    assert all(abs(e) < TOLERANCE for e in errors.values()), errors


@pytest.mark.slow
@pytest.mark.parametrize("config, fields", [
    (TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64, lora=True)),
    (TINY_LLAMA, dict(batch=8, num_generations=4, prompt_len=64, completion_len=32, beta=0.0)),
    (TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64, checkpointing=True)),
    (TINY_QWEN2, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
    (dict(TINY_MISTRAL, sliding_window=48), dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
])
def test_grpo_variants_match_measured(trl_measure, config, fields):
    measure, out = trl_measure
    beta = fields.pop("beta", 0.04)
    measured = measure.measure_grpo(config, beta=beta, output_dir=out, **fields)
    rl = _rl("grpo", per_device_train_batch_size=fields["batch"], num_generations=fields["num_generations"],
             max_prompt_length=fields["prompt_len"], max_completion_length=fields["completion_len"], beta=beta,
             lora=fields.get("lora", False)).replace(gradient_checkpointing=fields.get("checkpointing", False))
    errors = _compare(config, rl, measured)
    assert all(abs(e) < TOLERANCE for e in errors.values()), errors


@pytest.mark.slow
@pytest.mark.parametrize("fields", [dict(lora=True), dict(precompute=True), dict(precompute="phase"),
                                    dict(precompute="phase", lora=True)])
def test_dpo_variants_match_measured(trl_measure, fields):
    measure, out = trl_measure
    measured = measure.measure_dpo(TINY_LLAMA, batch=4, prompt_len=32, completion_len=48, output_dir=out, **fields)
    rl = _rl("dpo", per_device_train_batch_size=4, max_prompt_length=32, max_completion_length=48,
             lora=fields.get("lora", False), precompute_ref_log_probs=bool(fields.get("precompute", False)))
    result = estimate_rl(as_spec(dict(TINY_LLAMA)), rl, CPU)
    compared = 0
    for phase in result.phases:
        name = {"log-probs": "reference"}.get(phase.name, phase.name)
        if name in measured:  # a step measures its phases; precompute="phase" the precompute pass alone
            compared += 1
            assert abs(phase.tensor_bytes / measured[name] - 1) < TOLERANCE, (phase.name, measured)
    assert compared == len(measured)


# --- the phases' structure ------------------------------------------------------------------------------------

def test_peak_is_the_largest_phase_never_a_sum():
    result = estimate_rl(as_spec("llama-3.1-8b"), RLSetup(trainer="grpo", beta=0.04), make_hardware("H100"))
    totals = [phase.total_bytes for phase in result.phases]
    assert result.peak.total_bytes == max(totals) < sum(totals)
    assert [p.name for p in result.phases] == ["generation", "log-probs", "training"]
    weights = {t.name: t.num_bytes for t in result.peak.terms}
    assert weights["parameters/reference"] == weights["parameters"]  # a second copy of the weights


def test_lora_policy_has_no_reference_model():
    """TRL disables the adapters for the reference (`use_adapter(model, None)`): no second set of weights."""
    result = estimate_rl(as_spec("llama-3.1-8b"), RLSetup(trainer="grpo", beta=0.04, lora=True),
                         make_hardware("H100"))
    assert all(p.models == ("policy",) for p in result.phases)
    assert not any(t.name == "parameters/reference" for p in result.phases for t in p.terms)


def test_grpo_beta_zero_skips_the_reference_pass():
    result = estimate_rl(as_spec("llama-3.1-8b"), RLSetup(trainer="grpo"), make_hardware("H100"))
    assert [p.name for p in result.phases] == ["generation", "training"]


def test_dpo_precompute_drops_the_reference_from_training():
    spec, hw = as_spec("llama-3.1-8b"), make_hardware("H100")
    online = estimate_rl(spec, RLSetup(trainer="dpo", beta=0.1), hw)
    pre = estimate_rl(spec, RLSetup(trainer="dpo", beta=0.1, precompute_ref_log_probs=True), hw)
    assert [p.name for p in pre.phases] == ["precompute", "training"]
    weights = online.phases[-1].by_category()["parameters"]
    assert weights - pre.phases[-1].by_category()["parameters"] == weights // 2


# --- generation: HF's cache and vLLM's pages -------------------------------------------------------------------

def test_hf_kv_cache_matches_a_real_dynamic_cache(torch_cpu):
    """The storage transformers' DynamicCache holds after a prefill and one decode step, read off real models (a
    sliding layer keeps a view of its last concatenation: window tokens of storage once decoding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for config in (TINY_LLAMA, TINY_QWEN2, dict(TINY_MISTRAL, sliding_window=8)):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch_cpu.float32)
        ids = torch_cpu.randint(3, 400, (3, 20))
        with torch_cpu.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
        real = sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                   for layer in cache.layers)
        assert hf_kv_cache_bytes(as_spec(dict(config)), 3, 21, 4) == real


def test_vllm_page_size_follows_kv_cache_interface():
    """vllm/v1/kv_cache_interface.py: FullAttentionSpec.real_page_size_bytes = block_size x num_kv_heads x
    (head_size + head_size_v) x dtype size; MLAAttentionSpec = block_size x num_kv_heads(1) x head_size x dtype with
    head_size = kv_lora_rank + qk_rope_head_dim."""
    llama = as_spec("llama-3.1-8b")
    full = kv_layers(llama)[0]
    assert (full.kv_heads, full.key_dim, full.count) == (8, 128, 32)
    assert vllm_page_size_bytes(full, 2) == 16 * 8 * (128 + 128) * 2 == 65536
    assert vllm_page_size_bytes(full, kv_dtype_bytes("fp8")) == 32768
    assert vllm_page_size_bytes(full, 2, tp=2) == 32768  # 4 heads per rank
    assert vllm_page_size_bytes(full, 2, tp=16) == 65536 // 8  # fewer heads than ranks: one replicated
    # Llama-3.1-8B: 128 KiB of KV per token in bf16 (32 layers x 2 x 8 heads x 128 x 2 B)
    assert vllm_bytes_per_token(llama, 2) == 131072
    # DeepSeek-V3's MLA: one 576-wide latent (512 + 64 rope) per layer: 1,152 B per token per layer in bf16
    mla = KVLayer(kv_heads=128, key_dim=192, value_dim=128, window=None, latent_dim=512 + 64, count=61)
    assert vllm_page_size_bytes(mla, 2) == 16 * 576 * 2
    assert vllm_page_size_bytes(mla, 2, tp=8) == 16 * 576 * 2  # replicated, not split by TP
    gemma = kv_layers(as_spec("gemma-2-9b"))[0]
    assert gemma.window == 4096 and vllm_page_size_bytes(gemma, 2) == 16 * 8 * 512 * 2


def test_vllm_budget_reproduces_published_logs():
    """llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md, H100 (79.18 GiB), utilization 0.9:
    Llama-3.1-8B weights 14.99 GiB, peak activation 4.76 GiB, non-torch 0.13 GiB -> KV cache 51.38 GiB."""
    budget = VllmBudget(total=int(79.18 * GiB), utilization=0.9, weights=int(14.99 * GiB),
                        activation_peak=int(4.76 * GiB), non_torch=int(0.13 * GiB), cuda_graphs=0,
                        bytes_per_token=131072)
    assert budget.kv_cache / GiB == pytest.approx(51.38, abs=0.01)
    assert budget.kv_cache % (131072 * 16) == 0
    for vocab, peak_gib in ((128256, 4.76), (151936, 5.56), (201088, 7.38)):  # max_num_seqs 1024 on an H100
        assert SAMPLER_BYTES_PER_SEQ_VOCAB * 1024 * vocab / GiB == pytest.approx(peak_gib, rel=0.015)
    weights = 2 * as_spec("llama-3.1-8b").num_params
    assert weights / GiB == pytest.approx(14.99, rel=0.005)


def test_recommended_utilization_leaves_the_trainer_its_peak():
    spec, hw = as_spec("llama-3.1-8b"), make_hardware("H100")
    rl = RLSetup(trainer="grpo", use_vllm=True, lora=True, beta=0.04)
    advice = estimate_rl(spec, rl, hw).vllm
    assert advice.recommended is not None and advice.minimum < advice.recommended
    usable = hw.gpu.memory_bytes * 0.95
    at = estimate_rl(spec, rl.replace(vllm_gpu_memory_utilization=advice.recommended), hw)
    assert at.peak.total_bytes <= usable
    above = estimate_rl(spec, rl.replace(vllm_gpu_memory_utilization=advice.recommended + 0.02), hw)
    assert above.peak.total_bytes > usable
    slept = estimate_rl(spec, rl.replace(vllm_enable_sleep_mode=True), hw)
    assert slept.phases[-1].total_bytes < estimate_rl(spec, rl, hw).phases[-1].total_bytes


# --- the reader and the command --------------------------------------------------------------------------------

def test_reader_maps_trl_fields_and_names_unknown_keys():
    settings, model = trl_settings({"model_name_or_path": "Qwen/Qwen2.5-0.5B", "per_device_train_batch_size": 4,
                                    "num_generations": 4, "max_completion_length": 256, "use_vllm": True,
                                    "vllm_gpu_memory_utilization": 0.4, "use_peft": True, "lora_r": 32,
                                    "learning_rate": 1e-6, "generation_batch_size": 16}, "grpo.yaml")
    assert model == "Qwen/Qwen2.5-0.5B"
    rl = build_setup("grpo", settings)
    assert (rl.per_device_train_batch_size, rl.steps_per_generation, rl.generation_batch) == (4, 4, 16)
    assert (rl.lora, rl.lora_rank, rl.use_vllm, rl.vllm_gpu_memory_utilization) == (True, 32, True, 0.4)
    assert build_setup("dpo", {"max_length": 1024, "max_prompt_length": 256}).max_completion_length == 768
    with pytest.raises(ConfigError, match="unknown keys num_generation, vllm_util"):
        trl_settings({"num_generation": 8, "vllm_util": 0.3}, "grpo.yaml")
    with pytest.raises(ConfigError, match="per_device_train_batch_size must be a non-negative integer"):
        trl_settings({"per_device_train_batch_size": "8"}, "grpo.yaml")


def test_cli_rl_json_and_errors(tmp_path):
    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["rl", "llama-3.1-8b", "--trainer", "grpo", "--vllm", "--lora", "--gpu", "H100",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["peak_bytes"] == max(p["total_bytes"] for p in data["phases"])
    # with vLLM, TRL always takes the old policy's log-probs (importance-sampling correction)
    assert [p["name"] for p in data["phases"]] == ["generation", "log-probs", "training"]
    assert 0 < data["vllm"]["recommended"] < 1
    bad = tmp_path / "grpo.yaml"
    bad.write_text("per_device_train_batch_size: 8\nnum_gen: 4\n")
    result = runner.invoke(app, ["rl", "llama-3.1-8b", "--config", str(bad)])
    assert result.exit_code == 2
    assert "unknown key num_gen" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["rl", "llama-3.1-8b", "--trainer", "ppo2"])
    assert result.exit_code == 2
    named = tmp_path / "dpo.json"
    named.write_text(json.dumps({"model_name_or_path": "llama-3.1-8b", "per_device_train_batch_size": 2,
                                 "max_length": 1024, "use_peft": True}))
    result = runner.invoke(app, ["rl", "--trainer", "dpo", "--config", str(named), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["model"], data["setup"]["max_completion_length"], data["setup"]["beta"]) == ("llama-3.1-8b", 512, 0.1)


@pytest.mark.parametrize("kind, train, shape", [
    ("selective", False, (16, 8, 128)), ("selective", True, (16, 8, 128)),
    pytest.param("full", False, (16, 8, 128), marks=pytest.mark.slow),
    pytest.param("full", True, (16, 8, 128), marks=pytest.mark.slow),
    pytest.param("selective", True, (4, 64, 32), marks=pytest.mark.slow),
    pytest.param("full", True, (4, 64, 32), marks=pytest.mark.slow),
])
def test_trl0_logits_heads_match_measured(torch_cpu, kind, train, shape):
    """TRL 0.x's log-probs over materialised logits (selective_log_softmax, or the naive log_softmax), measured: the
    no-grad pass against the log-probs phase's forward, forward + backward against the core's activations plus the
    head's backward terms."""
    pytest.importorskip("trl")
    from memfit.estimate.analytic import estimate
    from memfit.estimate.result import Category
    from memfit.rl import measure
    from memfit.rl.phases import _head_backward, _no_grad_forward, _pick, training_setup

    batch, prompt, completion = shape
    spec = as_spec(dict(TINY_LLAMA))
    rl = RLSetup(per_device_train_batch_size=batch, max_prompt_length=prompt, max_completion_length=completion,
                 bf16=False, gradient_checkpointing=False, logprob_head=kind)
    measured = measure.measure_logits_head(TINY_LLAMA, batch=batch, prompt_len=prompt, completion_len=completion,
                                           kind=kind, train=train)
    if train:
        core = estimate(spec, training_setup(rl, CPU, batch).replace(loss="standard"), CPU)
        terms = _pick(core, Category.ACTIVATIONS) + _head_backward(spec, rl, batch)
    else:
        terms = _no_grad_forward(spec, rl, batch)
    predicted = spec.num_params * 4 + sum(t.num_bytes for t in terms)
    assert abs(predicted / measured - 1) < TOLERANCE, (predicted, measured)

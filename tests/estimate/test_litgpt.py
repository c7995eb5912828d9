"""model_code litgpt (memfit.estimate.litgpt) against one real step of LitGPT's own GPT on CPU: a tiny grouped-query
Llama shape with LoRA on q and v in bf16-true, stepped as litgpt finetune_lora steps it (Fabric, 128-token head
chunks, chunked_cross_entropy, AdamW), the profiler's peak (bench/litgpt_recipes.py runs the whole matrix)."""

from __future__ import annotations

import warnings

import pytest
import yaml

from memfit._torch.measure_cpu import profiled_peak
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.readers import read_config
from memfit.setup import ModelCode, TrainingSetup
from memfit.sources import resolve_model

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
litgpt_lora = pytest.importorskip("litgpt.lora")
litgpt_utils = pytest.importorskip("litgpt.utils")

H, I, LAYERS, HEADS, GROUPS, VOCAB, BATCH, SEQ = 64, 128, 2, 4, 2, 512, 2, 256


def _litgpt_peak() -> int:
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    config = litgpt_lora.Config(
        name="tiny", block_size=512, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
        n_embd=H, n_query_groups=GROUPS, rotary_percentage=1.0, parallel_residual=False, bias=False,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=I, lora_r=8, lora_alpha=16,
        lora_dropout=0.0, lora_query=True, lora_key=False, lora_value=True)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            with fabric.init_module():
                model = litgpt_lora.GPT(config)
            litgpt_lora.mark_only_lora_as_trainable(model)
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=2e-4, foreach=False))
            for _ in range(2):
                logits = model(batch, lm_head_chunk_size=128)
                logits[-1] = logits[-1][..., :-1, :]
                fabric.backward(litgpt_utils.chunked_cross_entropy(logits, batch[..., 1:]))
                optimizer.step()
                optimizer.zero_grad()
    return profiled_peak(prof)


def test_litgpt_model_code_sizes_litgpts_own_step(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump({
        "checkpoint_dir": "checkpoints/tiny/llama", "precision": "bf16-true", "devices": 1, "lora_r": 8,
        "lora_alpha": 16, "lora_dropout": 0.0, "lora_query": True, "lora_value": True,
        "train": {"global_batch_size": BATCH, "micro_batch_size": BATCH, "max_seq_length": SEQ}}))
    fields = {k: v for k, v in read_config(str(path)).overrides.items() if k != "num_gpus"}
    setup = TrainingSetup(**fields).replace(optimizer="adamw")
    assert setup.model_code is ModelCode.LITGPT  # the reader says whose code runs
    spec = resolve_model(dict(model_type="llama", hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=GROUPS, vocab_size=VOCAB,
                              max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5))
    cpu = make_hardware(cpu_device(64 * 1024**3))
    real = _litgpt_peak()
    litgpt = estimate(spec, setup, cpu).tensor_bytes
    hf = estimate(spec, setup.replace(model_code="hf"), cpu).tensor_bytes
    assert abs(litgpt - real) / real < 0.03, (litgpt, real)
    assert abs(hf - real) > 2 * abs(litgpt - real)  # the HF module's formulas miss what LitGPT's keeps


def test_litgpt_model_code_refuses_what_it_does_not_size_and_stays_out_of_default_json():
    with pytest.raises(ConfigError, match="model code litgpt"):
        TrainingSetup(model_code="litgpt", loss="chunked")
    assert "model_code" not in TrainingSetup().to_dict()  # answers that never name it read as before
    assert TrainingSetup(**{k: v for k, v in TrainingSetup(model_code="litgpt").to_dict().items()
                            if k != "notes"}).model_code is ModelCode.LITGPT

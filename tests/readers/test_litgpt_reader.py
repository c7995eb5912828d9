"""LitGPT's finetune configs (memfit.readers.litgpt), checked against litgpt itself: its setup() defaults, the LoRA
parameters its own GPT trains for the flags a config sets (vs the adapters memfit sizes for the same file), what its
recipes refuse, and the CLI reading the files."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.errors import ConfigError
from memfit.estimate.lora import adapted_spec
from memfit.finetune import BaseWeights, LoraRecipe, Method
from memfit.readers import detect_format, read_config
from memfit.readers.litgpt import FLAG_DEFAULTS
from memfit.setup import Checkpointing, Optimizer, Precision, TrainingSetup
from memfit.sources import resolve_model

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)


def _read(tmp_path, data: dict):
    path = tmp_path / "litgpt.yaml"
    path.write_text(yaml.safe_dump(data))
    return read_config(str(path))


def _config(**changes) -> dict:
    data = yaml.safe_load((CONFIGS / "litgpt_lora.yaml").read_text())
    data.update(changes)
    return data


def test_the_lora_file_reads_as_litgpt_runs_it():
    reading = read_config(str(CONFIGS / "litgpt_lora.yaml"))
    o = reading.overrides
    ft = o["finetune"]
    assert reading.model == "llama-3.2-1b"
    assert o["precision"] is Precision.BF16  # bf16-true: module.to(bf16), AdamW states bf16
    assert (o["micro_batch_size"], o["grad_accum_steps"], o["seq_len"]) == (4, 4, 512)
    assert (ft.method, ft.rank, ft.alpha, ft.dropout) == (Method.LORA, 16, 32.0, 0.05)
    assert set(ft.targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert ft.recipe is LoraRecipe.TORCHTUNE  # adapters in the model's dtype, nothing upcast
    assert o["optimizer"] is Optimizer.ADAMW_FOREACH


def test_the_qlora_file_is_bitsandbytes_without_kbit_prep_and_paged_adamw():
    o = read_config(str(CONFIGS / "litgpt_qlora.yaml")).overrides
    ft = o["finetune"]
    assert (ft.method, ft.base_storage("bf16"), ft.double_quant, ft.kbit_prep) == (
        Method.QLORA, BaseWeights.NF4, True, False)
    assert o["optimizer"] is Optimizer.PAGED_ADAMW  # instantiate_bnb_optimizer, whatever class_path says


def test_the_full_file_on_four_devices_shards_and_checkpoints():
    reading = read_config(str(CONFIGS / "litgpt_full.yaml"))
    o = reading.overrides
    assert reading.model == "llama-3.2-3b" and "finetune" not in o
    assert o["num_gpus"] == 4 and o["sharding"].value == "zero3" and o["checkpointing"] is Checkpointing.FULL
    assert o["grad_accum_steps"] == 64 // 4 // 4


def test_defaults_are_litgpts_own(tmp_path):
    """A config that leaves the LoRA settings out reads as finetune_lora's setup() defaults."""
    lora = pytest.importorskip("litgpt.finetune.lora")
    defaults = {k: p.default for k, p in inspect.signature(lora.setup).parameters.items()}
    assert FLAG_DEFAULTS == {k: defaults[k] for k in FLAG_DEFAULTS}
    ft = _read(tmp_path, {k: v for k, v in _config().items()
                          if not k.startswith("lora_") or k == "lora_query"}).overrides["finetune"]
    assert (ft.rank, ft.alpha, ft.dropout) == (defaults["lora_r"], defaults["lora_alpha"], defaults["lora_dropout"])
    assert set(ft.targets) == {"q_proj", "v_proj"}  # lora_query, and lora_value's default True


@pytest.mark.parametrize("flags", [dict(lora_query=True, lora_value=True),
                                   dict(lora_query=True, lora_key=True, lora_value=True, lora_projection=True,
                                        lora_mlp=True),
                                   dict(lora_query=False, lora_value=False, lora_mlp=True)])
def test_the_adapters_sized_are_those_litgpts_gpt_trains(flags, tmp_path):
    """litgpt.lora.GPT built from the same shape and flags: its trainable (lora_*) parameters, counted, against the
    adapters memfit sizes for the Hugging Face model of that shape read from the same config."""
    pytest.importorskip("torch")
    litgpt_lora = pytest.importorskip("litgpt.lora")
    import torch

    all_flags = {**{k: False for k in FLAG_DEFAULTS}, **flags}
    config = litgpt_lora.Config(name="tiny", block_size=512, vocab_size=512, padded_vocab_size=512, n_layer=2,
                                n_head=4, n_embd=64, n_query_groups=2, rotary_percentage=1.0, bias=False,
                                parallel_residual=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                                intermediate_size=128, lora_r=8, lora_alpha=16, lora_dropout=0.0, **all_flags)
    with torch.device("meta"):
        model = litgpt_lora.GPT(config)
    litgpt_lora.mark_only_lora_as_trainable(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reading = _read(tmp_path, _config(lora_r=8, **all_flags))
    setup = TrainingSetup(finetune=reading.overrides["finetune"])
    sized = sum(p.total for p in adapted_spec(resolve_model(dict(TINY)), setup).params)
    assert sized == trained


def test_the_precision_decides_the_lora_storage(tmp_path):
    mixed = _read(tmp_path, _config(precision="bf16-mixed")).overrides
    assert mixed["precision"] is Precision.AMP_BF16
    assert mixed["finetune"].base is BaseWeights.FP32 and mixed["finetune"].recipe is LoraRecipe.PEFT  # fp32 module
    default = _read(tmp_path, {k: v for k, v in _config().items() if k != "precision"}).overrides
    assert default["precision"] is Precision.AMP_BF16  # get_default_supported_precision(training=True)


@pytest.mark.parametrize("changes,says", [
    (dict(precision="bf16-mixed", quantize="bnb.nf4"), "refuses --quantize with a mixed precision"),
    (dict(quantize="bnb.nf4", devices=2), "refuses --quantize on more than one device"),
    (dict(quantize="gptq"), "--quantize takes bnb.nf4"),
    (dict(lora_head=True), "output head"),
    (dict(precision="transformer-engine"), "Transformer Engine"),
    (dict(precision="16-true"), "16-true trains fp16"),
    (dict(lora_query=False, lora_value=False, lora_projection=False, lora_mlp=False), "nothing is trained"),
    (dict(train={"micro_batch_size": 3, "global_batch_size": 16}), "not a multiple of micro_batch_size"),
    (dict(checkpoint_dir="checkpoints/tiiuae/falcon-7b"), "fuses q, k and v in query_key_value"),
])
def test_what_litgpt_or_memfit_refuses_is_one_line(changes, says, tmp_path):
    with pytest.raises(ConfigError, match=says.replace("-", r"\-").replace("(", r"\(")) as error:
        _read(tmp_path, _config(**changes))
    assert "\n" not in str(error.value)


def test_detected_from_its_keys_and_not_as_axolotl():
    data = yaml.safe_load((CONFIGS / "litgpt_lora.yaml").read_text())
    assert detect_format(data) == "litgpt"  # lora_r alone would read as axolotl
    assert detect_format({"checkpoint_dir": "x", "lora_r": 8, "base_model": "y"}) != "litgpt"


def test_cli_sizes_a_litgpt_config(monkeypatch):
    monkeypatch.chdir(CONFIGS)
    result = CliRunner().invoke(app, ["estimate", "--config", "litgpt_qlora.yaml", "--gpu", "A10G"])
    assert result.exit_code == 0, result.output
    assert "llama-3.2-1b" in result.output and "paged-adamw" in result.output



def test_cli_refuses_what_litgpt_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(_config(quantize="bnb.nf4", devices=2)))
    result = CliRunner().invoke(app, ["estimate", "--config", "q.yaml"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "refuses --quantize on more than one device" in result.output

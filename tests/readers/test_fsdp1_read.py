"""FSDP1 as the configs name it: accelerate's FSDP config without fsdp_version (accelerate's FSDP1) or with 1, the
HF Trainer's fsdp_config version 1, axolotl's fsdp block; FSDP2 where they say 2 or the Trainer's default; what
FSDP1 is not sized for (QLoRA) read as before, FSDP2, with the reason on the entry."""

from __future__ import annotations

import pytest

from memfit.readers import read_config
from memfit.setup import TrainingSetup

ACCELERATE = """distributed_type: FSDP
num_processes: 2
mixed_precision: bf16
fsdp_config:
  fsdp_sharding_strategy: {strategy}
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_use_orig_params: true
"""


@pytest.mark.parametrize("version,strategy,expected", [
    ("", "FULL_SHARD", ("1", "zero3")), ("  fsdp_version: 1\n", "SHARD_GRAD_OP", ("1", "zero2")),
    ("  fsdp_version: 2\n", "FULL_SHARD", ("2", "zero3"))])
def test_accelerate_fsdp_version(version, strategy, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE.format(strategy=strategy) + version)
    reading = read_config("accelerate.yaml", num_gpus=2)
    setup = TrainingSetup(**{**reading.overrides, "num_gpus": 2})
    assert (setup.fsdp_version.value, setup.sharding.value, setup.engine.value) == (*expected, "torch")


@pytest.mark.parametrize("config,expected", [({"version": 1}, "1"), ({}, "2"), ({"version": 2}, "2")])
def test_trainer_fsdp_config_version(config, expected, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "args.json").write_text(json.dumps({"fsdp": "full_shard auto_wrap", "fsdp_config": config,
                                                    "bf16": True, "per_device_train_batch_size": 1}))
    reading = read_config("args.json", num_gpus=2)
    assert TrainingSetup(**{**reading.overrides, "num_gpus": 2}).fsdp_version.value == expected


def test_qlora_under_fsdp1_is_sized_as_fsdp2_and_says_why(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "axolotl.yml").write_text(
        "base_model: NousResearch/Llama-2-7b-hf\nload_in_4bit: true\nadapter: qlora\nlora_r: 8\nlora_alpha: 16\n"
        "lora_target_linear: true\nsequence_len: 512\nmicro_batch_size: 1\nbf16: true\n"
        "fsdp:\n  - full_shard\n  - auto_wrap\nfsdp_config:\n  fsdp_use_orig_params: false\n")
    reading = read_config("axolotl.yml", num_gpus=2)
    setup = TrainingSetup(**{**reading.overrides, "num_gpus": 2})
    assert setup.fsdp_version.value == "2" and setup.finetune.method.value == "qlora"
    notes = [note for entry in reading.read for note in ([entry.note] if isinstance(entry.note, str) else entry.note)]
    assert any("sized as FSDP2" in note and "QLoRA" in note for note in notes)


def test_lightning_fsdp_strategy_and_accelerate_plugin_read_as_fsdp1():
    """Lightning's FSDPStrategy is FullyShardedDataParallel with the blocks as units and use_orig_params=True
    (1-blocks); its ModelParallelStrategy runs fully_shard (2); accelerate's plugin without fsdp_version is FSDP1."""
    from types import SimpleNamespace

    from memfit.callbacks import setup_from_accelerator, setup_from_lightning

    FSDPStrategy = type("FSDPStrategy", (), {})
    ModelParallelStrategy = type("ModelParallelStrategy", (), {})
    for strategy, expected in ((FSDPStrategy(), "1-blocks"), (ModelParallelStrategy(), "2")):
        trainer = SimpleNamespace(precision="bf16-mixed", accumulate_grad_batches=1, num_devices=4, num_nodes=1,
                                  strategy=strategy)
        assert str(setup_from_lightning(trainer).fields.get("fsdp_version", "2")) == expected
    for version, expected in ((1, "1"), (2, "2")):
        plugin = SimpleNamespace(sharding_strategy="FULL_SHARD", reshard_after_forward=None, fsdp_version=version)
        accelerator = SimpleNamespace(gradient_accumulation_steps=1, num_processes=4, mixed_precision="bf16",
                                      state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=plugin))
        assert str(setup_from_accelerator(accelerator).fields.get("fsdp_version", "2")) == expected

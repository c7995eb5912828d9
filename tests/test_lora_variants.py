"""LoRA variants that peft switches on with one flag: rsLoRA (use_rslora: the scale alpha / sqrt(r), no memory),
through the option, the emitter, the readers and a real peft layer."""

from __future__ import annotations

import pytest

from tiny_configs import TINY_LLAMA

from memfit.emit.peft import lora_config_kwargs
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.finetune import Finetune
from memfit.hardware import cpu_device, make_hardware
from memfit.readers import read_config
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

CPU = make_hardware(cpu_device(64 * 1024**3))
SPEC = resolve_model(TINY_LLAMA)


def _lora(**changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=2, seq_len=64, precision="fp32", optimizer="adamw",
                         finetune=Finetune(method="lora", rank=8, alpha=16, targets=("all-linear",), **changes))


def test_rslora_changes_the_scale_of_a_real_peft_layer_and_not_one_byte_of_the_estimate():
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    rs, plain = _lora(rslora=True), _lora()
    assert estimate(SPEC, rs, CPU).to_dict()["terms"] == estimate(SPEC, plain, CPU).to_dict()["terms"]
    kwargs = lora_config_kwargs(rs)
    assert kwargs["use_rslora"] is True and "use_rslora" not in lora_config_kwargs(plain)
    layers = {}
    for name, setup in (("rs", rs), ("plain", plain)):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        layers[name] = peft.get_peft_model(model, peft.LoraConfig(**lora_config_kwargs(setup),
                                                                  )).base_model.model[0]
    assert layers["rs"].scaling["default"] == pytest.approx(16 / 8 ** 0.5)  # Kalajdzievski 2023, eq. 2
    assert layers["plain"].scaling["default"] == pytest.approx(16 / 8)
    numel = {name: sorted(p.numel() for p in layer.parameters()) for name, layer in layers.items()}
    assert numel["rs"] == numel["plain"]


@pytest.mark.parametrize("name, text", [
    ("axolotl.yaml", "base_model: m\nadapter: lora\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\npeft_use_rslora: true\n"),
    ("llamafactory.yaml", "model_name_or_path: m\nstage: sft\nfinetuning_type: lora\nlora_target: all\n"
                          "use_rslora: true\n"),
    ("adapter_config.json", '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], '
                            '"use_rslora": true}'),
])
def test_readers_take_use_rslora(tmp_path, monkeypatch, name, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    reading = read_config(name)
    assert reading.overrides["finetune"].rslora is True
    assert any(e.field.endswith("use_rslora") for e in reading.read)


def test_rslora_without_adapters_is_one_clear_error():
    with pytest.raises(ConfigError, match="add --method lora"):
        Finetune(rslora=True)

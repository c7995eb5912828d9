"""Lightning's precision plugins (memfit.readers.lightning): a real Fabric step on the CPU per plugin, profiled
(every allocation from building the module to the second optimizer step), against memfit's formulas for the memfit
precision the plugin is read as; and what each plugin really does to the parameters and AdamW's states."""

from __future__ import annotations

import warnings

import pytest

from memfit._torch.measure_cpu import profiled_peak
from memfit.callbacks import setup_from_lightning
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.readers._reader import Reader
from memfit.readers.lightning import lightning_precision, read_lightning_precision
from memfit.setup import Precision, TrainingSetup
from memfit.sources import resolve_model

CPU = make_hardware(cpu_device(64 * 1024**3))
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
B, T = 2, 64


def _fabric_step(precision: str):
    """Peak bytes of a Fabric loop (init_module, setup, 2 AdamW steps), the parameters' and a state's dtype."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # on the CPU accelerator Fabric turns '16-mixed' into bf16-mixed: the plugin itself runs fp16 autocast there
    kwargs = dict(plugins=MixedPrecision("16-mixed", "cpu")) if precision == "16-mixed" else dict(precision=precision)
    fabric = Fabric(accelerator="cpu", devices=1, **kwargs)
    config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    batch = torch.randint(0, TINY["vocab_size"], (B, T))
    with warnings.catch_warnings(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                           profile_memory=True) as prof:
        warnings.simplefilter("ignore")
        with fabric.init_module():
            model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        model, optimizer = fabric.setup(model, optimizer)
        model.train()
        for _ in range(2):
            fabric.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    state = next(iter(optimizer.state.values()))
    return profiled_peak(prof), next(model.parameters()).dtype, state["exp_avg"].dtype


@pytest.mark.parametrize("plugin,param_dtype", [("32-true", "float32"), ("bf16-true", "bfloat16"),
                                                ("bf16-mixed", "float32"), ("16-mixed", "float32")])
def test_a_fabric_step_per_plugin_is_memfits_formula_for_its_precision(plugin, param_dtype):
    peak, params, states = _fabric_step(plugin)
    assert str(params) == str(states) == f"torch.{param_dtype}"  # AdamW's states follow the (converted) parameters
    precision = lightning_precision(plugin)
    setup = TrainingSetup(precision=precision, micro_batch_size=B, seq_len=T, optimizer="adamw")
    predicted = estimate(resolve_model(dict(TINY)), setup, CPU).tensor_bytes
    assert abs(predicted - peak) / peak < 0.005, (plugin, precision, predicted, peak)


def test_the_plugins_read_as_memfit_precisions():
    assert lightning_precision("bf16-true") is Precision.BF16  # not bf16 + fp32 master: the states are bf16
    assert lightning_precision("bf16") is Precision.AMP_BF16  # the legacy alias is bf16-mixed
    assert lightning_precision(16) is Precision.AMP_FP16
    assert lightning_precision("32-true", module_dtype="bf16") is Precision.BF16  # 32-true keeps the module's dtype
    for refused in ("16-true", "transformer-engine", "64-true", "fp8"):
        assert not isinstance(lightning_precision(refused), Precision)


def test_a_refused_plugin_is_one_clear_line():
    with pytest.raises(ConfigError, match="transformer-engine swaps the Linears") as error:
        read_lightning_precision(Reader(file="x.yaml", strict=True), "transformer-engine", "precision")
    assert "\n" not in str(error.value)


def test_the_lightning_callback_reads_bf16_true_as_pure_bf16():
    class Trainer:
        precision, accumulate_grad_batches, num_devices, num_nodes, strategy = "bf16-true", 1, 1, 1, None

    read = setup_from_lightning(Trainer())
    assert read.fields["precision"] is Precision.BF16
    Trainer.precision = "transformer-engine"
    read = setup_from_lightning(Trainer())
    assert "precision" not in read.fields and any("transformer-engine" in text for text in read.ignored)


# ------------------------------------------------------------------------------------------- LightningCLI configs

def _cli(tmp_path, trainer: dict):
    import yaml

    from memfit.readers import read_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 0, "trainer": trainer,
                                    "model": {"class_path": "my.Module", "init_args": {"lr": 1e-3}}}))
    return read_config(str(path))


def test_the_deepspeed_strategy_names_are_lightnings_own():
    pytest.importorskip("lightning")
    import inspect

    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    from memfit.readers.lightning import _DEEPSPEED

    default_stage = inspect.signature(DeepSpeedStrategy).parameters["stage"].default
    for name, (stage, offload) in _DEEPSPEED.items():
        params = StrategyRegistry[name]["init_params"]
        assert (params.get("stage", default_stage), bool(params.get("offload_optimizer"))) == (stage, offload)


def test_a_lightning_cli_config_reads_its_trainer_block(tmp_path):
    o = _cli(tmp_path, {"devices": 4, "strategy": "deepspeed_stage_3", "precision": "bf16-mixed",
                        "accumulate_grad_batches": 2, "max_epochs": 3}).overrides
    # DeepSpeedPrecision turns bf16-mixed into DeepSpeed's bf16: bf16 weights, fp32 master copy
    assert (o["num_gpus"], o["sharding"].value, o["precision"], o["grad_accum_steps"]) == (
        4, "zero3", Precision.BF16_MASTER, 2)
    o = _cli(tmp_path, {"devices": 2, "strategy": "fsdp", "precision": "bf16-true"}).overrides
    assert (o["sharding"].value, o["precision"]) == ("zero3", Precision.BF16)
    o = _cli(tmp_path, {"precision": "16-mixed"}).overrides
    assert o["precision"] is Precision.AMP_FP16
    with pytest.raises(ConfigError, match="transformer-engine"):
        _cli(tmp_path, {"precision": "transformer-engine"})

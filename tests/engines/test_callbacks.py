"""memfit.check and MemfitCallback: what is read from TrainingArguments / an Accelerator / a DeepSpeed config, that
the prediction is the estimator's number for that setup, and a real HF Trainer run on CPU with the callback
(prediction recorded; raise mode stops before the first step; warn mode warns and trains)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memfit.api import as_spec
from memfit.callbacks import OutOfMemoryRisk, OutOfMemoryRiskWarning, check, setup_from_training_args
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import make_hardware
from memfit.plan import plan
from memfit.setup import Attention, Checkpointing, Engine, Offload, Optimizer, Precision, Sharding
from tiny_configs import TINY_LLAMA


@pytest.mark.processes
def test_import_needs_neither_torch_nor_transformers():
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None\n"
            "import memfit, memfit.callbacks\n"
            "print(callable(memfit.check), memfit.CheckResult.__name__)\n"
            "try:\n    memfit.callbacks.MemfitCallback\nexcept memfit.MemfitError as e:\n    print('needs:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["True CheckResult", "needs: MemfitCallback needs transformers: pip install "
                                        "transformers"]


@pytest.fixture
def tiny_model(torch_cpu):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**TINY_LLAMA)
    config.use_cache = False
    torch_cpu.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def training_args(tmp_path, **kwargs):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), use_cpu=True, max_steps=3, report_to=[], save_strategy="no",
                per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1, disable_tqdm=True,
                dataloader_num_workers=0, seed=0)
    return TrainingArguments(**{**base, **kwargs})


def test_check_reads_training_arguments(tiny_model, tmp_path):
    args = training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, bf16=True,
                         optim="adamw_torch", activation_checkpointing=True)
    result = check(tiny_model, args, gpu="A100-80GB", seq_len=128)
    s = result.setup
    assert (s.micro_batch_size, s.grad_accum_steps, s.seq_len) == (4, 3, 128)
    assert s.precision is Precision.AMP_BF16  # bf16=True over fp32 weights is autocast
    assert s.optimizer is Optimizer.ADAMW_FOREACH and s.checkpointing is Checkpointing.FULL
    assert s.attention is Attention.SDPA  # from model.config._attn_implementation
    hw = make_hardware("A100-80GB")
    assert result.estimate.total_bytes == estimate(as_spec(tiny_model), s, hw).total_bytes
    assert result.spec.num_params == sum(p.numel() for p in tiny_model.parameters())
    assert result.fits and result.first_change is None and result.plan.steps == ()
    assert any(m.startswith("per_device_train_batch_size=4 -> micro-batch 4") for m in result.mapped)
    assert "fits: needs" in result.summary().splitlines()[0]


def test_check_bf16_weights_are_pure_bf16_and_unknown_settings_are_listed(tiny_model):
    tiny_model.to(dtype=__import__("torch").bfloat16)
    read = setup_from_training_args({"bf16": True, "optim": "galore_adamw", "torch_compile": True,
                                     "per_device_train_batch_size": 2}, tiny_model)
    assert read.fields["precision"] is Precision.BF16 and "optimizer" not in read.fields
    assert any(i.startswith("optim='galore_adamw'") for i in read.ignored)
    assert read.fields["compile"] is True  # torch_compile is sized now (memfit.estimate.compiled)
    enable = getattr(tiny_model, "activation_checkpointing_enable", None) or tiny_model.gradient_checkpointing_enable
    enable()
    assert setup_from_training_args(None, tiny_model).fields["checkpointing"] is Checkpointing.FULL


def test_check_reads_a_deepspeed_config(tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
          "steps_per_print": 10}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    args = {"per_device_train_batch_size": 1, "bf16": True, "deepspeed": str(path)}
    result = check("llama-3.1-8b", args, gpu="H100", num_gpus=8, seq_len=2048)
    s = result.setup
    assert (s.sharding, s.offload, s.precision, s.engine, s.num_gpus) == (
        Sharding.ZERO3, Offload.OPTIMIZER, Precision.BF16_MASTER, Engine.DEEPSPEED, 8)
    assert result.hardware.world_size == 8
    assert result.estimate.total_bytes == estimate(as_spec("llama-3.1-8b"), s, result.hardware).total_bytes
    assert any("'steps_per_print'" in i for i in result.ignored)
    one = check("llama-3.1-8b", {"deepspeed": ds, "bf16": True}, gpu="H100", seq_len=2048)
    # one rank: ZeRO-3 with optimizer offload is DeepSpeed's ZeRO-Offload, which memfit sizes on one GPU
    assert (one.setup.sharding, one.setup.offload) == (Sharding.ZERO3, Offload.OPTIMIZER)
    assert one.estimate.total_bytes == estimate(as_spec("llama-3.1-8b"), one.setup, one.hardware).total_bytes
    plain = dict(ds, zero_optimization={"stage": 3})
    assert check("llama-3.1-8b", {"deepspeed": plain, "bf16": True}, gpu="H100", seq_len=2048).setup.sharding \
        is Sharding.ZERO3  # without offload too: DeepSpeed runs the stage at world size 1, and memfit sizes it
    fsdp = check("llama-3.1-8b", {"fsdp": "full_shard auto_wrap"}, gpu="H100", num_gpus=4, seq_len=1024)
    assert (fsdp.setup.sharding, fsdp.setup.engine) == (Sharding.ZERO3, Engine.TORCH)
    with pytest.raises(ConfigError, match="DeepSpeed config"):
        check("llama-3.1-8b", {"deepspeed": str(tmp_path / "missing.json")}, gpu="H100")


def test_check_plan_names_the_first_change():
    args = {"per_device_train_batch_size": 4, "bf16": True}
    result = check("llama-3.1-8b", args, gpu="A100-80GB", seq_len=2048)
    expected = plan(result.spec, result.setup, result.hardware, explicit=frozenset(
        {"micro_batch_size", "precision", "seq_len"}))
    assert not result.fits and result.plan.fits
    assert [st.title for st in result.plan.steps] == [st.title for st in expected.steps]
    assert result.first_change.title == expected.steps[0].title
    assert f"first change: {expected.steps[0].title}" in result.summary()


def test_check_on_cpu_needs_a_gpu(tiny_model):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: check() predicts for its device")
    with pytest.raises(ConfigError, match="gpu="):
        check(tiny_model, None, seq_len=64)


def test_check_accelerator(tiny_model):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from memfit.callbacks import check_accelerator

    AcceleratorState._reset_state(True)
    try:
        acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
        result = check_accelerator(tiny_model, acc, gpu="L4", batch_size=3, seq_len=256)
    finally:
        AcceleratorState._reset_state(True)
    s = result.setup
    assert (s.precision, s.grad_accum_steps, s.micro_batch_size, s.seq_len) == (Precision.AMP_BF16, 2, 3, 256)
    assert result.estimate.total_bytes == estimate(as_spec(tiny_model), s, make_hardware("L4")).total_bytes


# ------------------------------------------------------------------------------------------- a real Trainer run


def random_tokens(torch, n=16, seq=64, vocab=512):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq), generator=generator)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i].clone()}

    return Tokens()


def memfit_entries(state):
    return [e for e in state.log_history if any(k.startswith("memfit/") for k in e)]


def test_trainer_run_records_the_prediction(tiny_model, torch_cpu, tmp_path):
    from transformers import Trainer

    from memfit.callbacks import MemfitCallback

    args = training_args(tmp_path)
    callback = MemfitCallback(gpu="A100-80GB", seq_len=64)
    trainer = Trainer(model=tiny_model, args=args, train_dataset=random_tokens(torch_cpu), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 3
    expected = check(tiny_model, args, gpu="A100-80GB", seq_len=64)
    predicted, measured = memfit_entries(trainer.state)
    assert predicted["memfit/predicted_peak_bytes"] == expected.estimate.total_bytes > 0
    assert predicted["memfit/fits"] is True and predicted["memfit/gpu"] == "A100-80GB" and predicted["step"] == 0
    assert measured["step"] == 1 and measured["memfit/predicted_peak_bytes"] == expected.estimate.total_bytes
    if torch_cpu.cuda.is_available():
        assert measured["memfit/measured_allocated_bytes"] > 0
    else:
        assert measured["memfit/measured"] == "skipped" and "no CUDA" in measured["memfit/note"]
    assert callback.result.setup.micro_batch_size == 2 and callback.result.setup.grad_accum_steps == 2


def test_trainer_raise_mode_stops_before_the_first_step(tiny_model, torch_cpu, tmp_path):
    from transformers import Trainer

    from memfit.callbacks import MemfitCallback

    args = training_args(tmp_path)
    callback = MemfitCallback(raise_on_oom_risk=True, gpu="1MiB", seq_len=64)
    trainer = Trainer(model=tiny_model, args=args, train_dataset=random_tokens(torch_cpu), callbacks=[callback])
    before = [p.detach().clone() for p in tiny_model.parameters()]
    with pytest.raises(OutOfMemoryRisk, match="does not fit") as raised:
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch_cpu.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    result = callback.result
    assert not result.fits and result.diagnosis.budget_bytes == int(2**20 * 0.95)
    first = result.first_change
    assert first is not None and f"first change: {first.title}" in str(raised.value)


def test_trainer_warn_mode_warns_and_trains(tiny_model, torch_cpu, tmp_path):
    from transformers import Trainer

    from memfit.callbacks import MemfitCallback

    args = training_args(tmp_path, max_steps=1)
    trainer = Trainer(model=tiny_model, args=args, train_dataset=random_tokens(torch_cpu),
                      callbacks=[MemfitCallback(gpu="1MiB", seq_len=64)])
    with pytest.warns(OutOfMemoryRiskWarning, match="first change"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert memfit_entries(trainer.state)[0]["memfit/fits"] is False


def test_callback_without_a_gpu_on_cpu_skips_with_a_note(tiny_model, torch_cpu, tmp_path):
    if torch_cpu.cuda.is_available():
        pytest.skip("this machine has CUDA: the callback predicts for it")
    from transformers import Trainer

    from memfit.callbacks import MemfitCallback

    trainer = Trainer(model=tiny_model, args=training_args(tmp_path, max_steps=1),
                      train_dataset=random_tokens(torch_cpu), callbacks=[MemfitCallback()])
    trainer.train()
    first = memfit_entries(trainer.state)[0]
    assert first["memfit/prediction"] == "skipped" and "gpu=" in first["memfit/note"]


# ------------------------------------------------------------------------------------------- Lightning


def _lightning_module(model, torch_cpu):
    lightning = pytest.importorskip("lightning")

    class Wrapper(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch_cpu.optim.AdamW(self.model.parameters(), lr=1e-4)

    return Wrapper()


def _token_loader(torch_cpu, batch=2, seq=64, n=4):
    tokens = torch_cpu.randint(0, TINY_LLAMA["vocab_size"], (n * batch, seq))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    return torch_cpu.utils.data.DataLoader(data, batch_size=batch)


def test_lightning_run_predicts_from_trainer_module_and_batch(tiny_model, torch_cpu, tmp_path):
    lightning = pytest.importorskip("lightning")
    from memfit.callbacks import MemfitLightningCallback

    callback = MemfitLightningCallback(gpu="A100-80GB")
    trainer = lightning.Trainer(max_steps=2, accelerator="cpu", devices=1, precision="bf16-mixed",
                                accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                                callbacks=[callback])
    trainer.fit(_lightning_module(tiny_model, torch_cpu), _token_loader(torch_cpu))
    result = callback.result
    assert result is not None
    s = result.setup
    # read from the Trainer (precision, accumulation) and the first batch's shape (micro-batch x sequence)
    assert (s.micro_batch_size, s.seq_len, s.grad_accum_steps) == (2, 64, 2)
    assert s.precision is Precision.AMP_BF16  # bf16-mixed over fp32 weights: autocast
    expected = check(tiny_model, None, gpu="A100-80GB", seq_len=64, batch_size=2, grad_accum_steps=2,
                     precision="amp-bf16")
    assert result.estimate.total_bytes == expected.estimate.total_bytes and result.fits
    assert callback.measured is not None and callback.measured["memfit/predicted_peak_bytes"] == \
        expected.estimate.total_bytes


def test_lightning_raise_mode_stops_before_the_first_step(tiny_model, torch_cpu, tmp_path):
    lightning = pytest.importorskip("lightning")
    from memfit.callbacks import MemfitLightningCallback

    before = [p.detach().clone() for p in tiny_model.parameters()]
    trainer = lightning.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                                callbacks=[MemfitLightningCallback(raise_on_oom_risk=True, gpu="1MiB")])
    with pytest.raises(OutOfMemoryRisk, match="first change"):
        trainer.fit(_lightning_module(tiny_model, torch_cpu), _token_loader(torch_cpu))
    assert trainer.global_step == 0
    assert all(torch_cpu.equal(a, b) for a, b in zip(before, tiny_model.parameters()))

"""LoRA variants that peft switches on with one flag: rsLoRA (use_rslora: the scale alpha / sqrt(r), no memory) and
DoRA (use_dora: magnitude vectors, two more saved tensors per adapted Linear, the weight norm's forward transient),
through the option, the emitter, the readers, one real peft DoRA layer and real peft CPU steps."""

from __future__ import annotations

import contextlib

import pytest
from typer.testing import CliRunner

from lora_truth import LoraCase, alloc_trace, measure_lora_case, training_setup
from tiny_configs import TINY_CONFIGS, TINY_LLAMA

from memfit.cli.app import app
from memfit.estimate.dora import linear_transient_bytes

from memfit.emit.peft import lora_config_kwargs
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.finetune import Finetune
from memfit.hardware import cpu_device, make_hardware
from memfit.readers import read_config
from memfit.estimate.lora import adapted_spec
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


# --- DoRA ------------------------------------------------------------------------------------------------------

def _dora_linear(n_in: int, n_out: int, rank: int, dtype):
    import peft
    import torch

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(n_in, n_out, bias=False, dtype=dtype)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    model = peft.get_peft_model(One(), peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"],
                                                        use_dora=True))
    return model.train()


@pytest.mark.parametrize("n_in, n_out, base, autocast", [(512, 256, "fp32", False), (256, 512, "fp32", False),
                                                          (512, 256, "bf16", True), (512, 256, "fp32", True)])
def test_dora_weight_norm_transient_is_what_one_real_peft_layer_allocates(n_in, n_out, base, autocast):
    """One DoraLinearLayer forward on 2 tokens: its peak above the start is the weight-norm transient (the
    identity through the adapters, W + s BA): the formula within 1% (the tokens' own tensors are the rest; under
    autocast the base weight's bf16 cast, cached by autocast, stays to the end and is not part of the transient)."""
    torch = pytest.importorskip("torch")
    dtype = torch.float32 if base == "fp32" else torch.bfloat16
    model = _dora_linear(n_in, n_out, 8, dtype)
    x = torch.randn(1, 2, n_in, dtype=dtype, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            return model(x)

    trace = alloc_trace(forward)
    measured = trace["peak"] - (trace["end"] if autocast and base == "fp32" else 0)
    predicted = linear_transient_bytes(n_in, n_out, 8, autocast=autocast, base_bytes=4 if base == "fp32" else 2)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


DORA_CASES = [LoraCase(family="llama", rank=64, alpha=128, targets="all-linear", dora=True),
              LoraCase(family="llama", rank=16, alpha=32, targets="all-linear", base_dtype="bf16",
                       precision="amp-bf16", dropout=0.1, dora=True),  # DoRA's own F.linear and its bf16 cast
              LoraCase(family="gpt2", rank=16, alpha=32, targets="all-linear", dropout=0.1, dora=True)]


@pytest.mark.parametrize("case", DORA_CASES, ids=lambda c: c.label)
def test_dora_formulas_match_real_peft_cpu_steps(case):
    """Real peft DoRA models (tests/lora_truth.py, the HF Trainer recipe), two measured CPU steps: the magnitude
    vectors exactly, the peak within 2% (bench/results/lora_accuracy.md has the DoRA rows), and well above what
    plain LoRA would keep (the two B x T x out tensors per adapted Linear are what the formula adds)."""
    pytest.importorskip("peft")
    row = measure_lora_case(case)
    setup = training_setup(case).replace(finetune=Finetune(
        method="lora", rank=case.rank, alpha=case.alpha, dropout=case.dropout, targets=("all-linear",),
        base=case.base_dtype, dora=True))
    spec = TINY_CONFIGS[case.family]
    predicted = estimate(resolve_model(spec), setup, CPU)
    measured = row["peak_bytes_with_quant_state"]
    assert row["trainable_bytes"] == predicted.term("parameters").num_bytes
    magnitudes = [p for p in adapted_spec(resolve_model(spec), setup).params if "magnitude" in p.name]
    assert sum(4 * p.total for p in magnitudes) == row["trainable_bytes"] - estimate(
        resolve_model(spec), setup.replace(finetune=setup.finetune.replace(dora=False)), CPU).term(
        "parameters").num_bytes
    assert abs(predicted.tensor_bytes - measured) / measured < 0.02, (predicted.tensor_bytes, measured)
    plain = estimate(resolve_model(spec), setup.replace(finetune=setup.finetune.replace(dora=False)), CPU)
    assert measured - plain.tensor_bytes > 0.05 * measured


def test_dora_is_an_option_an_emitted_flag_and_refused_where_not_measured():
    peft = pytest.importorskip("peft")
    setup = _lora(dora=True)
    assert lora_config_kwargs(setup)["use_dora"] is True
    assert peft.LoraConfig(**lora_config_kwargs(setup)).use_dora
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["estimate", "llama-3.1-8b", "--method", "lora",
                                                            "--dora", "--gpu", "H100"])
    assert result.exit_code == 0 and "DoRA" in result.output, result.output
    assert Finetune(method="qlora", dora=True).dora  # sized on a 4-bit base: test_the_measured_4bit_dora_rows
    with pytest.raises(ConfigError, match="DoRA on an int8 base"):
        Finetune(method="qlora", base="int8", dora=True)
    assert setup.replace(checkpointing="full").finetune.dora  # sized: test_the_measured_checkpointed_dora_matrix
    assert setup.replace(num_gpus=8, sharding="zero3", engine="torch").finetune.dora  # FSDP2: bench/lora_fsdp.py
    with pytest.raises(ConfigError, match="DoRA under DeepSpeed ZeRO-2/3"):
        setup.replace(num_gpus=8, sharding="zero3", engine="deepspeed")
    bad = CliRunner().invoke(app, ["estimate", "llama-3.1-8b", "--method", "qlora", "--base", "int8", "--dora"])
    assert bad.exit_code == 2 and "DoRA" in bad.output


def test_the_measured_dora_matrix():
    """bench/results/lora_measured.json's DoRA rows (bench/lora_measure.py: llama / qwen2 / gpt2, r8 / r64,
    attention / all-linear, dropout 0 / 0.1, fp32 / amp-bf16 / bf16): every one within 2%."""
    import json
    from pathlib import Path

    from bench_scripts import load_bench

    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "lora_measured.json"
    cases = [c for c in json.loads(results.read_text())
             if c.get("dora") and not c["checkpointing"] and c["base_dtype"] in ("fp32", "bf16")]
    rows = [r for r in load_bench("lora_accuracy").rows(cases) if r[2] is not None]
    errors = [abs(p - m) / m for _, m, p, _ in rows]
    assert len(errors) >= 35
    assert max(errors) < 0.02, max(zip(errors, [r[0] for r in rows]))


def test_the_measured_checkpointed_dora_matrix():
    """DoRA with the Trainer's checkpointing (llama / qwen2 / gpt2 / bert, attention / all-linear, fp32 /
    amp-bf16, dropout): the recompute runs each adapted Linear's weight norm again inside backward
    (memfit.estimate.dora.recompute_locals_bytes). Median under 1%, every row within 3.5%."""
    import json
    import statistics
    from pathlib import Path

    from bench_scripts import load_bench

    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "lora_measured.json"
    cases = [c for c in json.loads(results.read_text())
             if c.get("dora") and c["checkpointing"] and c["base_dtype"] in ("fp32", "bf16")]
    rows = [r for r in load_bench("lora_accuracy").rows(cases) if r[2] is not None]
    errors = {label: abs(p - m) / m for label, m, p, _ in rows}
    assert len(errors) >= 17
    assert statistics.median(errors.values()) < 0.01
    assert max(errors.values()) < 0.035, max(errors, key=errors.get)


def test_the_measured_4bit_dora_rows():
    """DoRA on a bitsandbytes 4-bit base (peft dequantizes each weight for its norm: dequantize_module_weight;
    Linear4bit returns its input's dtype, so q/k/v's saved base output is fp32 after
    prepare_model_for_kbit_training): llama / qwen2 / gpt2, nf4 double-quant and fp4, amp-bf16 and fp32, with and
    without checkpointing. Unshared steps within 1%, checkpointed ones within 3.5% (GPT-2 all-linear 3.2% low)."""
    import json
    from pathlib import Path

    from bench_scripts import load_bench

    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "lora_measured.json"
    cases = [c for c in json.loads(results.read_text()) if c.get("dora") and c["base_dtype"] in ("nf4", "fp4")]
    rows = [r for r in load_bench("lora_accuracy").rows(cases) if r[2] is not None]
    assert len(rows) >= 14
    plain = [abs(p - m) / m for label, m, p, _ in rows if "/no-ckpt/" in label]
    checkpointed = [abs(p - m) / m for label, m, p, _ in rows if "/ckpt/" in label]
    assert len(plain) >= 8 and max(plain) < 0.01
    assert len(checkpointed) >= 6 and max(checkpointed) < 0.035

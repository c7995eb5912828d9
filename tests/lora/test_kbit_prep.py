"""QLoRA with and without peft's prepare_model_for_kbit_training (Finetune.kbit_prep, --no-kbit-prep): the
formulas and the trace against real measured CPU steps of a bitsandbytes 4-bit tiny Llama, the static memory of a
catalog model against its meta-device module, what is emitted, and bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from test_lora import CPU, _quant_state_bytes
from tiny_configs import TINY_CONFIGS

from memfit.cli.app import app
from memfit.estimate.analytic import estimate
from memfit.finetune import Finetune
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}


def invoke(*args: str):
    return CliRunner(env=NARROW).invoke(app, list(args))


def _setup(precision: str, checkpointing: str, kbit_prep: bool | None) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=2, seq_len=64, precision=precision, optimizer="adamw",
                         checkpointing=checkpointing,
                         finetune=Finetune(method="qlora", rank=8, targets=("all-linear",), kbit_prep=kbit_prep))


def _measured(setup: TrainingSetup) -> tuple[int, set]:
    """Two real steps under the profiler of a tiny Llama turned into the planned QLoRA model by memfit.apply_
    (bitsandbytes Linear4bit for real on CPU), and the dtypes of its frozen, unquantized parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.apply import apply_
    from memfit.measure import measure

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_CONFIGS["llama"]))
    assert apply_(model, setup)["finetune"].changed
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and type(p).__name__ != "Params4bit"}
    return measure(model, setup, steps=2).tensor_bytes + _quant_state_bytes(model), dtypes


@pytest.mark.parametrize("precision,checkpointing", [("amp-bf16", "none"), ("amp-bf16", "full"),
                                                     ("bf16", "none"), ("bf16", "full")])
def test_without_the_kbit_preparation_formulas_and_trace_match_a_real_step(precision, checkpointing):
    """No upcast: the embeddings, norms and head stay bf16, so the residual stream is bf16; the formulas within 2%
    (the QLoRA tolerance of tests/lora/test_lora.py), the trace (peft + FakeLinear4bit on fake tensors) within 1%."""
    import torch

    from memfit.trace import trace

    setup = _setup(precision, checkpointing, False)
    measured, dtypes = _measured(setup)
    assert dtypes == {torch.bfloat16}
    predicted = estimate(resolve_model(TINY_CONFIGS["llama"]), setup, CPU).tensor_bytes
    traced = trace(TINY_CONFIGS["llama"], setup, kernels="cpu").tensor_bytes
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)
    assert abs(traced - measured) / measured < 0.01, (traced, measured)


def test_the_preparation_is_what_the_default_sizes_and_costs_memory():
    """The default (kbit_prep None) is peft's upcast: fp32 frozen parameters, a larger real step, and its formula
    within 2% of that step too; kbit_prep True is the same Finetune figure."""
    import torch

    setup = _setup("amp-bf16", "none", None)
    prepared, dtypes = _measured(setup)
    assert dtypes == {torch.float32}
    bare, _ = _measured(_setup("amp-bf16", "none", False))
    assert prepared > bare * 1.1
    spec = resolve_model(TINY_CONFIGS["llama"])
    predicted = estimate(spec, setup, CPU).tensor_bytes
    assert abs(predicted - prepared) / prepared < 0.02
    assert estimate(spec, _setup("amp-bf16", "none", True), CPU).tensor_bytes == predicted


def test_a_70b_plan_without_the_preparation_holds_its_unquantized_parameters_in_bf16():
    """llama-3.1-70b QLoRA: the static parameters shrink by 2 bytes for every parameter bitsandbytes leaves
    unquantized (counted on the meta-device module: everything outside the blocks' Linears)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.sources.catalog import catalog_config

    config = AutoConfig.for_model(**catalog_config("llama-3.1-70b"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    in_blocks = {id(m.weight) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    unquantized = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    args = ("plan", "llama-3.1-70b", "--gpu", "48GB", "--method", "qlora", "-r", "16", "--lora-targets",
            "all-linear", "-b", "1", "-s", "2048", "--json")
    figures = {}
    for flag in ("--kbit-prep", "--no-kbit-prep"):
        result = invoke(*args, flag)
        assert result.exit_code in (0, 1), result.output
        data = json.loads(result.stdout)
        assert data["initial_setup"]["finetune"]["kbit_prep"] is (flag == "--kbit-prep")
        figures[flag] = data["initial_estimate"]["by_category"]["parameters"]
    assert figures["--kbit-prep"] - figures["--no-kbit-prep"] == 2 * unquantized


def test_the_emitted_setup_is_the_sized_one(tmp_path):
    """peft.json says prepare_model_for_kbit_training false, and the loading snippet calls it only when sized so;
    under full checkpointing it asks the input gradient the preparation would have asked."""
    from memfit.config_snippets import config_snippets
    from memfit.emit.peft import peft_file

    for checkpointing in ("none", "full"):
        bare = TrainingSetup(checkpointing=checkpointing, finetune=Finetune(method="qlora", kbit_prep=False))
        assert peft_file(bare).content["prepare_model_for_kbit_training"] is False
        code = config_snippets(bare)["model loading:"]
        assert "prepare_model_for_kbit_training(" not in code
        assert ("model.enable_input_require_grads()" in code) is (checkpointing == "full")
        prepared = bare.replace(finetune=bare.finetune.replace(kbit_prep=None))
        assert peft_file(prepared).content["prepare_model_for_kbit_training"] is True
        assert "prepare_model_for_kbit_training(model" in config_snippets(prepared)["model loading:"]


@pytest.mark.parametrize("content,kbit_prep", [
    # axolotl loaders/model.py: no preparation under FSDP, and the norms / embeddings cast back without it
    ("base_model: gpt2\nadapter: qlora\nload_in_4bit: true\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n"
     "fsdp_config:\n  fsdp_version: 2\n", False),
    ("base_model: gpt2\nadapter: qlora\nload_in_4bit: true\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n",
     False),
    ("base_model: gpt2\nadapter: lora\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n", None),
    # LLaMA-Factory: no peft preparation; upcast_layernorm's fp32 norms make an fp32 residual stream
    ("model_name_or_path: gpt2\nfinetuning_type: lora\nquantization_bit: 4\n", False),
    ("model_name_or_path: gpt2\nfinetuning_type: lora\nquantization_bit: 4\nupcast_layernorm: true\n", None),
])
def test_framework_configs_read_their_preparation(content, kbit_prep, tmp_path, monkeypatch):
    from memfit.readers import read_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.yaml").write_text(content)
    assert read_config("train.yaml").overrides["finetune"].kbit_prep is kbit_prep


@pytest.mark.parametrize("args,needle", [
    (("--method", "lora", "--no-kbit-prep"), "applies to a quantized base"),
    (("--no-kbit-prep",), "applies to a quantized base"),
    (("--method", "qlora", "--lora-recipe", "torchtune", "--kbit-prep"), "torchtune does not call"),
])
def test_bad_kbit_prep_input_is_one_line_and_exit_2(args, needle):
    result = invoke("plan", "llama-3.2-1b", *args)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output

"""torchtune's LoRA / QLoRA recipe (--lora-recipe torchtune): adapters in the model's dtype, nothing upcast, no input
gradient, a torchao NF4Tensor base. Checked against torchao's own NF4Tensor, real CPU steps of the recipe
(profiler memory events), the fake-tensor trace, memfit's torchtune reader and the CLI. The full matrix is
bench/torchtune_lora.py (bench/results/torchtune_lora.md)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.emit.peft import torchtune_model_fields
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.estimate.lora import adapted_spec, torchao_dequantize_bytes_per_elem
from memfit.finetune import Finetune, LoraRecipe
from memfit.hardware import cpu_device, make_hardware
from memfit.readers import read_config
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from torchtune_lora import CONFIGS, setup_of  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))


def _nf4_module():
    pytest.importorskip("torchao")
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def _inner_bytes(tensor) -> int:
    return sum(getattr(tensor, name).numel() * getattr(tensor, name).element_size()
               for name in tensor.__tensor_flatten__()[0])


@pytest.mark.parametrize("model", ["llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b"])
def test_nf4_storage_equals_torchao_nf4tensor_for_every_linear_shape(model):
    """Every quantized weight of a catalog model, built as torchao's real NF4Tensor (on fake tensors: the inner
    tensors' shapes and dtypes are to_nf4's own)."""
    nf4 = _nf4_module()
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = adapted_spec(resolve_model(model), TrainingSetup(finetune=Finetune(method="qlora", recipe="torchtune",
                                                                              targets=("all-linear",))))
    quantized = {p.name: p for p in spec.frozen if p.nbytes < p.numel}
    assert quantized, "no NF4 weight sized"
    shapes = {}
    for name, node in spec.graph.linears():
        base = getattr(node, "base", node)
        for key in (f"{name}.weight", f"{name}.base_layer.weight"):
            if key in quantized:
                shapes[key] = (base.out_features, base.in_features)
    assert set(shapes) == set(quantized)
    with FakeTensorMode():
        for key, shape in shapes.items():
            real = nf4.to_nf4(torch.empty(shape, dtype=torch.bfloat16))
            assert quantized[key].nbytes == _inner_bytes(real), key


def test_nf4_dequantization_transient_is_what_torchao_allocates():
    """The eager get_original_weight peak on a real CPU NF4Tensor (profiler allocation events)."""
    nf4 = _nf4_module()
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from memfit._torch.measure_cpu import _walk

    weight = nf4.to_nf4(torch.randn(256, 512, dtype=torch.bfloat16))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        weight.to(torch.bfloat16)
    events = sorted((e.start_time_ns, i, e.extra_fields.alloc_size) for i, e in enumerate(
        _walk(prof.profiler.kineto_results.experimental_event_tree())) if e.tag == _EventType.Allocation)
    live = peak = 0
    for _, _, size in events:
        live += size
        peak = max(peak, live)
    assert peak == torchao_dequantize_bytes_per_elem(2, compiled=False) * 256 * 512


def test_torchtune_storage_is_not_peft_storage():
    """The same QLoRA: peft's fp32 adapters and prepare_model_for_kbit_training's fp32 embeddings / head vs
    torchtune's bf16 ones (the difference P021 measured)."""
    spec = resolve_model("llama-3.2-3b")
    peft, tune = (TrainingSetup(precision="bf16", finetune=Finetune(method="qlora", rank=64, recipe=recipe,
                                                                     targets=("all-linear",)))
                  for recipe in ("peft", "torchtune"))
    a, b = adapted_spec(spec, peft), adapted_spec(spec, tune)
    assert sum(p.total for p in a.params) == sum(p.total for p in b.params)
    assert sum(p.nbytes * p.count for p in a.params) == 2 * sum(p.nbytes * p.count for p in b.params)
    embed = 128256 * 3072  # tied: the one unquantized matrix
    frozen_a, frozen_b = (sum(p.nbytes * p.count for p in s.frozen) for s in (a, b))
    assert frozen_a - frozen_b == pytest.approx(2 * embed, rel=0.01)


@pytest.mark.parametrize("case", [("llama", "lora", 8, "all-linear", 0.0, False),
                                  ("llama", "lora", 8, "attention", 0.1, True),
                                  ("qwen2", "qlora", 8, "all-linear", 0.0, False),
                                  ("llama", "qlora", 4, "attention", 0.0, True)])
def test_formulas_and_trace_match_a_real_torchtune_recipe_step(case):
    pytest.importorskip("peft")
    _nf4_module()
    from memfit.measure import measure
    from memfit.trace.run import trace

    setup = setup_of(*case)
    config = dict(CONFIGS[case[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure(config, setup, steps=2, device="cpu").allocated_bytes
        traced = trace(dict(config), setup, kernels="cpu").allocated_bytes
    formulas = estimate(resolve_model(dict(config)), setup, CPU).allocated_bytes
    assert abs(traced - measured) / measured < 0.005
    assert abs(formulas - measured) / measured < 0.02


def test_the_torchtune_reader_and_emitter_give_the_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reading = read_config(str(ROOT / "tests" / "data" / "configs" / "torchtune_qlora.yaml"))
    ft = reading.overrides["finetune"]
    assert ft.recipe is LoraRecipe.TORCHTUNE and ft.method.value == "qlora"
    setup = TrainingSetup(precision="bf16", finetune=ft)
    fields = torchtune_model_fields(setup)
    assert fields["lora_attn_modules"] == ["q_proj", "k_proj", "v_proj", "output_proj"]
    assert fields["apply_lora_to_mlp"] and fields["quantize_base"] and fields["lora_rank"] == 8
    # what memfit emits reads back as the same Finetune
    import yaml

    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(
        {"model": {"_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b", **fields}}))
    assert read_config("tune.yaml").overrides["finetune"] == ft


def test_bad_torchtune_input_is_one_clear_line():
    with pytest.raises(ConfigError, match="torchao NF4 only"):
        Finetune(method="qlora", base="int8", recipe="torchtune")
    tiny = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 256}
    with pytest.raises(ConfigError, match="multiple of 16,384"):
        estimate(resolve_model(tiny), TrainingSetup(finetune=Finetune(method="qlora", recipe="torchtune")), CPU)
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--lora-recipe", "unsloth"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--method", "full", "--lora-recipe", "torchtune"])
    assert result.exit_code == 2 and "add --method lora" in result.output
    result = CliRunner().invoke(app, ["estimate", "llama-3.2-1b", "--lora-recipe", "torchtune"])  # means LoRA
    assert result.exit_code == 0 and "(torchtune)" in result.output


@pytest.mark.slow
@pytest.mark.processes
def test_fsdp2_shards_torchaos_nf4_base_on_two_gloo_ranks(tmp_path):
    """torchtune's distributed QLoRA: memfit's FSDP2 engine over a torchao NF4 base (NF4Tensor shards and gathers its
    own inner tensors). Each rank's frozen shard is exact (the 16-entry table and the mean stay whole) and its peak
    within 3% of the formulas (bench/lora_fsdp.py has the other torchtune rows)."""
    _nf4_module()
    pytest.importorskip("peft")
    import json

    from torchrun_job import rank_results, run_ranks

    config = dict(CONFIGS["llama"], hidden_size=256, intermediate_size=512)  # an even count of NF4 factors
    fields = dict(micro_batch_size=2, seq_len=128, precision="bf16", optimizer="adamw", engine="torch", num_gpus=2,
                  sharding="zero3", finetune={"method": "qlora", "rank": 8, "alpha": 16, "targets": ["all-linear"],
                                              "recipe": "torchtune"})
    worker = ROOT / "tests" / "lora_fsdp_worker.py"
    out = run_ranks(worker, config, tmp_path, json.dumps({"tune": fields}), "2", timeout=600)
    setup = TrainingSetup(**fields)
    predicted = estimate(resolve_model(config), setup, make_hardware(cpu_device(64 * 1024**3), gpus_per_node=2))
    for rank in rank_results(out / "tune"):
        frozen = sum(p["bytes"] for p in rank["local"].values() if not p["trainable"])
        assert frozen == predicted.term("parameters/frozen").num_bytes
        assert abs(rank["peak_bytes"] - predicted.tensor_bytes) <= 0.03 * predicted.tensor_bytes
    with pytest.raises(ConfigError, match="do not divide by 2"):  # one quantization factor per weight
        estimate(resolve_model(dict(CONFIGS["llama"])), setup, make_hardware(cpu_device(64 * 1024**3),
                                                                            gpus_per_node=2))

"""LoRA / QLoRA on families memfit sizes by derived formulas (memfit.derive): the fits are traced with peft's
adapters on the 1- and 2-block copies (issue 20), checked against real CPU steps of the HF Trainer + peft recipe
(tests/lora_truth.py, profiler memory events); bench/lora_derived.py runs the whole matrix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lora_truth import LoraCase, measure_lora_case
from tiny_derived_configs import DERIVED_CONFIGS, QV_TARGETS

from memfit.derive.model import Adapters, KindFit, kind_adapters, kind_setup, setup_kind
from memfit.estimate.analytic import estimate
from memfit.estimate.lora import adapted_derived, adapted_spec
from memfit.finetune import Finetune
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

CPU = make_hardware(cpu_device(64 * 1024**3))


def _setup(case: LoraCase) -> TrainingSetup:
    quantized = case.base_dtype == "nf4"
    targets = ("all-linear",) if case.targets == "all-linear" else tuple(case.targets)
    finetune = Finetune(method="qlora" if quantized else "lora", rank=case.rank, alpha=case.alpha,
                        dropout=case.dropout, targets=targets, base=case.base_dtype, double_quant=case.double_quant)
    return TrainingSetup(micro_batch_size=case.batch, seq_len=case.seq, precision=case.precision,
                         optimizer=case.optimizer, checkpointing="full" if case.checkpointing else "none",
                         attention=case.attention, finetune=finetune)


CASES = [
    # a parallel-residual block with q/v adapters: block 0's frozen MLP keeps nothing (no gradient reaches it)
    LoraCase(family="gptj", targets=QV_TARGETS["gptj"], base_dtype="bf16", precision="amp-bf16"),
    # Falcon's FalconLinear is no plain nn.Linear: bitsandbytes leaves it unquantized, k-bit preparation makes it
    # fp32, so autocast casts each frozen weight per call
    LoraCase(family="falcon", targets=QV_TARGETS["falcon"], base_dtype="nf4", double_quant=True,
             precision="amp-bf16"),
    # checkpointing: OPT's embedding leaf is a tensor apart from block 0's input (learned positions added)
    LoraCase(family="opt", targets=QV_TARGETS["opt"], checkpointing=True),
    LoraCase(family="stablelm", targets="all-linear", base_dtype="nf4", double_quant=True, precision="amp-bf16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_derived_lora_estimate_matches_a_real_cpu_step(case, tmp_path, monkeypatch):
    pytest.importorskip("peft")
    if case.base_dtype == "nf4":
        pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    measured = measure_lora_case(case)["peak_bytes_with_quant_state"]
    spec = resolve_model(dict(DERIVED_CONFIGS[case.family]))
    assert spec.derived is not None
    setup = _setup(case)
    assert adapted_derived(adapted_spec(spec, setup))
    predicted = estimate(spec, setup, CPU).tensor_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_the_kind_of_a_full_fine_tune_is_unchanged_and_lora_adds_one_part():
    setup = TrainingSetup(precision="amp-bf16")
    assert setup_kind(setup, True) == "amp-bf16/sdpa/cpu"
    assert kind_adapters("amp-bf16/sdpa/cpu") is None
    ft = Finetune(method="qlora", rank=16, targets=("v_proj", "q_proj"), dropout=0.05)
    adapters = Adapters.of(ft, "bf16", ft.targets)
    kind = setup_kind(setup, True, adapters)
    assert kind == "amp-bf16/sdpa/cpu/lora,r16,q_proj+v_proj,4bit,dropout"
    assert kind_adapters(kind) == adapters
    traced, kernels = kind_setup(kind)
    assert kernels == "cpu" and traced.finetune.base.value == "nf4" and traced.finetune.targets == ("q_proj", "v_proj")
    assert traced.finetune.dropout > 0 and traced.finetune.upcasts_unquantized()
    off = Adapters.of(dataclasses.replace(ft, kbit_prep=False, targets=("all-linear",)), "bf16", ("all-linear",))
    assert off.key() == "lora,r16,all-linear,4bit,dropout,no-kbit-prep" and Adapters.from_key(off.key()) == off


def test_a_fit_without_lora_lines_serializes_as_before():
    data = {"kind": "fp32/sdpa/cpu", "block": {"attention": [1, 0, 0, 0]}, "head": [0, 0, 0, 0],
            "embedding": [0, 0, 0, 0], "temporaries": [[1, 0, 0, 0]], "fit_error": 0.0, "shapes": [],
            "versions": {}}
    fit = KindFit.from_dict(data)
    assert "lora" not in fit.to_dict() and json.loads(json.dumps(fit.to_dict())) == data


@pytest.mark.parametrize("finetune", [Finetune(method="qlora", base="int8"), Finetune(method="lora", dora=True),
                                      Finetune(method="lora", recipe="torchtune")])
def test_setups_the_trace_cannot_build_keep_the_formulas(finetune):
    spec = resolve_model(dict(DERIVED_CONFIGS["opt"]))
    assert not adapted_derived(adapted_spec(spec, TrainingSetup(finetune=finetune)))

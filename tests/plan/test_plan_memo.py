"""A plan remembers its estimates (memfit.plan.memoized): the ladder, its suggestions and their searches ask for the
same setups again. Remembering them must move no number: every plan here is made with the memo and without it and
the two `to_dict()` answers compared whole."""

from __future__ import annotations

import pytest

import memfit.plan as plan_module
from memfit.api import as_hardware, as_spec, typical_setup
from memfit.estimate.analytic import estimate
from memfit.finetune import Finetune
from memfit.plan import plan

CASES = [
    # model, GPU, GPUs per node, setup fields (explicit: a user's setup), what it exercises
    ("llama-3.1-8b", "A100-80GB", 1, {}),                                          # full, ladder to a fit
    ("llama-3.1-8b", "RTX-4090", 1, {"finetune": Finetune(method="lora")}),       # LoRA on 24 GB
    ("llama-3.1-8b", "RTX-4090", 1, {"finetune": Finetune(method="qlora")}),
    ("llama-2-70b", "L40S", 1, {"finetune": Finetune(method="qlora")}),           # QLoRA 70B on 48 GB
    ("llama-2-70b", "A100-80GB", 1, {}),                                          # no fit: GPU-count suggestions
    ("llama-2-70b", "A100-80GB", 8, {}),                                          # ZeRO over 8
    ("llama-3.1-70b", "H100-80GB", 8, {"finetune": Finetune(method="lora"), "seq_len": 8192}),
    ("mistral-7b", "L4", 1, {"finetune": Finetune(method="lora"), "micro_batch_size": 4}),
    ("mistral-7b", "A100-80GB", 8, {"micro_batch_size": 8, "seq_len": 4096}),
    ("qwen2.5-7b", "A10G", 1, {"finetune": Finetune(method="qlora"), "seq_len": 4096}),
    ("qwen2.5-7b", "H100-80GB", 1, {"micro_batch_size": 2}),
    ("gemma-2-9b", "L40S", 1, {"finetune": Finetune(method="lora", rank=64)}),
    ("gemma-2-9b", "A100-80GB", 8, {}),
    ("phi-3-mini", "RTX-4090", 1, {}),
    ("phi-3-mini", "A100-80GB", 1, {"micro_batch_size": 8, "seq_len": 2048}),            # fits as given
    ("llama-3.2-1b", "RTX-4090", 1, {"micro_batch_size": 4}),
    ("llama-3.2-1b", "T4", 1, {}),                                                # no bf16: fp16 default
    ("llama-2-13b", "A100-80GB", 1, {"finetune": Finetune(method="lora"), "micro_batch_size": 16}),
    ("llama-2-13b", "RTX-4090", 8, {}),
    ("mixtral-8x7b", "H100-80GB", 8, {"finetune": Finetune(method="qlora")}),    # MoE
    ("mixtral-8x7b", "A100-80GB", 1, {}),
]


def _plan(model: str, gpu: str, per_node: int, given: dict, estimator=estimate):
    spec, hardware = as_spec(model), as_hardware(gpu, gpus_per_node=per_node)
    setup = typical_setup(spec, hardware, **given)
    return plan(spec, setup, hardware, estimator=estimator, explicit=frozenset(given))


@pytest.mark.parametrize("model,gpu,per_node,given", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-{i}" for i, c in
                                                                 enumerate(CASES)])
def test_the_memo_moves_no_number(model, gpu, per_node, given, monkeypatch):
    remembered = _plan(model, gpu, per_node, given).to_dict()
    monkeypatch.setattr(plan_module, "memoized", lambda estimator: estimator)
    assert _plan(model, gpu, per_node, given).to_dict() == remembered


def test_the_cases_cover_fits_and_no_fits():
    fits = [_plan(*case).final_diagnosis.fits for case in CASES]
    assert any(fits) and not all(fits)


def test_each_setup_is_estimated_once_per_plan():
    """Counted at the estimator itself: with the memo a plan sizes each distinct (setup, hardware) once."""
    asked: list[tuple] = []

    def counting(spec, setup, hardware):
        asked.append((setup, setup.notes, hardware))
        return estimate(spec, setup, hardware)

    _plan("llama-2-70b", "L40S", 1, {"finetune": Finetune(method="qlora")}, estimator=counting)
    assert len(asked) == len(set(asked)) > 1
    asked.clear()
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patched:
        patched.setattr(plan_module, "memoized", lambda estimator: estimator)
        _plan("llama-2-70b", "L40S", 1, {"finetune": Finetune(method="qlora")}, estimator=counting)
    assert len(asked) > len(set(asked))  # without it the same setups are sized again

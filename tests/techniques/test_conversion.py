"""One runtime conversion per technique (memfit.techniques.convert): the model a trace builds (on fake tensors) and
the model apply_ makes of a plain build have the same structure (module classes, parameter names, dtypes, shapes,
trainability, checkpoint wrappers, HF's switch, attention implementation), for HF and plain-PyTorch models."""

from __future__ import annotations

import pytest

from memfit import TrainingSetup
from memfit.finetune import Finetune
from tiny_configs import TINY_CONFIGS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from memfit._torch import blocks  # noqa: E402
from memfit._torch.step import build_hf_model as plain_build, hf_checkpointing_is_on  # noqa: E402
from memfit.apply import apply_  # noqa: E402
from memfit.techniques.convert import CONVERSIONS, ORDER  # noqa: E402
from memfit.trace import session  # noqa: E402

BASE = TrainingSetup(micro_batch_size=2, seq_len=32, precision="fp32", optimizer="adamw")
SETUPS = {
    "full": BASE.replace(checkpointing="full"),
    "selective-op": BASE.replace(checkpointing="selective-op", precision="bf16"),
    "every-2": BASE.replace(checkpointing="every-2"),
    "attention": BASE.replace(checkpointing="attention", attention="eager"),
    "lora": BASE.replace(precision="amp-bf16", checkpointing="full", finetune=Finetune(method="lora", rank=4)),
}


@pytest.fixture(autouse=True)
def _one_thread(torch_cpu):
    """One intra-op thread (conftest)."""


def structure(model) -> dict:
    """What a conversion changes, as plain values."""
    found = blocks.find_blocks(model)
    return {
        "modules": [(name, type(module).__name__) for name, module in model.named_modules()],
        "parameters": [(name, str(p.dtype), p.requires_grad, tuple(p.shape)) for name, p in model.named_parameters()],
        "blocks": [(blocks.checkpoint_mode(b), blocks.is_core_checkpointed(b)) for b in found],
        "hf_checkpointing": hf_checkpointing_is_on(model),
        "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
    }


def test_every_item_has_one_registered_conversion():
    assert sorted(CONVERSIONS) == sorted(ORDER)


@pytest.mark.parametrize("name", SETUPS)
def test_the_traced_hf_model_is_what_apply_makes_of_a_plain_build(name):
    setup = SETUPS[name]
    config = TINY_CONFIGS["llama"]
    with FakeTensorMode():
        traced = session.build_hf_model(config, setup)
        traced_structure = structure(traced)
    applied_model = plain_build(config, BASE)
    assert structure(applied_model) != traced_structure  # the conversions have something to do
    applied = apply_(applied_model, setup)
    assert structure(applied_model) == traced_structure
    assert apply_(applied_model, setup).changed == ()  # and a second apply_ finds it done
    assert "checkpointing" in applied.changed


@pytest.mark.parametrize("name", ["full", "selective-op", "every-2"])
def test_the_traced_plain_module_is_what_apply_makes_of_it(name, make_plain_lm):
    setup = SETUPS[name]
    with FakeTensorMode():
        traced = session.build_module_session(make_plain_lm, setup, input_builder=lambda s: {
            "input_ids": torch.zeros(s.micro_batch_size, s.seq_len, dtype=torch.long)}).model
        traced_structure = structure(traced)
    model = make_plain_lm()
    apply_(model, setup)
    assert structure(model) == traced_structure
    assert any(mode for mode, _ in traced_structure["blocks"])

"""The analytic estimate against the fake-tensor trace of the real HF step at full size (7B-class shapes, no
memory needed), on CPU kernels like their CPU-sized formulas; bench/crosscheck.py holds the GPU-target matrix."""

import pytest

from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import catalog_config, resolve_model

pytest.importorskip("torch")
from memfit.trace import trace  # noqa: E402

CPU = make_hardware(cpu_device(8 * 1024**4))
CASES = [
    ("llama-2-7b", dict(precision="bf16", checkpointing="full"), 0.001),
    ("qwen2.5-0.5b", dict(precision="fp32", attention="eager", seq_len=1024), 0.001),
    ("gemma-2-2b", dict(precision="bf16", attention="eager", seq_len=1024), 0.001),
    ("pythia-1b", dict(precision="fp32"), 0.001),
    ("gpt2-large", dict(precision="bf16"), 0.03),  # GPT-2's dropouts: CPU masks follow the input dtype
]


@pytest.mark.parametrize("model,overrides,tolerance", CASES, ids=[c[0] for c in CASES])
def test_analytic_matches_trace_at_full_size(model, overrides, tolerance):
    setup = TrainingSetup(**{"micro_batch_size": 1, "seq_len": 1024, "optimizer": "adamw", **overrides})
    traced = trace(catalog_config(model), setup, kernels="cpu")  # CPU kernels, as the analytic side is sized for
    predicted = estimate(resolve_model(model), setup, CPU)
    error = (predicted.tensor_bytes - traced.tensor_bytes) / traced.tensor_bytes
    assert abs(error) <= tolerance, f"{model}: analytic {predicted.tensor_bytes:,} vs traced {traced.tensor_bytes:,}"

"""`memfit trace --compile` is refused with its reason, and the reason holds: under the tracer's dispatch mode
dynamo hands no frame to its backend, so a traced compiled step would be eager's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memfit import ConfigError, TrainingSetup  # noqa: E402
from memfit.trace import trace  # noqa: E402
from memfit.trace.tracker import StepTracker  # noqa: E402


def test_dynamo_compiles_nothing_under_the_tracker():
    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    def step(x):
        return (x * 2).sin().sum()

    torch._dynamo.reset()
    with StepTracker():
        step_under_tracker = torch.compile(step, backend=backend)
        step_under_tracker(torch.ones(8))
    assert compiled == []  # the frame ran eager
    torch._dynamo.reset()
    torch.compile(step, backend=backend)(torch.ones(8))
    assert len(compiled) == 1  # the same function compiles outside it
    torch._dynamo.reset()


def test_trace_refuses_compile_in_one_line_naming_why():
    with pytest.raises(ConfigError) as refused:
        trace({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 512}, TrainingSetup(compile=True))
    text = str(refused.value)
    assert "\n" not in text and "dispatch mode" in text and "memfit estimate --compile" in text

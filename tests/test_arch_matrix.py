"""A fast subset of bench/arch_matrix.py: one case per family class, formulas and trace against a real measured CPU
step (profiler memory events), plus bitsandbytes' CPU AdamW scratch against the profiler on one parameter."""

from __future__ import annotations

import pytest
from arch_configs import ARCH_CONFIGS

from memfit.estimate.analytic import estimate
from memfit.estimate.bnb_cpu import adam_step_scratch_bytes
from memfit.hardware import cpu_device, make_hardware
from memfit.measure import measure
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.trace import trace

CPU = make_hardware(cpu_device(64 * 1024**3))
FORMULA_TOLERANCE, TRACE_TOLERANCE = 0.05, 0.005
"""bench/arch_matrix.py's worst-case targets: formulas within 5% of the measured step, the trace within 0.5%."""

CASES = [
    ("falcon", {}),  # multi-query attention, parallel attention + MLP
    ("phi", {"precision": "amp-bf16"}),  # partial rotary, parallel residual
    ("gemma3_text", {"attention": "eager"}),  # sandwich norms, sliding-window layer, q/k norm
    ("deepseek_v2", {}),  # multi-head latent attention, dense first block, routed + shared experts
    ("olmoe", {"precision": "bf16", "checkpointing": "full"}),  # routed experts, q/k norm; checkpoints' RNG states
    ("opt", {"optimizer": "adamw-8bit"}),  # the step is the peak: bitsandbytes' CPU scratch
    ("opt", {"checkpointing": "full"}),  # the step is the peak: single-tensor AdamW's denominators
]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "derived"))


def _error(predicted: int, truth: int) -> float:
    return abs(predicted - truth) / truth


@pytest.mark.parametrize(("family", "overrides"), CASES,
                         ids=[f"{f}-{'-'.join(map(str, o.values())) or 'fp32'}" for f, o in CASES])
def test_formulas_and_trace_match_a_measured_cpu_step(family, overrides):
    config = ARCH_CONFIGS[family]
    setup = TrainingSetup(**{"micro_batch_size": 2, "seq_len": 64, "optimizer": "adamw", **overrides})
    measured = measure(dict(config), setup, steps=2).tensor_bytes
    predicted = estimate(resolve_model(dict(config)), setup, CPU).tensor_bytes
    traced = trace(dict(config), setup, kernels="cpu", steps=2).tensor_bytes
    assert _error(predicted, measured) < FORMULA_TOLERANCE, (predicted, measured)
    assert _error(traced, measured) < TRACE_TOLERANCE, (traced, measured)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("numel", [65_536 + 100, 2_048])  # 8-bit state, and below min_8bit_size (32-bit state)
def test_bnb_cpu_adam_scratch_matches_the_profiler(dtype, numel):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from torch._C._profiler import _EventType

    param = torch.nn.Parameter(torch.randn(numel, dtype=getattr(torch, dtype)))
    param.grad = torch.randn_like(param)
    optimizer = bnb.optim.AdamW8bit([param])
    optimizer.step()  # the states are created by the first step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    sizes, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first, in call order (as memfit._torch.measure_cpu walks it)
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            sizes.append((event.start_time_ns, len(sizes), event.extra_fields.alloc_size))
        stack.extend(reversed(event.children))
    live = peak = 0
    for _, _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    expected = adam_step_scratch_bytes(numel, param.element_size(), numel >= 4096)
    assert expected <= peak <= expected + 64  # + the step's scalar tensors

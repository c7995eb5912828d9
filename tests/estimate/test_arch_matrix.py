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
    ("falcon", {"precision": "fp32", "checkpointing": "full"}),  # the peak: block 0's recompute, its checkpoint held
    ("gptj", {}),  # the sin/cos position table buffer (max_positions x rotary_dim fp32)
    ("mixtral", {"precision": "bf16", "checkpointing": "full"}),  # CPU cast copy of bf16 expert rows x fp32 weights
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
    assert _error(predicted, measured) < TIGHT.get((family, *overrides.items()), FORMULA_TOLERANCE), (
        predicted, measured)
    assert _error(traced, measured) < TRACE_TOLERANCE, (traced, measured)


TIGHT = {("falcon", ("precision", "fp32"), ("checkpointing", "full")): 0.005, ("gptj",): 0.002}
"""Cases whose formulas were 4.1% (Falcon: block 0's recompute not modelled for derived families) and 0.7% (GPT-J:
no buffers) off before the mechanism was modelled; now +0.04% and +0.02%."""


def _profiled_peak(run) -> int:
    """The peak of the bytes `run()` allocates on the CPU beyond what was live before, from the profiler's
    allocation events in call order (as memfit._torch.measure_cpu walks them)."""
    import torch
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first, in call order
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            sizes.append((event.start_time_ns, len(sizes), event.extra_fields.alloc_size))
        stack.extend(reversed(event.children))
    live = peak = 0
    for _, _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


MIXED = {
    "bf16 rows x fp32 weights": lambda t: t["rows16"] * t["weights32"],  # transformers' MoE routing weights
    "fp32 + bf16": lambda t: t["rows32"] + t["rows16"],
    "fp32 += bf16": lambda t: t["rows32"].add_(t["rows16"]),
    "bf16 += fp32": lambda t: t["rows16"].add_(t["rows32"]),  # a temporary fp32 output too
    "where(c, bf16, fp32)": lambda t: torch_where(t["rows32"] > 0, t["rows16"], t["rows32"]),
    "bf16 x bf16": lambda t: t["rows16"] * t["rows16"],  # one dtype: nothing hidden
}


def torch_where(*args):
    import torch

    return torch.where(*args)


@pytest.mark.parametrize("case", MIXED)
def test_cpu_casts_of_mixed_dtype_ops_match_the_profiler(case):
    """What an op on operands of two dtypes allocates on a CPU device (TensorIterator's cast copies, below the
    dispatcher): the trace's StepTracker with CPU kernels against the profiler on the real op."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.trace.kernels import hidden_scratch
    from memfit.trace.tracker import StepTracker, _Kind

    def tensors():
        return {"rows16": torch.randn(256, 64, dtype=torch.bfloat16), "rows32": torch.randn(256, 64),
                "weights32": torch.randn(256, 1)}

    real = tensors()
    measured = _profiled_peak(lambda: MIXED[case](real))
    with FakeTensorMode():
        fake = tensors()
        tracker = StepTracker(hidden_scratch=hidden_scratch("cpu"))
        tracker.register_tree(fake, _Kind.INPUTS)
        with tracker:
            MIXED[case](fake)
    assert tracker.peak_bytes - sum(t.numel() * t.element_size() for t in fake.values()) == measured


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("numel", [65_536 + 100, 2_048])  # 8-bit state, and below min_8bit_size (32-bit state)
def test_bnb_cpu_adam_scratch_matches_the_profiler(dtype, numel):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")

    param = torch.nn.Parameter(torch.randn(numel, dtype=getattr(torch, dtype)))
    param.grad = torch.randn_like(param)
    optimizer = bnb.optim.AdamW8bit([param])
    optimizer.step()  # the states are created by the first step
    peak = _profiled_peak(optimizer.step)
    expected = adam_step_scratch_bytes(numel, param.element_size(), numel >= 4096)
    assert expected <= peak <= expected + 64  # + the step's scalar tensors


def test_derived_buffers_are_the_built_models():
    """A derived spec's buffer bytes (GPT-J's sin/cos table) against the real module at full depth."""
    pytest.importorskip("torch")
    from memfit._torch.step import build_hf_model

    config = dict(ARCH_CONFIGS["gptj"], n_layer=3)
    model = build_hf_model(dict(config), TrainingSetup())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffers == 1024 * 8 * 4  # n_positions x rotary_dim fp32
    assert resolve_model(dict(config)).buffer_bytes == buffers

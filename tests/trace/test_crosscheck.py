"""One truth: the formulas against the trace at full size, on the same target-device semantics (a fast subset of
bench/crosscheck.py), and what memfit says when they differ."""

import dataclasses

import pytest

from memfit.estimate.result import Category, Term
from memfit.hardware import make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import catalog_config, resolve_model
from memfit.verify import TOLERANCE, cross_check, traced_as

torch = pytest.importorskip("torch")
from memfit.trace import trace  # noqa: E402
from memfit.trace.kernels import device_kernels  # noqa: E402

H100 = make_hardware("H100")
H100_X8 = make_hardware("H100", gpus_per_node=8)
BASE = dict(micro_batch_size=1, seq_len=512, precision="bf16", optimizer="adamw")
X8 = dict(num_gpus=8)

# one case per family and per kind of semantics the two sides must share (kernels, layout, optimizer step)
CASES = {
    "gpt2 fp32 dropout (CUDA kernels)": ("gpt2", dict(precision="fp32")),
    "bert amp-bf16 ckpt": ("bert-base-uncased", dict(precision="amp-bf16", checkpointing="full")),
    "qwen2 eager amp-bf16": ("qwen2.5-0.5b", dict(precision="amp-bf16", attention="eager")),
    "neox bf16 foreach accum": ("pythia-160m", dict(optimizer="adamw-foreach", grad_accum_steps=2)),
    "llama zero3 torch foreach": ("llama-3.2-1b", dict(X8, sharding="zero3", engine="torch", optimizer="adamw-foreach",
                                                       checkpointing="full")),
    "llama zero2 deepspeed 8-bit": ("llama-3.2-1b", dict(X8, sharding="zero2", engine="deepspeed",
                                                         optimizer="adamw-8bit")),
    "llama zero3 torch offload": ("llama-3.2-1b", dict(X8, sharding="zero3", engine="torch", precision="bf16-master",
                                                       offload="optimizer+params")),
    "gpt2 ddp x8 torch": ("gpt2", dict(X8, engine="torch", precision="amp-bf16")),
    "bert zero3 torch (tied MLM head in the root unit)": ("bert-base-uncased", dict(X8, sharding="zero3",
                                                                                  engine="torch")),
    "gemma2 eager bf16 ckpt": ("gemma-2-2b", dict(attention="eager", checkpointing="full")),
    "phi3 bf16-master": ("phi-3-mini", dict(precision="bf16-master")),
    "mistral zero2 deepspeed offload": ("mistral-7b", dict(X8, sharding="zero2", engine="deepspeed",
                                                           precision="bf16-master", offload="optimizer")),
}


@pytest.fixture(scope="module")
def checks():
    done = {}

    def get(case: str):
        if case not in done:
            model, overrides = CASES[case]
            setup = TrainingSetup(**{**BASE, **overrides})
            hardware = H100_X8 if setup.num_gpus > 1 else H100
            done[case] = cross_check(resolve_model(model), setup, hardware, trace(catalog_config(model), setup))
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_formulas_match_the_trace_like_for_like(case, checks):
    check = checks(case)
    assert abs(check.error) <= TOLERANCE, (case, check.error, check.like_for_like.by_category(),
                                           check.traced.by_category())
    assert check.trusted == "analytic"
    assert "agree" in check.verdict()[0]


def test_zero3_foreach_optimizer_step_is_sharded(checks):
    """The README's ZeRO-3 example traced 401 GiB of optimizer 'temporaries' while DTensor derived output shapes on
    global-shape fake tensors. The step's temporaries are one parameter-sized buffer per rank (foreach sqrt)."""
    check = checks("llama zero3 torch foreach")
    from memfit.estimate.result import Phase

    traced_step = check.traced.phase_peaks[Phase.OPTIMIZER]
    predicted_step = check.like_for_like.phase_peaks[Phase.OPTIMIZER]
    assert abs(traced_step - predicted_step) / predicted_step < 0.005
    params = resolve_model("llama-3.2-1b").num_params
    assert traced_step < 6 * 2 * params / 8  # params, grads, 2 states and one temporary, each bf16 / 8 ranks


def test_deepspeed_rows_name_the_engine_terms_only_the_formulas_have(checks):
    check = checks("llama zero2 deepspeed 8-bit")
    assert check.traced_as.setup.sharding.value == "zero2"
    assert any("DeepSpeed" in line for line in check.verdict())
    assert check.engine_delta_bytes == check.asked.total_bytes - check.like_for_like.total_bytes != 0
    assert check.trusted_total_bytes == check.asked.total_bytes


def test_traced_as_maps_what_fsdp2_cannot_run():
    zero1 = traced_as(TrainingSetup(sharding="zero1", num_gpus=4, engine="torch"))
    assert zero1.setup.sharding.value == "zero2" and "ZeRO-1" in zero1.differences[0]
    ddp = traced_as(TrainingSetup(num_gpus=4, engine="torch"))
    assert ddp.setup.num_gpus == 1 and "DDP" in ddp.differences[0]
    one = traced_as(TrainingSetup())
    assert one.setup == TrainingSetup() and not one.differences


def test_a_disagreement_says_which_figure_is_trusted_and_why(checks):
    check = checks("gpt2 fp32 dropout (CUDA kernels)")
    extra = int(check.traced.tensor_bytes * 0.2)
    traced = dataclasses.replace(check.traced, terms=check.traced.terms + (
        Term("activations/unmodelled", Category.ACTIVATIONS, extra),))
    worse = dataclasses.replace(check, traced=traced)
    assert not worse.agrees and worse.trusted == "traced"
    assert worse.biggest_gap()[0] is Category.ACTIVATIONS
    first = worse.verdict()[0]
    assert "trusts the trace" in first and "activations" in first
    assert worse.trusted_total_bytes == traced.total_bytes


def test_cuda_kernels_keep_a_bool_dropout_mask_and_no_attention_matrix():
    """Under kernels='cuda' the saved tensors are those of CUDA's fused dropout and flash / efficient SDPA (their
    meta functions, on fake tensors), against the CPU kernels' choice; read with saved_tensors_hooks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def saved(kernels: str, dtype=torch.float32):
        seen = []
        with FakeTensorMode():
            x = torch.randn(2, 4, 64, 32, dtype=dtype, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append((t.dtype, t.numel())) or t,
                                                          lambda t: t), device_kernels(kernels):
                dropped = torch.nn.functional.dropout(x, 0.1, True)
                torch.nn.functional.scaled_dot_product_attention(dropped, x, x, dropout_p=0.1)
        return seen

    t_by_t, x_numel = 2 * 4 * 64 * 64, 2 * 4 * 64 * 32
    for dtype in (torch.float32, torch.bfloat16):  # memory-efficient kernel, flash kernel
        cpu, cuda = saved("cpu", dtype), saved("cuda", dtype)
        assert any(n == t_by_t for _, n in cpu)  # the math path keeps B x H x T x T
        assert not any(n == t_by_t for _, n in cuda)
        assert (torch.bool, x_numel) in cuda and (dtype, x_numel) in cpu
        assert (torch.bool, x_numel) not in cpu

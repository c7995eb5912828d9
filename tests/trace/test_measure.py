"""measure(): real CPU steps under torch.profiler. Every number is checked against something counted independently:
the profiler's own running total, parameter sizes, the optimizers' documented state layouts."""

from __future__ import annotations

import math

import pytest

from memfit import Category, ConfigError, Phase, TrainingSetup
from tiny_configs import TINY_CONFIGS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memfit._torch import threads  # noqa: E402
from memfit._torch.replay import PREEXISTING_TERM, Allocation, Mark, replay  # noqa: E402
from memfit._torch.step import build_hf_model, make_batch, make_optimizer, training_step  # noqa: E402
from memfit.measure import measure  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(torch_cpu):
    """One intra-op thread: on a loaded 2-core runner, OpenMP's spinning threads make tiny steps 10x slower."""


FP32_ADAMW = TrainingSetup(micro_batch_size=4, seq_len=128, precision="fp32", optimizer="adamw")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _param_bytes(model) -> int:
    return _storage_bytes(model.parameters())


def _profiler_peak(config: dict, setup: TrainingSetup, steps: int = 2) -> int:
    """The step's peak of live bytes straight from the profiler's counter, nothing of memfit's bookkeeping."""
    model = build_hf_model(config, setup)
    optimizer = make_optimizer(model, setup)
    generator = torch.Generator().manual_seed(0)
    batches = [make_batch(config, setup, generator=generator) for _ in range(setup.grad_accum_steps)]
    live_before = _storage_bytes([*model.parameters(), *model.buffers(), *(t for b in batches for t in b.values())])
    with torch.profiler.profile(profile_memory=True) as prof:
        for _ in range(steps):
            training_step(model, optimizer, batches, setup)
    counters = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation:
            counters.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated))
    counters.sort()
    offset = counters[0][2] - counters[0][1]
    return live_before + max(total - offset for _, _, total in counters)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_total_equals_the_profilers_own_peak_to_the_byte(family):
    config = TINY_CONFIGS[family]
    measured = measure(config, FP32_ADAMW)
    assert measured.method == "measured"
    assert measured.total_bytes == _profiler_peak(config, FP32_ADAMW)
    assert measured.total_bytes == max(measured.phase_peaks.values())
    assert measured.phase_peaks[measured.peak_phase] == measured.total_bytes


def test_onednn_scratch_is_its_own_term_and_the_tensor_figures_are_the_same_on_every_cpu(monkeypatch):
    """A bf16 matmul runs through oneDNN where the CPU has native bf16 (AVX512-BF16, AMX), with a scratchpad inside
    the op, and through ATen's own gemm without one elsewhere (AVX2 only; here: oneDNN switched off). The tensor
    figures are those of the step without the scratch, to the byte either way; the scratch is the overhead term that
    brings the total to the profiler's own peak. (A Llama classifier under autocast and checkpointing, on two threads:
    on a CPU with AMX its block backward's scratch raises the peak by 83,712 B; the scratch depends on the thread
    count too.)"""
    from memfit.sources.task import task_config

    setup = FP32_ADAMW.replace(precision="amp-bf16", checkpointing="full")
    config = task_config(TINY_CONFIGS["llama"], 2)
    torch.set_num_threads(2)  # the autouse fixture restores the count
    monkeypatch.setattr(threads, "MEASURE_THREADS", 2)  # measure's count (one by default), where oneDNN has scratch
    with_onednn = measure(config, setup)
    with torch.backends.mkldnn.flags(enabled=False):
        without = measure(config, setup)
    names = {t.name for t in without.terms}
    assert "overhead/onednn_scratch" not in names
    assert {t.name: t.num_bytes for t in with_onednn.terms if t.name != "overhead/onednn_scratch"} == {
        t.name: t.num_bytes for t in without.terms}
    assert with_onednn.tensor_bytes == without.tensor_bytes == without.total_bytes
    assert with_onednn.total_bytes == _profiler_peak(config, setup)
    scratch = sum(t.num_bytes for t in with_onednn.terms if t.name == "overhead/onednn_scratch")
    assert with_onednn.allocated_bytes == with_onednn.tensor_bytes + scratch


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
def test_parameters_and_adamw_state_are_exact(family):
    model = build_hf_model(TINY_CONFIGS[family], FP32_ADAMW)
    measured = measure(model, FP32_ADAMW)
    params = list(dict.fromkeys(model.parameters()))  # tied weights (qwen2, gpt2) once
    param_bytes = sum(p.numel() * 4 for p in params)
    assert measured.term("parameters").num_bytes == param_bytes == _param_bytes(model)
    buffers = _storage_bytes(model.buffers())
    assert measured.by_category()[Category.PARAMETERS] == param_bytes + buffers
    # torch AdamW: exp_avg + exp_avg_sq (2 x fp32 per parameter) + one fp32 `step` scalar per parameter tensor.
    assert measured.term("optimizer").num_bytes == 2 * param_bytes + 4 * len(params)
    assert measured.term("inputs").num_bytes == 2 * 4 * 128 * 8  # input_ids + labels, int64
    assert sum(t.num_bytes for t in measured.terms) == measured.total_bytes


def test_adamw_8bit_state_matches_the_bitsandbytes_layout():
    pytest.importorskip("bitsandbytes")
    setup = TrainingSetup(micro_batch_size=2, seq_len=64, precision="fp32", optimizer="adamw-8bit")
    model = build_hf_model(TINY_CONFIGS["llama"], setup)
    measured = measure(model, setup)
    expected = 2 * 256 * 4  # the two shared fp32 quantisation maps (signed and unsigned), 256 entries each
    for p in model.parameters():
        n = p.numel()
        # FACTS: uint8 state1/state2 + fp32 absmax per 256 elements; tensors under 4096 elements stay fp32.
        expected += 2 * n + 2 * 4 * math.ceil(n / 256) if n >= 4096 else 2 * 4 * n
    assert measured.term("optimizer").num_bytes == expected
    large = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
    per_param = (expected - 2048 - 8 * sum(p.numel() for p in model.parameters() if p.numel() < 4096)) / large
    assert per_param == pytest.approx(2.03, abs=0.01)  # FACTS: ~2.03 B/param


def test_bf16_master_keeps_an_fp32_copy_in_the_optimizer():
    setup = TrainingSetup(micro_batch_size=2, seq_len=64, precision="bf16-master", optimizer="adamw")
    model = build_hf_model(TINY_CONFIGS["llama"], setup)
    measured = measure(model, setup)
    numel = sum(p.numel() for p in model.parameters())
    assert measured.term("parameters").num_bytes == 2 * numel
    assert measured.term("optimizer/master_weights").num_bytes == 4 * numel
    assert measured.term("optimizer").num_bytes == 8 * numel + 4 * len(list(model.parameters()))


def test_gradient_accumulation_keeps_gradients_alive_between_micro_steps():
    setup = TrainingSetup(micro_batch_size=2, seq_len=64, grad_accum_steps=2, precision="fp32", optimizer="adamw")
    model = build_hf_model(TINY_CONFIGS["llama"], setup)
    measured = measure(model, setup)
    points = {p.label: p for p in measured.timeline}
    param_bytes = _param_bytes(model)
    assert points["step 2 micro 1 forward peak"].by_category[Category.GRADIENTS] == 0
    assert points["step 2 micro 2 forward peak"].by_category[Category.GRADIENTS] == param_bytes
    assert points["step 2 optimizer start"].by_category[Category.GRADIENTS] == param_bytes
    assert points["step 2 micro 1 forward start"].by_category[Category.OPTIMIZER] > 0  # created by step 1


def test_checkpointing_lowers_the_measured_peak():
    plain = measure(TINY_CONFIGS["llama"], FP32_ADAMW)
    checkpointed = measure(TINY_CONFIGS["llama"], FP32_ADAMW.replace(checkpointing="full"))
    assert checkpointed.total_bytes < 0.7 * plain.total_bytes
    assert checkpointed.term("activations").num_bytes < 0.5 * plain.term("activations").num_bytes
    assert checkpointed.static_bytes == plain.static_bytes


def test_eager_attention_costs_more_than_sdpa_at_long_sequences():
    setup = TrainingSetup(micro_batch_size=2, seq_len=256, precision="fp32", optimizer="adamw")
    sdpa = measure(TINY_CONFIGS["llama"], setup)
    eager = measure(TINY_CONFIGS["llama"], setup.replace(attention="eager"))
    scores_bytes = 2 * 4 * 256 * 256 * 4  # B x H x T x T fp32, one layer
    # Eager keeps each layer's softmax probabilities for backward; SDPA keeps only its output and log-sum-exp.
    extra = eager.term("activations").num_bytes - sdpa.term("activations").num_bytes
    assert extra == pytest.approx(2 * scores_bytes, rel=0.02)
    assert eager.total_bytes - sdpa.total_bytes == pytest.approx(2 * scores_bytes, rel=0.02)


def test_peak_is_at_the_start_of_backward_and_gradients_do_not_exist_yet():
    measured = measure(TINY_CONFIGS["llama"], FP32_ADAMW)
    assert measured.peak_phase is Phase.BACKWARD
    assert measured.term("gradients").num_bytes == 0
    logits_bytes = 4 * 128 * 512 * 4
    assert measured.term("temporaries").num_bytes >= 2 * logits_bytes  # d(logits) and the softmax gradient


def test_plain_module_needs_batches_and_is_measured_with_them(make_plain_lm):
    model = make_plain_lm()
    setup = TrainingSetup(micro_batch_size=2, seq_len=32, precision="fp32", optimizer="sgd")
    with pytest.raises(ConfigError, match="batches="):
        measure(model, setup)
    batch = make_batch({"vocab_size": 512}, setup)
    measured = measure(model, setup, batches=batch)
    assert measured.term("parameters").num_bytes == _param_bytes(model)
    assert measured.term("optimizer").num_bytes == _param_bytes(model)  # one momentum buffer


def test_replay_tags_storages_for_their_whole_life():
    events = [
        Mark(phase="forward", step=1, micro=1),
        Allocation(ptr=10, size_bytes=100),  # saved for backward
        Allocation(ptr=11, size_bytes=7),  # forward scratch
        Allocation(ptr=11, size_bytes=-7),
        Mark(phase="backward", step=1, micro=1),
        Allocation(ptr=12, size_bytes=50),  # the gradient
        Allocation(ptr=10, size_bytes=-100),
        Allocation(ptr=99, size_bytes=-5),  # live before, owned by nobody we know
        Mark(phase="optimizer", step=1, micro=1, tags={"gradients": (12,)}),
        Allocation(ptr=13, size_bytes=200),  # optimizer state, created in the step
        Allocation(ptr=12, size_bytes=-50),
        Mark(tags={"optimizer": (13,)}),
    ]
    result = replay([(1, 1000, "parameters")], events)
    assert result.baseline_bytes == 1005
    assert result.bytes_by_term(0) == {"parameters": 1000, "activations": 100, PREEXISTING_TERM: 5}
    assert result.bytes_by_term(1) == {"parameters": 1000, "activations": 100, "temporaries": 7, PREEXISTING_TERM: 5}
    assert result.bytes_by_term(6) == {"parameters": 1000, "gradients": 50, "optimizer": 200}
    assert result.bytes_by_term(7) == {"parameters": 1000, "optimizer": 200}
    assert result.bytes_at(result.peak_point) == 1005 + 100 + 50 + 200 - 100 - 5
    assert [s.phase for s in result.segments] == ["forward", "backward", "optimizer"]


def test_cuda_breakdown_names_the_static_terms_and_calls_the_rest_activations():
    from memfit._torch.measure_cuda import RESERVE_TERM, CudaSegment, cuda_breakdown

    static = {"parameters": 100, "gradients": 0, "optimizer": 200, "inputs": 10}
    with_grads = {**static, "gradients": 100}
    segments = [CudaSegment("forward", "step 1 forward", 500, 600, static),
                CudaSegment("backward", "step 1 backward", 800, 1000, with_grads),
                CudaSegment("optimizer", "step 1 optimizer", 700, 900, with_grads),
                CudaSegment("forward", "step 2 forward", 650, 1000, static)]
    result = cuda_breakdown(segments, preexisting_bytes=5, steps=2)
    assert result.peak_phase == "backward"
    assert result.peak_terms["activations"] == 800 - 410 - 5
    assert result.peak_terms[RESERVE_TERM] == 1000 - 800
    assert sum(v for k, v in result.peak_terms.items() if k != RESERVE_TERM) == 800
    assert result.phase_peaks == {"forward": 650, "backward": 800, "optimizer": 700}
    assert result.step_peaks == (800, 650)


def test_cuda_path_runs_end_to_end_against_a_stand_in_allocator(monkeypatch):
    """No GPU here: the allocator statistics are stood in for, to run the CUDA bookkeeping through real steps."""
    from memfit._torch import measure_cuda

    state = {"allocated": 1000, "peak": 1000}

    def reset(device=None):
        state["peak"] = state["allocated"]

    def peak(device=None):
        state["peak"] += 100  # every phase reaches 100 bytes above where it began
        return state["peak"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["peak"] + 50)
    setup = TrainingSetup(micro_batch_size=1, seq_len=16, grad_accum_steps=2, precision="fp32", optimizer="adamw")
    model = build_hf_model(TINY_CONFIGS["llama"], setup)
    result, losses = measure_cuda.measure_cuda_steps(model, make_optimizer(model, setup), make_batch(
        TINY_CONFIGS["llama"], setup), setup, steps=2, device=torch.device("cpu"))
    assert len(losses) == 2 and len(result.timeline) == 2 * 5  # (forward, backward) x 2 micro-steps + optimizer
    assert result.step_peaks == (1100, 1100)
    assert result.peak_terms[measure_cuda.RESERVE_TERM] == 50
    assert result.peak_terms[PREEXISTING_TERM] == 1000  # nothing the step owns is on a cuda device here


# ------------------------------------------------------------------------------ the step runner measure and trace share


@pytest.mark.parametrize("name, check", [
    ("adamw", lambda o: isinstance(o, torch.optim.AdamW) and o.defaults["foreach"] is False),
    ("adamw-foreach", lambda o: isinstance(o, torch.optim.AdamW) and o.defaults["foreach"] is True),
    ("adamw-fused", lambda o: isinstance(o, torch.optim.AdamW) and o.defaults["fused"] is True),
    ("sgd", lambda o: isinstance(o, torch.optim.SGD) and o.defaults["momentum"] == 0.9),
    ("adafactor", lambda o: o.defaults["relative_step"] and o.defaults["scale_parameter"] and o.defaults["lr"] is None
     and not o.defaults["warmup_init"]),
])
def test_make_optimizer_builds_what_the_setup_names(name, check):
    setup = TrainingSetup(micro_batch_size=1, seq_len=8, precision="fp32", optimizer=name)
    optimizer = make_optimizer(build_hf_model(TINY_CONFIGS["llama"], setup), setup)
    assert check(optimizer) and optimizer.memfit_notes == ()


def test_make_batch_shapes_and_labels():
    setup = TrainingSetup(micro_batch_size=3, seq_len=16)
    batch = make_batch(TINY_CONFIGS["bert"], setup, generator=torch.Generator().manual_seed(0))
    assert set(batch) == {"input_ids", "labels"}  # no attention_mask: no padding
    assert batch["input_ids"].shape == (3, 16) and int(batch["input_ids"].max()) < 512
    assert torch.equal(batch["labels"], batch["input_ids"])  # MLM: every position labelled
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()


def test_the_step_tells_transformers_the_batch_is_unpacked_so_fake_tensors_build_no_mask(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    setup = TrainingSetup(micro_batch_size=2, seq_len=32, precision="fp32", optimizer="sgd")
    with FakeTensorMode():
        model = build_hf_model(TINY_CONFIGS["llama"], setup)
        batch = make_batch(TINY_CONFIGS["llama"], setup)
        model(**batch)  # HF alone, on fake tensors: a B x 1 x T x T mask for every layer
        assert [tuple(m.shape) for m in masks] == [(2, 1, 32, 32)] * 2
        masks.clear()
        loss = training_step(model, make_optimizer(model, setup), batch, setup)
    assert masks == [None] * 2 and math.isnan(loss)

"""The thread count and the bytes a CPU step measures: torch's CPU flash attention allocates scratch per OpenMP
thread (memfit._torch.threads), so memfit measures every CPU step on MEASURE_THREADS threads whatever the machine,
its load or OMP_NUM_THREADS say. Checked against the profiler's own allocation events."""

from __future__ import annotations

import pytest

from memfit import TrainingSetup
from tiny_configs import TINY_CONFIGS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch._C._profiler import _EventType  # noqa: E402

from memfit._torch import threads  # noqa: E402
from memfit.measure import measure  # noqa: E402

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture(autouse=True)
def _restore_threads(torch_cpu):
    """torch_cpu puts the count back after each test, whatever the test set."""


def _scratch_peaks(prof) -> dict[str, int]:
    """For each flash op (forward, backward): the most bytes live at once among the allocations made and freed
    inside it (its outputs outlive it)."""
    peaks: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if not node.name.startswith(FLASH):
            continue
        allocations = sorted(_allocations_under(node), key=lambda c: c.start_time_ns)
        opened, scratch = {}, set()  # an allocation is scratch when its free follows inside the op
        for order, child in enumerate(allocations):
            if child.extra_fields.alloc_size > 0:
                opened[child.extra_fields.ptr] = order
            elif child.extra_fields.ptr in opened:
                scratch |= {opened.pop(child.extra_fields.ptr), order}
        live = peak = 0
        for order in sorted(scratch):
            live += allocations[order].extra_fields.alloc_size
            peak = max(peak, live)
        peaks[node.name] = peak
    return peaks


def _allocations_under(node):
    stack = list(node.children)
    while stack:
        child = stack.pop()
        stack.extend(child.children)
        if child.tag == _EventType.Allocation:
            yield child


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 2, 16, 8), (2, 4, 200, 32)])
def test_cpu_flash_attention_scratch_is_per_thread_as_its_kernel_sizes_it(dtype, shape):
    batch, heads, seq, head_dim = shape
    dt = getattr(torch, dtype)
    for count in (1, 2, 4):
        torch.set_num_threads(count)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dt, requires_grad=True) for _ in range(3))
        # oneDNN off: on a CPU with native bf16 the kernel's bf16 gemms take oneDNN's scratchpad too (measure_cpu)
        with torch.backends.mkldnn.flags(enabled=False), torch.profiler.profile(profile_memory=True) as prof:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
        peaks = _scratch_peaks(prof)
        size = dt.itemsize
        assert peaks[FLASH] == threads.flash_attention_scratch_bytes(seq, seq, head_dim, size, backward=False,
                                                                     threads=count)
        # the backward also copies grad_out, seen by the kernel as (B, S, H, D), to a contiguous tensor (one, not
        # per thread: flash_attention_backward_kernel_impl's grad_out.contiguous())
        grad_out_copy = batch * heads * seq * head_dim * size
        assert peaks[FLASH + "_backward"] == grad_out_copy + threads.flash_attention_scratch_bytes(
            seq, seq, head_dim, size, backward=True, threads=count)


def test_a_measured_cpu_step_does_not_depend_on_the_thread_count(monkeypatch):
    """torchtune's LoRA recipe on a tiny bf16 Llama with full checkpointing (bench/torchtune_lora.py): on a CPU with
    native bf16, two threads raised the profiler's peak by 15,464 B of oneDNN scratch before measure fixed the count.
    Measured with torch on 1 thread and on 2 (OMP_NUM_THREADS=2 too): the same bytes, term by term, and torch's
    count is put back after."""
    pytest.importorskip("peft")
    from memfit.finetune import Finetune

    config = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512,
              "tie_word_embeddings": False}
    lora = Finetune(method="lora", rank=4, alpha=8, dropout=0.0, targets=("all-linear",), recipe="torchtune")
    setup = TrainingSetup(micro_batch_size=2, seq_len=64, precision="bf16", optimizer="adamw", checkpointing="full",
                          attention="sdpa", finetune=lora)
    results = []
    for count in (1, 2):
        monkeypatch.setenv("OMP_NUM_THREADS", str(count))
        torch.set_num_threads(count)
        results.append(measure(dict(config), setup, steps=1, device="cpu"))
        assert torch.get_num_threads() == count
    one, two = results
    assert one.allocated_bytes == two.allocated_bytes
    assert {t.name: t.num_bytes for t in one.terms} == {t.name: t.num_bytes for t in two.terms}

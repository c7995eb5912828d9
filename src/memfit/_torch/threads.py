"""How many intra-op threads a measured CPU step gets: one, always, so that the bytes measured are the same on every
machine and under any load.

Why a fixed count: some of torch's CPU kernels allocate scratch per OpenMP thread, so the profiler's peak of a step
depends on `torch.get_num_threads()` (a GPU kernel has no such per-thread buffer):

- the CPU flash attention (aten::_scaled_dot_product_flash_attention_for_cpu and its backward, torch 2.13,
  aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) sizes `buf` and `buf_reduced` as [num_threads, ...]
  (`flash_attention_scratch_bytes` below gives the figure; checked to the byte against the profiler at 1, 2 and 4
  threads by tests/trace/test_measure_threads.py);
- oneDNN's bf16 matmul scratchpad on CPUs with native bf16 (measure_cpu keeps it out of the tensor figures, as a
  labelled overhead term), whose blocking depends on the thread count.

On an AVX512-BF16 CPU, torchtune's LoRA recipe (bench/torchtune_lora.py, llama/lora/r4/all-linear, full
checkpointing, one step) measured 1,892,732 B of tensors at 1, 2 and 4 threads alike, but its oneDNN scratch added 0,
15,464 and 82,280 B to the profiler's peak. The flash attention's buffers were live at no peak measured on one thread
(tiny Llama / Qwen2, fp32 / bf16, 64 / 256 tokens, with and without checkpointing: the peak without them is the
same), so the estimator has no CPU-only term for them: it would change no CPU comparison, and a GPU has no such
buffer. One thread is also what a loaded machine can give without stalling every parallel region at its barrier (a
parked thread holds the others up for a time slice). The user's OMP_NUM_THREADS / MKL_NUM_THREADS does not change
the measurement: torch's count is restored after the step.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch

MEASURE_THREADS = 1
"""torch's intra-op thread count while memfit measures a CPU step (measure(), the bench scripts, the tests)."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's limit), else os.cpu_count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def free_cpus(cpus: int | None = None, load: float | None = None) -> int:
    """CPUs not kept busy by other processes: usable CPUs less the 1-minute load average (rounded up from 0.5),
    at least 1. `cpus` and `load` default to this machine's."""
    cpus = usable_cpus() if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return cpus
    return max(1, min(cpus, cpus - math.floor(load + 0.5)))


@contextlib.contextmanager
def step_threads(threads: int | None = None) -> Iterator[int]:
    """torch's intra-op threads set to `threads` (default MEASURE_THREADS, read when called) inside the block,
    restored after; yields the count used."""
    threads = MEASURE_THREADS if threads is None else threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def flash_split_sizes(q_len: int, kv_len: int) -> tuple[int, int]:
    """The query and key/value block sizes of torch's CPU flash attention (FlashAttentionKernel.cpp,
    flash_attention_kernel_impl / _backward_impl: q blocks of 256 from 768 query tokens, 64 from 192, else 32;
    kv blocks of 512; each no larger than its sequence)."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def flash_attention_scratch_bytes(q_len: int, kv_len: int, head_dim: int, dtype_bytes: int, *, backward: bool,
                                  threads: int | None = None) -> int:
    """Bytes of per-thread scratch one CPU flash-attention call allocates and frees inside the op, for `threads`
    intra-op threads (torch 2.13, FlashAttentionKernel.cpp, without the fp16 oneDNN packing path).

    Forward (cpu_flash_attention): buf = threads x (q*kv + 2q + q*D) accumulators (fp32; fp64 for fp64 inputs) and,
    for bf16/fp16 inputs, buf_reduced = threads x q*kv elements of the input dtype. Backward
    (cpu_flash_attention_backward): buf = threads x 2*q*kv accumulators and buf_reduced = threads x 2*q*kv reduced
    elements; each worker thread also takes a dsum of q accumulators, which only the calling thread's profiler sees,
    counted once here. q, kv: flash_split_sizes."""
    threads = MEASURE_THREADS if threads is None else threads
    q, kv = flash_split_sizes(q_len, kv_len)
    accum = 8 if dtype_bytes == 8 else 4
    reduced = dtype_bytes if dtype_bytes < 4 else 0
    if backward:
        return threads * (accum * 2 * q * kv + reduced * 2 * q * kv) + accum * q
    return threads * (accum * (q * kv + 2 * q + q * head_dim) + reduced * q * kv)

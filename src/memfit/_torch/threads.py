"""How many intra-op threads a real CPU step gets: the cores nobody else is using now.

Why: torch's CPU kernels run OpenMP parallel regions with one thread per core, and every region waits at a barrier
for its slowest thread. On a machine where other processes keep the cores busy (a shared box, a CI runner running
tests in parallel), a thread that the kernel scheduler has parked holds every region up for a time slice: a GPT-2
step that takes 3 s on one thread took 15-30 s on two threads of a loaded 2-core machine, and far longer under the
profiler. The bytes measured do not change with the thread count (the tests measure on one thread). An explicit
OMP_NUM_THREADS (or MKL_NUM_THREADS) is the user's choice and is kept as it is.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch


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
def step_threads() -> Iterator[int]:
    """torch's intra-op threads set to the free CPUs inside the block (never more than torch had), restored after;
    yields the count used. Unchanged when the user set OMP_NUM_THREADS or MKL_NUM_THREADS."""
    before = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        yield before
        return
    threads = min(before, free_cpus())
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)

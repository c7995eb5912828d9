"""What one rank holds and peaks at, for the sharded-training example and tests: `local_bytes(prepared)` sorts a
rank's tensors into parameters / optimizer state / engine buffers, `PeakMeter` reads the rank's peak (profiler
memory events on CPU, the caching allocator on CUDA)."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import ConfigError
from ..setup import Engine, Offload
from .measure_cpu import _walk, matmul_scratch
from .storage import all_storage_tensors


def local_bytes(prepared: Any) -> dict:  # a memfit._torch.engine.Prepared (engine imports this module)
    seen: set[int] = set()
    totals = dict.fromkeys(("parameters", "optimizer", "optimizer_scalars", "master_weights", "gradient_buffers"), 0)

    def add(term: str, tensors) -> None:
        for local in all_storage_tensors(tensors):
            if local.device.type == "meta":
                continue
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                totals["optimizer_scalars" if term == "optimizer" and local.dim() == 0 else term] += storage.nbytes()

    module, optimizer = prepared.module, prepared.optimizer
    if prepared.engine is Engine.DEEPSPEED:
        # ZeRO-3: the partition is ds_tensor; parameters under the persistence threshold also stay whole (.data).
        add("parameters", [getattr(p, "ds_tensor", None) for p in module.parameters()])
        add("parameters", [p.data for p in module.parameters() if p.data.numel()])
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            add("master_weights", getattr(optimizer, name, None) or [])
        add("gradient_buffers", [getattr(optimizer, "grad_partitions_flat_buffer", None)])  # ZeRO-3, from init
        base = getattr(optimizer, "optimizer", optimizer)
    else:
        add("parameters", module.parameters())
        add("master_weights", getattr(optimizer, "master_params", ()))
        base = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
        base = getattr(base, "inner", base)  # memfit's bf16 master-weights wrapper
    add("optimizer", _state_tensors(base, skip=_param_ids(base)))
    if prepared.engine is Engine.DEEPSPEED and prepared.setup.offload is not Offload.NONE:
        totals.update(offload_inventory(module, optimizer))
    return totals


# Where DeepSpeed 0.19 puts each buffer of an offloaded step, by the device it asks for: "device" buffers are made on
# get_accelerator().current_device_name(), "host" ones on the CPU (pinned when offload pin_memory is on).
# stage_1_and_2.py DeepSpeedZeroOptimizer (ZeRO-1/2 + offload_optimizer):
_ZERO12_BUFFERS = (
    ("device", "bit16_params", "bit16_groups_flat"),  # __init__: the flat bf16/fp16 parameters stay on the device
    ("device", "gpu_offload_grad_buffer", "temp_grad_buffer_for_gpu_offload"),  # __init__: largest param x dtype
    ("host", "fp32_master", "single_partition_of_fp32_groups"),  # __init__: .to(self.device='cpu'), pinned
    ("host", "fp32_grads", "single_partition_of_fp32_groups.grad"),  # initialize_optimizer_states, pinned
    ("host", "bit16_param_copy", "param_buffer_of_bit16_for_cpu_offload_groups"),  # __init__, pinned
    ("host", "cpu_offload_grad_buffer", "temp_grad_buffer_for_cpu_offload"),  # __init__: largest param, pinned
    ("host", "accumulated_grads", "accumulated_grads_in_cpu"),  # async_accumulate_grad_in_cpu_via_gpu (accum > 1)
)
# stage3.py DeepSpeedZeroOptimizer_Stage3 (ZeRO-3 + offload_param + offload_optimizer):
_ZERO3_BUFFERS = (
    ("host", "bit16_param_partitions", "param_groups_fp16_flat_cpu_memory"),  # _create_param_groups_fp16_flat_...
    ("host", "fp32_master", "fp32_partitioned_groups_flat"),  # _create_fp32_partitions on subgroup_to_device=cpu
    ("host", "fp32_grads", "fp32_partitioned_groups_flat.grad"),  # initialize_optimizer_states, pinned
    ("host", "grad_partitions", "grad_partitions_flat_buffer"),  # _setup_for_real_optimizer on self.device=cpu
    ("device", "bit16_param_partitions", "lp_param_buffer"),  # only without offload_param
)


def offload_inventory(module, optimizer) -> dict[str, dict[str, int]]:
    """The buffers of a DeepSpeed ZeRO-Offload / ZeRO-Infinity rank by where DeepSpeed places them ("device" or
    "host"), each storage counted once: on a CPU-only run both are host memory, so this is how a test tells them
    apart. Adds the optimizer states (host: DeepSpeedCPUAdam steps them there), the reduce buckets (device) and, at
    ZeRO-3, the parameters DeepSpeed keeps whole on the device (those under stage3_param_persistence_threshold)."""
    seen: set[int] = set()
    out: dict[str, dict[str, int]] = {"offload_device": {}, "offload_host": {}}

    def add(where: str, name: str, tensors) -> None:
        for tensor in all_storage_tensors(tensors):
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                bucket = out["offload_" + where]
                bucket[name] = bucket.get(name, 0) + storage.nbytes()

    table = _ZERO3_BUFFERS if hasattr(optimizer, "fp32_partitioned_groups_flat") else _ZERO12_BUFFERS
    for where, name, attribute in table:
        owner, _, field = attribute.partition(".")
        value = getattr(optimizer, owner, None)
        values = list(value.values()) if isinstance(value, Mapping) else (
            value if isinstance(value, (list, tuple)) else [value])
        add(where, name, [getattr(v, field, None) for v in values] if field else values)
    for bucket in (getattr(optimizer, "ipg_buckets", None) or {}).values():
        buffer = getattr(bucket, "buffer", None)
        add("device", "reduce_buckets", buffer if isinstance(buffer, (list, tuple)) else [buffer])
    base = getattr(optimizer, "optimizer", optimizer)
    add("host", "optimizer_states", _state_tensors(base, skip=_param_ids(base)))
    persistent = [p.data for p in module.parameters() if getattr(p, "ds_persist", False) and p.data.numel()]
    add("device", "persistent_params", persistent)
    return out


def _param_ids(optimizer) -> set[int]:
    return {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]}


def _state_tensors(optimizer, *, skip: set[int]) -> list[torch.Tensor]:
    tensors = []
    for state in getattr(optimizer, "state", {}).values():
        values = state.values() if isinstance(state, Mapping) else ()
        tensors += [v for v in values if isinstance(v, torch.Tensor) and id(v) not in skip]
    return tensors


# ------------------------------------------------------------------------------------------------- peak meter


class PeakMeter:
    """Peak live tensor bytes on this rank while `window()` is open.

    CUDA: the caching allocator's max_memory_allocated. CPU: torch.profiler's allocation events (FACTS.md: exact to
    the byte). Enter the meter before building the model: the CPU count is every byte allocated since then and not
    freed, so DeepSpeed's internal flat buffers are counted without knowing where it keeps them. Only the calling
    thread's events are seen (the profiler is per thread; torch 2.13's profile_all_threads drops memory events): a
    buffer that a gloo worker thread frees stays counted, so `account_unseen_frees` bounds what that adds.
    """

    WINDOW = "memfit::window"

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.end_bytes = 0
        self.unseen_at_peak_bytes = 0
        self._profiler = None
        self._events: list[tuple[int, int, int, int]] = []
        self._window: tuple[int, int] | None = None

    def __enter__(self) -> "PeakMeter":
        if not torch.cuda.is_available():
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True, record_shapes=False, with_stack=False)
            self._profiler.__enter__()
        return self

    @contextlib.contextmanager
    def window(self):
        if self._profiler is None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
            self.end_bytes = torch.cuda.memory_allocated()
            return
        with torch.profiler.record_function(self.WINDOW):
            yield

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self._events, self._window = _allocation_events(self._profiler, self.WINDOW)
            self.peak_bytes, self.end_bytes, _ = _replay(self._events, self._window)

    def account_unseen_frees(self, live: Iterable[torch.Tensor]) -> int:
        """CPU: name the tensors really alive at the end (parameters, optimizer states...); every other block still
        counted at the end was freed where the profiler could not see (a gloo worker thread), at an unknown time.
        Sets and returns `unseen_at_peak_bytes`, those blocks' bytes inside `peak_bytes`: the true peak lies in
        [peak_bytes - unseen_at_peak_bytes, peak_bytes]."""
        if self._window is None:
            return 0
        real = {t.untyped_storage().data_ptr() for t in all_storage_tensors(live)}
        self.peak_bytes, self.end_bytes, self.unseen_at_peak_bytes = _replay(self._events, self._window, real)
        return self.unseen_at_peak_bytes


def _allocation_events(prof, window: str) -> tuple[list[tuple[int, int, int, int]], tuple[int, int]]:
    """The CPU allocation events (time, order, address, +-bytes) in time order, without oneDNN's matmul scratch, and
    the last `window` range."""
    from torch._C._profiler import _EventType

    allocations, windows = [], []
    walked = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    scratch = matmul_scratch(walked)  # oneDNN's bf16 matmul scratch: ISA-dependent, not a tensor (measure_cpu)
    for order, event in enumerate(walked):
        if order in scratch:
            continue
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            allocations.append((event.start_time_ns, order, fields.ptr, fields.alloc_size))
        elif event.name == window:
            windows.append((event.start_time_ns, event.end_time_ns))
    if not windows:
        raise ConfigError("PeakMeter: no window() was opened inside the meter")
    allocations.sort()
    return allocations, windows[-1]


def _replay(allocations, window: tuple[int, int], real_at_end: set[int] | None = None) -> tuple[int, int, int]:
    """(peak, at the end, unseen-freed bytes inside the peak) of live bytes inside `window`: allocations since
    profiling began, minus their frees (frees of storages allocated before profiling are ignored: their bytes were
    never counted). A block overwritten by a later allocation was freed unseen; with `real_at_end`, the addresses
    really alive at the end, so was a block allocated inside the window, still counted at the end and not among them.
    Those blocks' bytes counted at the peak are the third figure."""
    start, end = window
    ghosts: set[object] = set()
    if real_at_end is not None:
        live = _LiveBlocks()
        for time_ns, order, ptr, size_bytes in allocations:
            if time_ns > end:
                break
            if size_bytes > 0:
                ghosts.update(key for key, _ in live.allocate(ptr, size_bytes, key=(time_ns, order)))
            else:
                live.free(ptr)
        ghosts.update(key for ptr, key in live.keys.items() if key[0] >= start and ptr not in real_at_end)
    live = _LiveBlocks()
    peak = None
    ghost_bytes = ghost_at_peak = 0
    for time_ns, order, ptr, size_bytes in allocations:
        if time_ns > end:
            break
        if time_ns >= start and peak is None:
            peak = live.total_bytes  # live when the window opened
        if size_bytes > 0:
            ghost_bytes -= sum(size for _, size in live.allocate(ptr, size_bytes, key=(time_ns, order)))
            ghost_bytes += size_bytes if (time_ns, order) in ghosts else 0
        else:
            live.free(ptr)
        if peak is not None and live.total_bytes > peak:
            peak, ghost_at_peak = live.total_bytes, ghost_bytes
    return (live.total_bytes if peak is None else peak), live.total_bytes, ghost_at_peak


class _LiveBlocks:
    """Live allocations by address. The profiler sees only the profiled thread's frees: a tensor that a gloo worker
    thread frees (its reduce-scatter scratch, one block's unsharded gradients, released by whichever thread drops the
    work last) would stay 'live' forever. An allocation overlapping a block still counted as live proves that block
    was freed unseen, so it is dropped then; what is never reused is still over-counted (at most that block)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.bytes_by_start: dict[int, int] = {}
        self.keys: dict[int, object] = {}  # address -> the allocation event that made the block
        self.total_bytes = 0

    def allocate(self, ptr: int, size_bytes: int, key: object = None) -> list[tuple[object, int]]:
        """Count a new block; returns (key, bytes) of the blocks it overlaps, dropped as freed unseen."""
        dropped_blocks = []
        index = bisect.bisect_left(self.starts, ptr)
        if index > 0 and self.starts[index - 1] + self.bytes_by_start[self.starts[index - 1]] > ptr:
            index -= 1
        while index < len(self.starts) and self.starts[index] < ptr + size_bytes:
            dropped = self.starts.pop(index)
            dropped_bytes = self.bytes_by_start.pop(dropped)
            self.total_bytes -= dropped_bytes
            dropped_blocks.append((self.keys.pop(dropped, None), dropped_bytes))
        self.starts.insert(index, ptr)
        self.bytes_by_start[ptr] = size_bytes
        self.keys[ptr] = key
        self.total_bytes += size_bytes
        return dropped_blocks

    def free(self, ptr: int) -> None:
        size_bytes = self.bytes_by_start.pop(ptr, None)
        if size_bytes is None:
            return  # allocated before profiling (never counted) or already dropped
        del self.starts[bisect.bisect_left(self.starts, ptr)]
        self.keys.pop(ptr, None)
        self.total_bytes -= size_bytes

"""What one rank holds and peaks at, for the sharded-training example and tests: `local_bytes(prepared)` sorts a
rank's tensors into parameters / optimizer state / engine buffers, `PeakMeter` reads the rank's peak (profiler
memory events on CPU, the caching allocator on CUDA)."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from ..setup import Engine, Offload

if TYPE_CHECKING:
    from .engine import Prepared


def local_bytes(prepared: Prepared) -> dict:
    seen: set[int] = set()
    totals = dict.fromkeys(("parameters", "optimizer", "optimizer_scalars", "master_weights", "gradient_buffers"), 0)

    def add(term: str, tensors) -> None:
        for tensor in tensors:
            local = _local(tensor)
            if local is None or local.device.type == "meta":
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
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
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


def _local(tensor):
    if tensor is None:
        return None
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


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
    thread's allocations are seen (the profiler is per thread); gloo's worker threads are not.
    """

    WINDOW = "memfit::window"

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.end_bytes = 0
        self._profiler = None

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
            self.peak_bytes, self.end_bytes = _profiled_window_peak(self._profiler, self.WINDOW)


def _profiled_window_peak(prof, window: str) -> tuple[int, int]:
    """(peak, at the end) of live bytes inside the last `window` range: allocations since profiling began, minus
    their frees (frees of storages allocated before profiling are ignored: their bytes were never counted)."""
    from torch._C._profiler import _EventType

    from .measure_cpu import _walk

    allocations, windows = [], []
    for order, event in enumerate(_walk(prof.profiler.kineto_results.experimental_event_tree())):
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            allocations.append((event.start_time_ns, order, fields.ptr, fields.alloc_size))
        elif event.name == window:
            windows.append((event.start_time_ns, event.end_time_ns))
    if not windows:
        raise ConfigError("PeakMeter: no window() was opened inside the meter")
    start, end = windows[-1]
    allocations.sort()
    live = _LiveBlocks()
    peak = None
    for time_ns, _, ptr, size_bytes in allocations:
        if time_ns > end:
            break
        if time_ns >= start and peak is None:
            peak = live.total_bytes  # live when the window opened
        if size_bytes > 0:
            live.allocate(ptr, size_bytes)
        else:
            live.free(ptr)
        if peak is not None:
            peak = max(peak, live.total_bytes)
    return (live.total_bytes if peak is None else peak), live.total_bytes


class _LiveBlocks:
    """Live allocations by address. The profiler sees only the profiled thread's frees: a tensor that a gloo worker
    thread frees (its reduce-scatter scratch, one block's unsharded gradients, released by whichever thread drops the
    work last) would stay 'live' forever. An allocation overlapping a block still counted as live proves that block
    was freed unseen, so it is dropped then; what is never reused is still over-counted (at most that block)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.bytes_by_start: dict[int, int] = {}
        self.total_bytes = 0

    def allocate(self, ptr: int, size_bytes: int) -> None:
        index = bisect.bisect_left(self.starts, ptr)
        if index > 0 and self.starts[index - 1] + self.bytes_by_start[self.starts[index - 1]] > ptr:
            index -= 1
        while index < len(self.starts) and self.starts[index] < ptr + size_bytes:
            self.total_bytes -= self.bytes_by_start.pop(self.starts.pop(index))
        self.starts.insert(index, ptr)
        self.bytes_by_start[ptr] = size_bytes
        self.total_bytes += size_bytes

    def free(self, ptr: int) -> None:
        size_bytes = self.bytes_by_start.pop(ptr, None)
        if size_bytes is None:
            return  # allocated before profiling (never counted) or already dropped
        del self.starts[bisect.bisect_left(self.starts, ptr)]
        self.total_bytes -= size_bytes

"""Real steps on CPU under torch.profiler(profile_memory=True): every allocation and free, replayed on top of what
was live before profiling (parameters, buffers, optimizer state, the batches), is the ground truth (FACTS: profiler
events, MemoryProfile and MemTracker agree to the byte). Marks let replay.py give each byte a term.

oneDNN's scratchpad is kept apart: on a CPU with native bf16 (AVX512-BF16, AMX) PyTorch runs a bf16 matmul through
oneDNN (aten/src/ATen/native/mkldnn/Matmul.cpp, use_mkldnn_bf16_matmul), whose brgemm kernels take a scratch buffer
from the CPU allocator for the op's duration (ideep's user scratchpad, IDeepRegistration.cpp); with AVX2 only the same
op runs ATen's own gemm with none. Its size depends on the ISA, the blocking and the thread count, and no CUDA step
has it (cuBLAS's workspace is fixed, estimate/device.py), so the tensor figures are the step without it, the same on
every x86 CPU, and the scratch is one labelled overhead term: what it added to the profiler's peak on this machine."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch._C._profiler import _EventType

from ..estimate.terms import TermKey
from .replay import Allocation, Mark, Replay, replay
from .storage import all_storage_tensors
from .step import training_step

MARK_PREFIX = "memfit::mark/"


def measure_cpu_steps(model, optimizer, batches, setup, *, steps: int, loss_fn=None,
                      on_phase=None) -> tuple[Replay, list[float]]:
    """Run `steps` optimizer steps under the profiler; return the replay and the losses. `on_phase(step, phase)` is
    called as each phase begins (progress)."""
    marks: dict[str, Mark] = {}
    position = {"step": 0, "micro": 0}

    def mark(**fields) -> None:
        name = f"{MARK_PREFIX}{len(marks)}"
        marks[name] = Mark(**fields)
        with torch.profiler.record_function(name):
            pass

    def phase_mark(phase: str) -> None:
        if on_phase is not None:
            on_phase(position["step"], phase)
        position["micro"] += phase == "forward"
        tags = {"gradients": tuple(_grad_pointers(model))} if phase == "optimizer" else {}
        mark(phase=phase, step=position["step"], micro=position["micro"], tags=tags)

    baseline = storage_baseline(model, optimizer, batches)
    losses = []
    # Shapes and stacks are not read (the replay needs allocations and marks only); recording them costs time.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=False, with_stack=False) as prof:
        for step in range(1, steps + 1):
            position.update(step=step, micro=0)
            losses.append(training_step(model, optimizer, batches, setup, loss_fn=loss_fn, phase_callback=phase_mark))
            mark(tags=optimizer_tags(optimizer))
    events, scratch = _events(prof, marks)
    result = replay(baseline, events)
    if scratch:
        result.scratch_bytes = max(0, _peak(replay(baseline, scratch)) - _peak(result))
    return result, losses


def _peak(result: Replay) -> int:
    return result.bytes_at(result.peak_point)


def storage_baseline(model, optimizer, batches) -> list[tuple[int, int, str]]:
    """(pointer, bytes, term) of each distinct storage live before profiling that belongs to the step."""
    seen: dict[int, tuple[int, int, str]] = {}

    def add(tensors, term: str) -> None:
        for tensor in all_storage_tensors(tensors):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen and tensor.device.type == "cpu" and storage.nbytes() > 0:
                seen[storage.data_ptr()] = (storage.data_ptr(), storage.nbytes(), term)

    add(model.parameters(), "parameters")
    add(model.buffers(), "buffers")
    add((p.grad for p in model.parameters() if p.grad is not None), "gradients")
    for term, pointers_tensors in _optimizer_tensors(optimizer).items():
        add(pointers_tensors, term)
    add(_tensors_in(batches), "inputs")
    return list(seen.values())


def optimizer_tags(optimizer) -> dict[str, tuple[int, ...]]:
    return {term: tuple(t.untyped_storage().data_ptr() for t in tensors)
            for term, tensors in _optimizer_tensors(optimizer).items()}


def _optimizer_tensors(optimizer) -> dict[str, list[torch.Tensor]]:
    """Optimizer state (incl. bitsandbytes' quantisation maps) and, for bf16-master, the fp32 master weights."""
    masters = list(getattr(optimizer, "master_params", ()))
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params |= {id(p) for p in getattr(optimizer, "model_params", ())}
    skip = {"param_groups", "model_params", "master_params", "defaults"}
    state = [t for key, value in vars(optimizer).items() if key not in skip for t in _tensors_in(value)]
    inner = getattr(optimizer, "inner", None)
    for part in (inner, *getattr(optimizer, "parts", ())):  # a wrapped optimizer; Muon + AdamW stepped as one
        if isinstance(part, torch.optim.Optimizer):
            params |= {id(p) for group in part.param_groups for p in group["params"]}
            state += [t for key, value in vars(part).items() if key not in skip for t in _tensors_in(value)]
    state = [t for t in state if id(t) not in params]
    return {TermKey.MASTER_WEIGHTS: masters, "optimizer": state}


def _tensors_in(value, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 6 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif depth < 6 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)


def _grad_pointers(model) -> Iterator[int]:
    for param in model.parameters():
        if param.grad is not None:
            yield param.grad.untyped_storage().data_ptr()


MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                        "aten::_addmm_activation"})
"""The ops whose oneDNN bf16 path allocates a scratchpad (mkldnn_matmul, called from their CPU kernels): an
allocation freed inside the matmul op that made it is that scratch (an op's outputs outlive it)."""


def _events(prof, marks: dict[str, Mark]) -> tuple[list[Allocation | Mark], list[Allocation | Mark]]:
    """The step's events in time order without oneDNN's scratch, and all of them when there was any scratch."""
    walked = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    scratch = matmul_scratch(walked)
    timed = []
    for order, event in enumerate(walked):
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                timed.append((event.start_time_ns, order,
                              Allocation(fields.ptr, fields.alloc_size, fields.total_allocated)))
        elif event.name in marks:
            timed.append((event.start_time_ns, order, marks[event.name]))
    timed.sort(key=lambda item: (item[0], item[1]))
    everything = [item[2] for item in timed]
    if not scratch:
        return everything, []
    kept, live = [], 0
    for _, order, event in timed:  # the profiler's running totals lose the scratch live at each event too
        if order in scratch:
            live += event.size_bytes
        elif live and isinstance(event, Allocation) and event.running_total_bytes is not None:
            kept.append(Allocation(event.ptr, event.size_bytes, event.running_total_bytes - live))
        else:
            kept.append(event)
    return kept, everything


def profiled_peak(prof, preexisting: Mapping[int, int] | None = None) -> int:
    """The peak of live tensor bytes over a profiled run (torch.profiler with profile_memory), from its allocation
    events in time order, without oneDNN's matmul scratch: what a real CPU step is checked on.

    What counts: the blocks allocated while profiling, plus `preexisting` (address -> bytes of the storages alive
    before it that the caller counts, e.g. the model and its optimizer); a free lowers the figure only for a block
    counted. Any other storage made before profiling (an earlier run's objects, collected by the garbage collector
    mid-run) was never counted, so its free must not lower the figure."""
    walked = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    scratch = matmul_scratch(walked)
    counted = dict(preexisting or {})  # address -> bytes of the blocks counted and not yet freed
    live = peak = sum(counted.values())
    for _, size, ptr in sorted((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr)
                               for order, node in enumerate(walked)
                               if node.tag == _EventType.Allocation and order not in scratch):
        if size > 0:
            counted[ptr] = size
            live += size
            peak = max(peak, live)
        else:
            live -= counted.pop(ptr, 0)
    return peak


def matmul_scratch(walked: list) -> set[int]:
    """Positions in `walked` (the profiler's event tree, walked) of oneDNN's matmul scratch: each CPU allocation
    freed inside the matmul op that made it, and its free. The rank meter (rank_memory) leaves them out too."""
    opened, scratch = {}, set()
    for order, event in enumerate(walked):
        if event.tag != _EventType.Allocation or event.extra_fields.device.type != "cpu":
            continue
        fields = event.extra_fields
        op = _matmul_op(event.parent)
        if fields.alloc_size > 0:
            opened[fields.ptr] = (op, order)
        elif op is not None and opened.get(fields.ptr, (None,))[0] == op:  # freed in the op that made it
            scratch |= {opened.pop(fields.ptr)[1], order}
    return scratch


def _matmul_op(op) -> tuple | None:
    """The matmul op an allocation happened directly in, as a key (None: not a matmul)."""
    if op is None or op.name not in MATMUL_OPS:
        return None
    return op.name, op.start_time_ns, op.end_time_ns


def _walk(nodes) -> Iterator:
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))

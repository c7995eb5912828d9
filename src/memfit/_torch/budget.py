"""A simulated device for testing out-of-memory handling on CPU: `DeviceBudget` counts live tensor bytes and raises
`torch.OutOfMemoryError` when they would pass a limit; `OOMInjector` raises it at one chosen op of one chosen phase.

Both are `TorchDispatchMode`s, so they see every op of forward, backward (autograd runs CPU graphs on the calling
thread, which carries the mode) and the optimizer step, including the recomputation inside checkpointed blocks.

How bytes are counted: each new untyped storage among an op's outputs is registered once, keyed by the storage
object's id, with a weakref whose callback subtracts its bytes when the storage dies (torch keeps one Python object
per live storage, so views share it). Byte counts are `storage.nbytes()`, what the CPU allocator is asked for. Tensors
that exist before the mode is entered (parameters, optimizer state, the batches) are counted once `track`ed.

The check runs after the op, on its outputs: for an out-of-place op that is what a real allocator failure looks like
to the caller (no result); an in-place op that also grows a storage (`resize_`) has already written when it fails,
which is harsher than a real device and so a safe simulation for code that must survive OOM.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..units import format_bytes

PHASES = ("forward", "backward", "optimizer")


class DeviceBudget(TorchDispatchMode):
    """`with DeviceBudget(limit_bytes) as budget: budget.track(model, optimizer, batches); ...`

    `limit_bytes=None` only counts (a peak meter). `device_type` restricts counting to tensors on that device type
    ('cpu', 'cuda'); by default every tensor with a storage counts.
    """

    def __init__(self, limit_bytes: int | None, *, device_type: str | None = None) -> None:
        super().__init__()
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or limit_bytes <= 0):
            raise ValueError(f"limit_bytes must be a positive whole number of bytes or None, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self.device_type = device_type
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_ooms = 0
        self._bytes_by_storage: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    # ---- what was there before --------------------------------------------------------------------------------

    def track(self, *objects) -> int:
        """Count tensors that already exist: an nn.Module (parameters, their grads, buffers), an optimizer (its
        state), or any tensor / dict / list / tuple of them. Returns the bytes added. Never raises for the limit."""
        before = self.live_bytes
        for tensor in _tensors_of(objects):
            self._register(tensor, check=False)
        return self.live_bytes - before

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def summary(self) -> str:
        limit = "no limit" if self.limit_bytes is None else f"limit {format_bytes(self.limit_bytes)}"
        return (f"simulated device: {format_bytes(self.live_bytes)} live, peak {format_bytes(self.peak_bytes)}, "
                f"{limit}, {self.num_ooms} out-of-memory errors raised")

    # ---- the dispatch mode ------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _flat_tensors(out):
            self._register(tensor, check=True)
        return out

    def _register(self, tensor: torch.Tensor, *, check: bool) -> None:
        if self.device_type is not None and tensor.device.type != self.device_type:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse and other storage-less tensors
        key = id(storage)
        num_bytes = storage.nbytes()
        known_bytes = self._bytes_by_storage.get(key)
        if known_bytes is None:
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
            self._bytes_by_storage[key] = known_bytes = 0
        if num_bytes == known_bytes:
            return
        self._bytes_by_storage[key] = num_bytes
        self.live_bytes += num_bytes - known_bytes
        over = self.limit_bytes is not None and self.live_bytes > self.limit_bytes
        if check and num_bytes > known_bytes and over:
            self.num_ooms += 1
            grown_bytes = num_bytes - known_bytes
            raise torch.OutOfMemoryError(
                f"simulated device out of memory: tried to allocate {format_bytes(grown_bytes)}; "
                f"{format_bytes(self.live_bytes - grown_bytes)} live of a {format_bytes(self.limit_bytes)} "
                "limit (memfit DeviceBudget)")
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._bytes_by_storage.pop(key, 0)
        self._refs.pop(key, None)


@dataclass(frozen=True)
class Injection:
    """Raise one `torch.OutOfMemoryError` before the `nth_op`-th op (1-based) of `phase` in optimizer step `step`
    (0-based) and micro-step `micro_step` (0-based; None = any, and the optimizer phase has none). With `op`, only ops
    whose name contains it are counted (e.g. 'sqrt' lands inside AdamW's update, after its in-place writes)."""

    phase: str
    step: int = 0
    micro_step: int | None = 0
    nth_op: int = 1
    op: str | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.nth_op < 1:
            raise ValueError(f"nth_op counts from 1, got {self.nth_op}")

    def matches(self, phase: str, step: int, micro_step: int | None) -> bool:
        if (phase, step) != (self.phase, self.step):
            return False
        return self.micro_step is None or phase == "optimizer" or micro_step == self.micro_step


class OOMInjector(TorchDispatchMode):
    """Deterministic out-of-memory errors: each `Injection` fires once. Pass `injector.on_phase` as the training
    loop's phase callback (`FitLoop(..., phase_callback=injector.on_phase)`): it is told (phase, step, micro_step)
    as each phase begins."""

    def __init__(self, *injections: Injection) -> None:
        super().__init__()
        self.pending = list(injections)
        self.fired: list[tuple[Injection, str]] = []
        """(injection, name of the op it fired before)."""
        self._armed: list[Injection] = []
        self._counts: dict[Injection, int] = {}

    def on_phase(self, phase: str, step: int, micro_step: int | None = None) -> None:
        self._armed = [i for i in self.pending if i.matches(phase, step, micro_step)]
        self._counts = {i: 0 for i in self._armed}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        for injection in self._armed:
            if injection.op is not None and injection.op not in name:
                continue
            self._counts[injection] += 1
            if self._counts[injection] == injection.nth_op:
                self._armed.remove(injection)
                self.pending.remove(injection)
                self.fired.append((injection, name))
                raise torch.OutOfMemoryError(f"injected out of memory before {name} ({injection})")
        return func(*args, **(kwargs or {}))


def _flat_tensors(out) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _flat_tensors(item)


def _tensors_of(objects) -> Iterable[torch.Tensor]:
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            yield from _tensors_of([list(obj.state.values())])
            yield from _tensors_of([getattr(obj, "master_params", [])])  # memfit's bf16 master-weights wrapper
        elif isinstance(obj, dict):
            yield from _tensors_of(obj.values())
        elif isinstance(obj, (list, tuple)):
            yield from _tensors_of(obj)

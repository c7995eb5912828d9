"""StepTracker: every tensor storage a training step allocates and frees, with O(1) bookkeeping per event.

A `TorchDispatchMode` sees the outputs of every op. Each new untyped storage is registered once (keyed by the
storage object's id; a weakref callback records the free), and its bytes go to one `_Kind`. Live bytes per kind,
the device total and its peak are plain integer updates, so the cost per op does not grow with the model (torch's
`MemTracker` walks every tracked module on every op in `_update_peak_stats`; see FACTS.md).

Byte counts are `storage.nbytes()`: what the CPU allocator is asked for and the profiler reports. The peak and the
category snapshot at the peak are exact at op granularity; only a kernel's internal workspace is invisible.

Categories are decided when a storage is born (phase and module stack) and refined later: a storage that turns
out to be a `p.grad` or an optimizer state, or an activation freed before forward ends (a temporary), is moved to
its real kind in the live counts and, when it was alive at the peak, in the peak snapshot too.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._torch.storage import is_wrapper, storage_tensors
from ..estimate.result import Category, Phase
from ..estimate.terms import TermKey
from .timeline import Sample, TraceProgress

_PHASE_ORDER = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


class _Kind(IntEnum):
    """Finer than `Category`: each kind becomes one named `Term` of the result."""

    PARAMETERS = 0
    BUFFERS = 1
    GATHERED = 2  # FSDP all-gathered (unsharded) parameters
    GRADIENTS = 3
    OPTIMIZER = 4
    ACTIVATIONS = 5
    INPUTS = 6
    TEMPORARIES = 7
    HOST_TEMPORARIES = 8  # optimizer-step scratch of a step that runs on the host (CPU offload)


KIND_TERMS: dict[_Kind, tuple[TermKey, Category]] = {
    _Kind.PARAMETERS: (TermKey.PARAMETERS, Category.PARAMETERS),
    _Kind.BUFFERS: (TermKey.BUFFERS, Category.PARAMETERS),
    _Kind.GATHERED: (TermKey.GATHERED, Category.PARAMETERS),
    _Kind.GRADIENTS: (TermKey.GRADIENTS, Category.GRADIENTS),
    _Kind.OPTIMIZER: (TermKey.OPTIMIZER, Category.OPTIMIZER),
    _Kind.ACTIVATIONS: (TermKey.ACTIVATIONS, Category.ACTIVATIONS),
    _Kind.INPUTS: (TermKey.INPUTS, Category.ACTIVATIONS),
    _Kind.TEMPORARIES: (TermKey.TEMPORARIES, Category.TEMPORARIES),
    _Kind.HOST_TEMPORARIES: (TermKey.HOST, Category.TEMPORARIES),
}
_NUM_KINDS = len(_Kind)
_ROOT = "(model)"


class _Storage:
    __slots__ = ("key", "nbytes", "kind", "module", "alloc_index", "phase_serial", "ref", "sid")


class StepTracker(TorchDispatchMode):
    """Enter inside a FakeTensorMode (or on real tensors); call `mark(phase)` at phase boundaries.

    `host_kinds` are kinds that live in host memory (CPU offload): counted in `host_bytes`, not the device peak.
    With `optimizer_on_host`, everything the optimizer step allocates is host memory.
    """

    def __init__(self, *, host_kinds: Iterable[_Kind] = (), optimizer_on_host: bool = False, num_steps: int = 2,
                 progress: Callable[[TraceProgress], None] | None = None, progress_interval_s: float = 0.25,
                 hidden_scratch: Callable[[Any, tuple], int] | None = None) -> None:
        super().__init__()
        self._hidden_scratch = hidden_scratch
        """(op, args) -> bytes an op's kernel allocates and frees below the dispatcher (memfit.trace.kernels)."""
        self._records: dict[int, _Storage] = {}
        self._on_host = [k in set(host_kinds) for k in _Kind]
        self._optimizer_on_host = optimizer_on_host
        self.live = [0] * _NUM_KINDS
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_bytes = 0
        self.peak_live: list[int] = [0] * _NUM_KINDS
        self.peak_event = -1
        self.peak_phase: Phase | None = None
        self.peak_step = 0
        self.phase_peaks: dict[Phase, int] = {}
        self.events = 0
        self.step = 0
        self.num_steps = num_steps
        self.phase: Phase | None = None
        self._phase_serial = 0
        self._phase_start_event = 0
        self._phase_events: dict[Phase, int] = {}
        self._stack: list[str] = []
        self._module_names: dict[int, str] = {}
        self.saved_by_module: dict[str, int] = {}
        self._history: list[tuple[int, ...]] = []
        self.marks: list[tuple[int, int, Phase]] = []
        self._hooks: list = []
        self._active = False
        self._progress = progress
        self._progress_interval_s = progress_interval_s
        self._progress_next = 0.0
        self._progress_done = 0.0
        self._dtensor_type = _dtensor_type()
        self._wait_tensor = _wait_tensor_op()
        self._orig_resize = None
        self.values_assumed = 0
        self._shape_only = 0
        """> 0 while DTensor derives output shapes by running an op on global-shape fake tensors: in a real run those
        are a private FakeTensorMode's (no memory); in a trace they would share ours and look like allocations."""
        self._orig_propagate = None
        self.allocation_events: list[tuple[int, int]] = []
        """Device allocations and frees in order, for memfit.estimate.allocator.replay: (serial, bytes) when a
        storage is born (or re-grown by resize_), (serial, FREE) when it dies. Host-resident kinds are left out."""
        self._serial = 0

    # ---- registration -------------------------------------------------------------------------------------

    def watch_module(self, model: torch.nn.Module) -> None:
        """Register a model's parameters and buffers and name its modules for `top_modules`."""
        for name, module in model.named_modules():
            self._module_names[id(module)] = name or _ROOT
        for param in model.parameters():
            self.register(param, _Kind.PARAMETERS)
            if param.grad is not None:
                self.register(param.grad, _Kind.GRADIENTS)
            if param.requires_grad and _local(param) is param:  # sharded (DTensor) grads come from FSDP instead
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_accumulated))
        for buffer in model.buffers():
            self.register(buffer, _Kind.BUFFERS)

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.register(param.grad, _Kind.GRADIENTS)

    def register(self, tensor: torch.Tensor, kind: _Kind) -> None:
        """Count a tensor that exists already (or reclassify it if it is known)."""
        if is_wrapper(tensor):  # its bytes are its inner tensors' (memfit._torch.storage)
            for inner in storage_tensors(tensor):
                self.register(inner, kind)
            return
        storage = _storage_of(tensor)
        if storage is None:
            return
        record = self._records.get(id(storage))
        if record is None:
            self._add(storage, kind)
        elif record.kind != kind:
            self._reclassify(record, kind)

    def register_tree(self, tree, kind: _Kind) -> None:
        for tensor in _tensors_in(tree):
            self.register(tensor, kind)

    def classify_gradients(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            grad = getattr(param, "grad", None)
            if grad is not None:
                self.register(_local(grad), _Kind.GRADIENTS)

    def classify_optimizer_state(self, optimizer) -> None:
        """States, and parameters the optimizer owns that the model does not (fp32 master copies)."""
        for group in getattr(optimizer, "param_groups", ()):
            for param in group["params"]:
                record = self._records.get(id(_storage_of(param)))
                if record is None or record.kind is not _Kind.PARAMETERS:
                    self.register(_local(param), _Kind.OPTIMIZER)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.register(_local(value), _Kind.OPTIMIZER)

    # ---- phases ----------------------------------------------------------------------------------------------

    def mark(self, phase: Phase | str) -> None:
        """The step enters `phase`. A forward after anything else starts a new step."""
        phase = Phase(phase)
        if phase is Phase.FORWARD and self.phase in (None, Phase.OPTIMIZER):
            self.step += 1  # a forward after backward is the next micro-batch of the same step
        elif self.phase is Phase.FORWARD:
            self._collect_saved_activations()
        self._close_phase()
        self.phase = phase
        self._phase_serial += 1
        self._phase_start_event = self.events
        self.marks.append((self.events, self.step, phase))
        self._report_progress(force=True)

    def _close_phase(self) -> None:
        """Remember how many events the phase took: the next step's progress estimate inside that phase."""
        if self.phase is not None:
            self._phase_events[self.phase] = max(self._phase_events.get(self.phase, 0),
                                                 self.events - self._phase_start_event)

    def _collect_saved_activations(self) -> None:
        """Activations alive when forward ends are what each module saved for backward."""
        saved: dict[str, int] = {}
        for record in self._records.values():
            if record.kind is _Kind.ACTIVATIONS and record.phase_serial == self._phase_serial:
                saved[record.module] = saved.get(record.module, 0) + record.nbytes
        for name, num_bytes in saved.items():
            self.saved_by_module[name] = max(self.saved_by_module.get(name, 0), num_bytes)

    # ---- bookkeeping -----------------------------------------------------------------------------------------

    def _birth_kind(self) -> _Kind:
        phase = self.phase
        if phase is Phase.FORWARD:
            return _Kind.ACTIVATIONS
        if phase is Phase.BACKWARD:
            return _Kind.ACTIVATIONS if self._stack else _Kind.TEMPORARIES  # a module forward in backward: recompute
        if phase is Phase.OPTIMIZER and self._optimizer_on_host:
            return _Kind.HOST_TEMPORARIES
        return _Kind.TEMPORARIES

    def _add(self, storage, kind: _Kind) -> None:
        record = _Storage()
        record.key = key = id(storage)
        record.nbytes = num_bytes = storage.nbytes()
        record.kind = kind
        record.module = self._stack[-1] if self._stack else _ROOT
        record.alloc_index = self.events
        record.phase_serial = self._phase_serial
        record.ref = weakref.ref(storage, lambda _ref, record=record: self._free(record))
        record.sid = 0
        self._records[key] = record
        if num_bytes:
            self._stream_alloc(record)
            self._change(kind, num_bytes)

    def _stream_alloc(self, record: _Storage) -> None:
        if not self._on_host[record.kind]:
            self._serial += 1
            record.sid = self._serial
            self.allocation_events.append((self._serial, record.nbytes))

    def _stream_free(self, record: _Storage) -> None:
        if record.sid:
            self.allocation_events.append((record.sid, _FREE))
            record.sid = 0

    def _free(self, record: _Storage) -> None:
        if self._records.get(record.key) is record:
            del self._records[record.key]
        if not self._active or not record.nbytes:
            return
        kind = record.kind
        if kind is _Kind.ACTIVATIONS and self.phase is Phase.FORWARD and record.phase_serial == self._phase_serial:
            self._retro(record, _Kind.TEMPORARIES)  # born and dead within one forward: a temporary
        self._stream_free(record)
        self._change(kind, -record.nbytes)

    def _resized(self, record: _Storage, num_bytes: int) -> None:
        delta = num_bytes - record.nbytes
        if not record.nbytes:
            record.alloc_index = self.events  # re-allocated (FSDP2 all-gather outputs): born again
        record.nbytes = num_bytes
        if delta:
            self._stream_free(record)  # the allocator sees a resize as a free and a new block
            if num_bytes:
                self._stream_alloc(record)
            self._change(record.kind, delta)

    def _change(self, kind: _Kind, delta: int) -> None:
        """The only place live totals change; one event of the timeline."""
        live = self.live
        live[kind] += delta
        self.events += 1
        self._history.append(tuple(live))
        if self._on_host[kind]:
            self.host_bytes += delta
            return
        total = self.device_bytes = self.device_bytes + delta
        if delta > 0:
            phase = self.phase
            if phase is not None and total > self.phase_peaks.get(phase, 0):
                self.phase_peaks[phase] = total
            if total > self.peak_bytes:
                self.peak_bytes = total
                self.peak_live = live.copy()
                self.peak_event = self.events
                self.peak_phase = phase
                self.peak_step = self.step
        if self._progress is not None and not self.events & 255:
            self._report_progress()

    def _reclassify(self, record: _Storage, kind: _Kind) -> None:
        old = record.kind
        if old is kind:
            return
        num_bytes = record.nbytes
        if not num_bytes:
            record.kind = kind
            return
        self._retro(record, kind)
        self.live[old] -= num_bytes
        self.live[kind] += num_bytes
        if self._on_host[old] != self._on_host[kind]:
            sign = 1 if self._on_host[kind] else -1
            self.host_bytes += sign * num_bytes
            self.device_bytes -= sign * num_bytes

    def _retro(self, record: _Storage, kind: _Kind) -> None:
        """A storage alive at the peak turned out to be `kind`: fix the peak snapshot (same residency only)."""
        old = record.kind
        if record.alloc_index < self.peak_event and self._on_host[old] == self._on_host[kind]:
            self.peak_live[old] -= record.nbytes
            self.peak_live[kind] += record.nbytes
        record.kind = kind

    # ---- the dispatch mode -----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._dtensor_type is not None and self._dtensor_type in types:
            return NotImplemented  # let DTensor desugar into ops on local shards, then see those
        scratch = 0
        if func is self._wait_tensor:
            out = args[0]  # its fake impl returns a new tensor; eager returns the input
        elif func is _ITEM and self.phase is Phase.OPTIMIZER:
            return self._item(func, args[0])
        else:
            scratch = self._hidden_scratch(func, args) if self._hidden_scratch is not None else 0
            out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._see(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._see(item)
                elif isinstance(item, (tuple, list)):
                    for tensor in item:
                        if isinstance(tensor, torch.Tensor):
                            self._see(tensor)
        if scratch:  # the kernel's own scratch lives while it makes the outputs
            self._transient(scratch)
        return out

    def _transient(self, num_bytes: int) -> None:
        """Scratch an op allocates and frees inside its kernel: one allocation and its free, in the current kind."""
        if num_bytes <= 0:
            return
        kind = self._birth_kind()
        serial = 0
        if not self._on_host[kind]:
            self._serial += 1
            serial = self._serial
            self.allocation_events.append((serial, num_bytes))
        self._change(kind, num_bytes)
        if serial:
            self.allocation_events.append((serial, _FREE))
        self._change(kind, -num_bytes)

    def _item(self, func, tensor: torch.Tensor):
        """`.item()` in the optimizer step. Fake tensors know the values of small constants (AdamW's `step`), not
        computed ones (GradScaler's found_inf, Adafactor's RMS comparison): for those 0 is the ordinary path (finite
        gradients, the step taken) and allocates the same tensors."""
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            return func(tensor)
        except DataDependentOutputException:
            pass
        self.values_assumed += 1
        if tensor.dtype is torch.bool:
            return False
        return 0.0 if tensor.is_floating_point() else 0

    def see(self, tensor: torch.Tensor) -> None:
        """Count a tensor made outside the dispatcher (a generator's state) as if an op had made it now."""
        if self._active:
            self._see(tensor)

    def _see(self, tensor: torch.Tensor) -> None:
        if self._shape_only:
            return
        if is_wrapper(tensor):
            for inner in storage_tensors(tensor):
                self._see(inner)
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse / storage-less tensors
        record = self._records.get(id(storage))
        if record is None:
            self._add(storage, self._birth_kind())
        elif record.nbytes != storage.nbytes():  # resize_ / set_ to a larger size in place
            self._resized(record, storage.nbytes())

    # ---- context -----------------------------------------------------------------------------------------------

    def __enter__(self):
        self._active = True
        self._install_hooks()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._close_phase()
            self._remove_hooks()
            self._active = False

    def _install_hooks(self) -> None:
        from torch.nn.modules import module as nn_module

        names, stack = self._module_names, self._stack

        def pre(module, _args):
            stack.append(names.get(id(module)) or type(module).__name__)

        def post(_module, _args, _output):
            if stack:
                stack.pop()

        self._hooks += [nn_module.register_module_forward_pre_hook(pre),
                        nn_module.register_module_forward_hook(post, always_call=True)]
        self._orig_resize = torch.UntypedStorage.resize_
        original, records = self._orig_resize, self._records

        def resize_(storage, size):  # FSDP2 frees / re-allocates unsharded parameters by resizing storages
            result = original(storage, size)
            record = records.get(id(storage))
            if record is not None and record.nbytes != storage.nbytes():
                self._resized(record, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        self._pause_shape_propagation()

    def _pause_shape_propagation(self) -> None:
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:
            return
        original = self._orig_propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def shape_only(propagator, *args, **kwargs):
            self._shape_only += 1
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._shape_only -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = shape_only

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None
        if self._orig_propagate is not None:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
            self._orig_propagate = None

    # ---- progress and results --------------------------------------------------------------------------------

    def _report_progress(self, force: bool = False) -> None:
        if self._progress is None or self.phase is None:
            return
        now = time.monotonic()
        if not force and now < self._progress_next:
            return
        self._progress_next = now + self._progress_interval_s
        phase_index = _PHASE_ORDER.index(self.phase)
        expected = self._phase_events.get(self.phase) or _GUESS_EVENTS[self.phase]
        within = min(0.99, (self.events - self._phase_start_event) / max(expected, 1))
        done = (max(self.step, 1) - 1) * 3 + phase_index + within
        self._progress_done = max(self._progress_done, min(1.0, done / (3 * self.num_steps)))  # never backwards
        self._progress(TraceProgress(step=max(self.step, 1), num_steps=self.num_steps, phase=self.phase,
                                     fraction=self._progress_done))

    def finish_progress(self) -> None:
        if self._progress is not None:
            self._progress(TraceProgress(step=self.step, num_steps=self.num_steps,
                                         phase=self.phase or Phase.OPTIMIZER, fraction=1.0))

    @property
    def peak_by_kind(self) -> dict[_Kind, int]:
        return {kind: self.peak_live[kind] for kind in _Kind if not self._on_host[kind]}

    def host_live(self) -> dict[_Kind, int]:
        return {kind: self.live[kind] for kind in _Kind if self._on_host[kind]}

    def samples(self, max_points: int = 2000) -> list[Sample]:
        """The history down-sampled for a timeline (see timeline.downsample)."""
        from .timeline import downsample

        device = [not host for host in self._on_host]
        return downsample(self._history, self.marks, self.peak_event, device, max_points)

    def top_modules(self, limit: int = 10) -> list[tuple[str, int]]:
        from .timeline import group_modules

        return group_modules(self.saved_by_module, limit)


_GUESS_EVENTS = {Phase.FORWARD: 2000, Phase.BACKWARD: 4000, Phase.OPTIMIZER: 2000}


_ITEM = torch.ops.aten._local_scalar_dense.default
_FREE = -1  # memfit.estimate.allocator.FREE


def _storage_of(tensor: torch.Tensor):
    tensor = _local(tensor)
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _local(tensor):
    """The local shard of a DTensor; the tensor itself otherwise."""
    to_local = getattr(tensor, "_local_tensor", None)
    return to_local if isinstance(to_local, torch.Tensor) else tensor


def _tensors_in(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _wait_tensor_op():
    try:
        return torch.ops._c10d_functional.wait_tensor.default
    except (AttributeError, RuntimeError):
        return None

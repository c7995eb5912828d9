"""Activation offloading as torchtune's OffloadActivations does it (torchtune/training/_activation_offloading.py),
single stream: saved tensors of >= 1024 B that are not parameters go to pinned host memory in forward and come back
in backward; the LM head and everything after it (the loss) keep theirs on the device (torchtune's NoOpManager on
the output head; its recipes compute the loss outside the context).

On a CPU model there is nowhere to move a tensor to: the hooks count what they would move (one copy per pack, as
torchtune makes) and leave it in place, which is how memfit checks its formulas on CPU steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..estimate.offload_activations import MIN_OFFLOAD_BYTES


@dataclass
class OffloadCounts:
    """What the hooks packed in the forwards they ran under."""

    packed_bytes: int = 0
    """Host copies made (or, on a CPU model, that would be made): one per pack."""
    storages: dict[int, int] = field(default_factory=dict)
    """Device storages that left (address -> bytes), each once."""
    kept: dict[int, int] = field(default_factory=dict)
    """Storages of saved tensors that stayed on the device (parameters aside)."""
    weight_packed_bytes: int = 0
    """Of packed_bytes, views of parameters (`weight.t()` saved by a Linear): copied, but nothing freed."""

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def kept_bytes(self) -> int:
        return sum(nbytes for ptr, nbytes in self.kept.items() if ptr not in self.storages)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """The pack / unpack pair. `paused` (set while the LM head and the loss run) keeps tensors on the device."""

    def __init__(self, min_offload_bytes: int = MIN_OFFLOAD_BYTES, pin_memory: bool = True,
                 parameters=()) -> None:
        self.counts = OffloadCounts()
        self.parameter_storages = {_storage_key(p) for p in parameters}
        """Only for counting: torchtune's rule skips nn.Parameter objects, not views of them."""
        self.paused = False
        self.min_offload_bytes = min_offload_bytes
        self.pin_memory = pin_memory
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        key = _storage_key(tensor)
        is_weight = key in self.parameter_storages
        if self.paused or nbytes < self.min_offload_bytes:
            if not is_weight:
                self.counts.kept.setdefault(key, tensor.untyped_storage().nbytes())
            return tensor
        self.counts.packed_bytes += nbytes
        if is_weight:
            self.counts.weight_packed_bytes += nbytes
        else:
            self.counts.storages.setdefault(key, tensor.untyped_storage().nbytes())
        if tensor.device.type == "cpu":
            return tensor  # a CPU model: counted, nowhere to go
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.pin_memory and torch.cuda.is_available())
        host.copy_(tensor, non_blocking=True)
        return tensor.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)


def _storage_key(tensor: torch.Tensor) -> int:
    """The storage's address (fake and meta tensors have none: their object's id, counted per tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
        return id(tensor)
    return tensor.untyped_storage().data_ptr()


def lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Module) else getattr(model, "output", None)


@contextlib.contextmanager
def offloading(model: torch.nn.Module, offload: ActivationOffload | None = None):
    """Offload the saved tensors of what runs inside (the forward and the loss), the LM head's and the loss's aside:
    once the head starts, nothing more leaves until the context exits."""
    offload = offload or ActivationOffload(parameters=model.parameters())
    head = lm_head(model)
    handle = head.register_forward_pre_hook(lambda *_: setattr(offload, "paused", True)) if head is not None else None
    try:
        with offload:
            yield offload
    finally:
        offload.paused = False
        if handle is not None:
            handle.remove()


def install(model: torch.nn.Module) -> ActivationOffload:
    """Offload around every forward of `model` (apply_: for a loop that calls model(**batch), as the HF Trainer
    does, which computes the loss inside the forward, after the head)."""
    offload = ActivationOffload(parameters=model.parameters())
    stack: list[contextlib.ExitStack] = []

    def enter(*_):
        exits = contextlib.ExitStack()
        exits.enter_context(offloading(model, offload))
        stack.append(exits)

    def leave(*_):
        if stack:
            stack.pop().close()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    model._memfit_activation_offload = offload
    return offload


def context(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """What the one training loop wraps the forward and the loss in: offloading, unless off or apply_ installed it."""
    if not enabled or getattr(model, "_memfit_activation_offload", None) is not None:
        return contextlib.nullcontext()
    return offloading(model)

"""Count what a rank sends through torch.distributed, backend-independently: `CollectiveCounter` is a
TorchDispatchMode, and every c10d collective (the `c10d::*_` ops that torch.distributed's functions, FSDP2 and
DeepSpeed's torch backend call, and the `_c10d_functional::*` ops DTensor uses) passes through the dispatcher on the
calling thread before it reaches gloo or NCCL. It records each call's payload and passes it on unchanged.

Payload: the bytes of the whole buffer a collective covers, the quantity the ZeRO paper's volumes are written in
(memfit.estimate.comm): the tensor of an all-reduce, broadcast or reduce, the gathered output of an all-gather, the
unreduced input of a reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOUSEKEEPING_MAX_ELEMENTS = 1
"""Calls of at most this many elements are bookkeeping, not training traffic: gradient-norm and overflow checks,
the loss averaged for printing. So are integer tensors (DeepSpeed ZeRO-3 broadcasts parameter ids)."""


@dataclass(frozen=True)
class CollectiveCall:
    kind: str
    """'all-reduce', 'all-gather', 'reduce-scatter', 'broadcast' or 'reduce' (memfit.estimate.comm's names)."""
    op: str
    num_elements: int
    payload_bytes: int
    floating: bool = True
    """False for integer or bool tensors (ids, flags): bookkeeping."""


def _payload_of_first(args) -> list[torch.Tensor]:
    return _flat(args[0])


def _payload_of_second(args) -> list[torch.Tensor]:
    return _flat(args[1])


# op name -> (kind, which argument holds the full buffer)
_C10D = {
    "allreduce_": ("all-reduce", _payload_of_first),
    "allreduce_coalesced_": ("all-reduce", _payload_of_first),
    "_allgather_base_": ("all-gather", _payload_of_first),
    "allgather_": ("all-gather", _payload_of_first),
    "allgather_coalesced_": ("all-gather", _payload_of_first),
    "allgather_into_tensor_coalesced_": ("all-gather", _payload_of_first),
    "_reduce_scatter_base_": ("reduce-scatter", _payload_of_second),
    "reduce_scatter_": ("reduce-scatter", _payload_of_second),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", _payload_of_second),
    "broadcast_": ("broadcast", _payload_of_first),
    "reduce_": ("reduce", _payload_of_first),
}
_FUNCTIONAL = {
    "all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce", "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_tensor_coalesced": "reduce-scatter", "broadcast": "broadcast",
    "all_gather_into_tensor": "all-gather", "all_gather_into_tensor_coalesced": "all-gather",
}


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as counter: ...`; then `counter.payload_bytes()` by collective kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = _describe(func, args)
        if call is not None:
            self.calls.append(call)
        return func(*args, **(kwargs or {}))

    def payload_bytes(self, *, min_elements: int = HOUSEKEEPING_MAX_ELEMENTS + 1) -> dict[str, int]:
        """Payload bytes per collective kind, over floating-point calls of at least `min_elements` elements."""
        totals: dict[str, int] = {}
        for call in self.calls:
            if call.floating and call.num_elements >= min_elements:
                totals[call.kind] = totals.get(call.kind, 0) + call.payload_bytes
        return totals

    def clear(self) -> None:
        self.calls.clear()


def _describe(func, args) -> CollectiveCall | None:
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace == "c10d" and name in _C10D:
        kind, payload = _C10D[name]
        tensors = payload(args)
    elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
        kind = _FUNCTIONAL[name]
        tensors = _flat(args[0])
        if kind == "all-gather":  # the input is this rank's shard: the gathered buffer is group_size times it
            return _call(kind, name, tensors, factor=int(args[1]))
    else:
        return None
    return _call(kind, name, tensors)


def _call(kind: str, name: str, tensors: list[torch.Tensor], factor: int = 1) -> CollectiveCall:
    return CollectiveCall(kind, name, factor * sum(t.numel() for t in tensors),
                          factor * sum(t.numel() * t.element_size() for t in tensors),
                          all(t.is_floating_point() for t in tensors))


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [t for item in value for t in _flat(item)]
    return []

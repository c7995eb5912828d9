"""The tensors that own memory behind a tensor: the one definition every measurement (CPU profiler replay, the
ranks' memory meter, the engine's broadcast) and the trace use.

A DTensor's memory is its local shard. A wrapper tensor subclass (torchao's NF4Tensor, made with
`_make_wrapper_subclass`) reports a placeholder storage of its outer shape and dtype that holds no memory (its
`data_ptr` is invalid): its bytes are its inner tensors', named by `__tensor_flatten__`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def is_wrapper(tensor: torch.Tensor) -> bool:
    """A wrapper subclass other than DTensor (torchao's NF4Tensor): its own storage is a placeholder."""
    return hasattr(type(tensor), "__tensor_flatten__") and not hasattr(tensor, "_local_tensor")


def storage_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """`tensor` itself, a DTensor's local shard, or a wrapper subclass's inner tensors (recursively)."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        yield from storage_tensors(local)
    elif is_wrapper(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from storage_tensors(inner)
    else:
        yield tensor


def all_storage_tensors(tensors: Iterable) -> Iterator[torch.Tensor]:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            yield from storage_tensors(tensor)


def storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct storages behind `tensor`."""
    seen: dict[int, int] = {}
    for plain in storage_tensors(tensor):
        storage = plain.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())

"""Handlers per node kind, in one small registry: a node kind is a frozen dataclass plus the handlers registered
for it (`@handler("params", Linear)`), so adding a kind adds a class and its handlers, never a branch elsewhere.

Lookup is by exact type: a subclass, or a kind nobody registered, never borrows another kind's formula; it raises
UnknownNodeKindError naming the kind and the operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import MemfitError

_HANDLERS: dict[str, dict[type, Callable[..., Any]]] = {}


class UnknownNodeKindError(MemfitError, TypeError):
    """A node whose kind has no handler for the operation asked (a new kind needs its handlers registered)."""


class Node:
    """Marker base of every node kind. Kinds are frozen dataclasses; `name` is the node's path component
    (dotted, relative to its parent; '' adds no component)."""

    __slots__ = ()


@dataclass(frozen=True)
class GraphTensor:
    """`count` parameter tensors named `name` ('*' where a layer index goes), each of `numel` elements; `local` is
    the elements one tensor-parallel rank holds (= numel when the tensor is not sharded)."""

    name: str
    numel: int
    count: int = 1
    trainable: bool = True
    local: int = -1

    def __post_init__(self) -> None:
        if self.local < 0:
            object.__setattr__(self, "local", self.numel)

    @property
    def total(self) -> int:
        return self.numel * self.count


def handler(op: str, *kinds: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as operation `op` for each of `kinds` (one function may serve several kinds
    only when they are listed explicitly)."""
    if not kinds:
        raise TypeError("handler() needs at least one node kind")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        table = _HANDLERS.setdefault(op, {})
        for kind in kinds:
            if kind in table:
                raise TypeError(f"node kind '{kind.__name__}' already has a '{op}' handler")
            table[kind] = fn
        return fn

    return register


def has_handler(op: str, node: Any) -> bool:
    return type(node) in _HANDLERS.get(op, {})


def dispatch(op: str, node: Any, *args: Any) -> Any:
    """Run `op` for `node`'s kind; UnknownNodeKindError (one line) when the kind has no such handler."""
    fn = _HANDLERS.get(op, {}).get(type(node))
    if fn is None:
        kind = type(node).__name__
        known = ", ".join(sorted(k.__name__ for k in _HANDLERS.get(op, {}))) or "none"
        raise UnknownNodeKindError(f"no '{op}' handler for node kind '{kind}' (kinds with one: {known}); "
                                   f"register it with @handler('{op}', {kind})")
    return fn(node, *args)


def registered_kinds(op: str) -> tuple[type, ...]:
    return tuple(_HANDLERS.get(op, {}))


def params_of(node: Any) -> int:
    """Parameter elements of a node (tied weights once; a tied head adds only what it owns)."""
    return dispatch("params", node)


def tensors_of(node: Any, path: str = "") -> tuple[GraphTensor, ...]:
    """The parameter tensors of a node placed at `path` (its own full dotted path; '' names them relative)."""
    return tuple(dispatch("tensors", node, path))


Child = tuple[str, "int | None", Any, str]
"""(field name, index in a tuple field or None, child node, child's full path)."""


def children_of(node: Any, path: str) -> Iterator[Child]:
    """A composite node's direct children with their paths; leaves (no 'children' handler) have none."""
    if not has_handler("children", node):
        return iter(())
    return iter(dispatch("children", node, path))


def walk(node: Any, path: str = "", parents: tuple = ()) -> Iterator[tuple[str, Any, tuple]]:
    """Every node under `node` (itself first) with its path and its ancestry: ((ancestor, field), ...)."""
    yield path, node, parents
    for field, _, child, child_path in children_of(node, path):
        yield from walk(child, child_path, parents + ((node, field),))


def join(path: str, name: str) -> str:
    if not name:
        return path
    return f"{path}.{name}" if path else name


def field_children(node: Any, path: str, fields: Iterable[str]) -> Iterator[Child]:
    """Children held in the named fields (a node, a tuple of nodes, or None), each at join(path, child.name)."""
    for field in fields:
        value = getattr(node, field)
        if value is None:
            continue
        if isinstance(value, tuple):
            for index, child in enumerate(value):
                yield field, index, child, join(path, child.name)
        else:
            yield field, None, value, join(path, value.name)


def children_tensors(node: Any, path: str) -> Iterator[GraphTensor]:
    """A composite's tensors: its children's, in order."""
    for _, _, child, child_path in children_of(node, path):
        yield from tensors_of(child, child_path)


def children_params(node: Any, path: str = "") -> int:
    return sum(params_of(child) for _, _, child, _ in children_of(node, path))

"""Slots and nodes: the tensors and storages a recording refers to, without holding intermediates."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from graphbuf.graphs.emulator.ops import OpInfo, bind, contiguous

# --------------------------------------------------------------------------------------------------------
# Slots and nodes: what a recording refers to, without holding intermediates
# --------------------------------------------------------------------------------------------------------


class Group:
    """A storage the recording refers to (every slot viewing it shares the group)."""

    __slots__ = ("created", "nbytes", "owner", "sid", "static", "storage")

    def __init__(self, created: bool, storage: torch.UntypedStorage, owner: int | None) -> None:
        self.created = created  # allocated by a recorded op; else it existed before, or came from outside
        self.storage = weakref.ref(storage)
        self.sid = storage._cdata
        self.owner = owner  # the task group whose op allocated it, or None
        self.static = not created  # a created storage is static iff it is alive when its recording ends
        self.nbytes = storage.nbytes()


class Slot:
    """A tensor the recording refers to. ``tensor`` holds it strongly (inputs; after recording, every static
    slot); during recording a created tensor is only weakly referenced (``ref``), so it dies with its last
    user. After recording, a slot with ``tensor`` None is transient (replay produces it as a local), unless
    it is an ``input``: a tensor that existed before capture, held only weakly once the recording is compiled
    (``ref``) and passed to the replay function as an argument after the liveness and address check."""

    __slots__ = ("group", "index", "input", "key", "meta", "ref", "tensor")

    def __init__(self, index: int, t: torch.Tensor, group: Group, strong: bool) -> None:
        self.index = index
        self.key = id(t)
        self.group = group
        self.meta = (t.size(), t.stride(), t.storage_offset(), t.dtype, t.device)
        self.tensor: torch.Tensor | None = t if strong else None
        self.ref: weakref.ref[torch.Tensor] | None = None if strong else weakref.ref(t)
        self.input = False

    @property
    def transient(self) -> bool:
        """Produced by each replay as a local (not held between replays, not an input)."""
        return self.tensor is None and not self.input

    def release(self) -> None:
        """An input: hold it weakly from now on (the emulator must not keep a freed input alive)."""
        if self.tensor is not None:
            self.ref, self.tensor = weakref.ref(self.tensor), None

    def held(self) -> torch.Tensor | None:
        if self.tensor is not None:
            return self.tensor
        return None if self.ref is None else self.ref()


class Seq:
    """A list or tuple argument that holds tensors, with the tensors replaced by their slots."""

    __slots__ = ("is_tuple", "items")

    def __init__(self, items: list[Any], is_tuple: bool) -> None:
        self.items = items
        self.is_tuple = is_tuple


def slots_in(value: Any) -> list[Slot]:
    if isinstance(value, Slot):
        return [value]
    if isinstance(value, Seq):
        value = value.items
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in slots_in(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in slots_in(v)]
    return []


def materialize(value: Any) -> Any:
    """``value`` with every slot replaced by its (held) tensor."""
    if isinstance(value, Slot):
        return value.held()
    if isinstance(value, Seq):
        items = [materialize(v) for v in value.items]
        return tuple(items) if value.is_tuple else items
    if isinstance(value, (list, tuple)):
        return type(value)(materialize(v) for v in value)
    return value


def rebuild(meta: tuple[Any, ...], storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor with a dead slot's recorded geometry over its (static, alive) storage."""
    size, stride, offset, dtype, device = meta
    return torch.empty((0,), dtype=dtype, device=device).set_(storage, offset, size, stride)


def _kind(value: Any, first: Any) -> Any:
    """What a recipe's validity may depend on: per tensor its dtype, rank, contiguity, emptiness, device and
    whether it has the first result's shape; per host value its type."""
    if isinstance(value, Slot):
        size, stride, _, dtype, device = value.meta
        return (dtype, len(size), contiguous(size, stride), 0 in size, device.type, size == first)
    if isinstance(value, (Seq, list, tuple)):
        items = value.items if isinstance(value, Seq) else value
        return (type(value), tuple(_kind(v, first) for v in items))
    return type(value)


class Node:
    """One recorded op over slots; ``calls`` is how replay runs it (set when its recording ends)."""

    __slots__ = ("all_new", "args", "binding", "calls", "func", "info", "kwargs", "new", "results", "single")

    def __init__(
        self,
        func: torch._ops.OpOverload,
        info: OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        results: tuple[Any, ...],
        new: frozenset[int],
        all_new: bool,
    ) -> None:
        self.func = func
        self.info = info
        self.args = args
        self.kwargs = kwargs
        self.results = results  # per return: a slot, a list of slots (None for non-tensors), or None
        self.single = len(info.returns_alias) == 1
        self.new = new  # indices of the slots whose storage this op allocated
        self.all_new = all_new  # every return holds tensors, all with storage this op allocated
        self.binding = False
        # codegen.Call objects (typed Any: codegen imports this module, not the other way round)
        self.calls: tuple[Any, ...] = ()

    def bound(self) -> dict[str, Any]:
        return bind(self.info, self.args, self.kwargs)

    def recipe_key(self) -> tuple[Any, ...]:
        first = slots_in(self.results)[0].meta[0]
        bound = self.bound()
        return (
            self.func,
            tuple((name, _kind(v, first)) for name, v in bound.items()),
            tuple(_kind(r, first) for r in self.results),
        )

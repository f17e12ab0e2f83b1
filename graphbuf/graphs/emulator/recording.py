"""The recorder: a dispatch mode that runs each aten op under the capture guards, records it as a node over
slots, and snapshots pre-existing memory it writes (restored when recording ends)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from graphbuf.errors import CaptureError
from graphbuf.graphs.emulator.ops import (
    OpInfo,
    bind,
    is_composite,
    nbytes,
    op_info,
    shaped_like_result,
    tensor_geometry,
    tensors_in,
    uses_binding,
)
from graphbuf.graphs.emulator.shortcuts import CHECK_AT_RECORD_BYTES, RECIPES, find_recipe
from graphbuf.graphs.emulator.slots import Group, Node, Seq, Slot
from graphbuf.graphs.guards import check_dispatch
from graphbuf.graphs.modes import DispatchMode

#: A dry recording computes functional ops whose tensor arguments hold at most this many bytes (their meta
#: kernels can cost more than the op) and shapes the others without computing them.
DRY_FROM_BYTES = 1 << 16

#: Op signatures a dry recording has run for real once: the op; per tensor its dtype, device, rank and
#: contiguity; per host number its type and sign (and finiteness); other host values (dtypes, strings, None)
#: as they are; lists by the set of their items' keys. The checks a kernel makes beyond its meta kernel
#: (dtypes it implements, ``pow_(-1)`` on integers, division by a zero scalar) depend on no more, so a
#: signature that ran once is only shaped (functional ops) or skipped (writes) from then on. Bounded: host
#: numbers that change per step (a task's host lengths) do not make new signatures.
VERIFIED: set[tuple[Any, ...]] = set()

#: The arguments ops index by (index_select, gather, index_copy_, scatter: ``index``; embedding,
#: index.Tensor, index_put_: ``indices``): a kernel bound-checks their values.
_INDEX_ARGS = ("index", "indices")


class Registry(Protocol):
    """What a recorder needs of its emulator (:class:`~graphbuf.graphs.emulator.replay.Emulator`): the slot
    and storage registries, the next slot index, and task labels. A protocol, so this module does not import
    the emulator that imports it."""

    by_id: dict[int, Slot]
    by_sid: dict[int, Group]
    next_index: int

    def forget(self, slots: Iterable[Slot], groups: Iterable[Group]) -> None: ...

    def task_label(self, group: int) -> str: ...


# --------------------------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------------------------


class Segment:
    """A run of recorded nodes: the main recording between tasks, or one task group."""

    __slots__ = ("group", "groups", "kinds", "label", "nodes", "slots")

    def __init__(self, group: int | None, label: str = "") -> None:
        self.group = group  # index in Emulator._segments when this is a task group, else None
        self.label = label
        self.nodes: list[Node] = []
        self.slots: list[Slot] = []  # slots first registered while this segment was recording
        self.groups: list[Group] = []  # storages first seen while this segment was recording
        self.kinds: Counter[str] = Counter()


STATE = threading.local()


def recording_active() -> bool:
    return getattr(STATE, "recording", False)


class Recorder(DispatchMode):
    """Runs each aten op, records it as a node over slots, and snapshots pre-existing memory it writes."""

    def __init__(self, emulator: Registry, segment: Segment, restore: bool, dry: bool = False) -> None:
        super().__init__()
        # dry: record without computing, as a device records a task update: functional ops give
        # uninitialized results of the right geometry, writes are skipped (they would be restored anyway).
        self.dry = dry
        self.emulator = emulator
        self.segment = segment
        self._restore = restore
        self.slots: list[Slot] = []  # every slot registered by this recording session
        self.groups: list[Group] = []  # every storage group first seen by it
        self._spans: dict[int, list[tuple[int, int]]] = {}
        self._snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._used: set[int] = set()  # slots of tensors from before capture that recorded ops took

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_dispatch(func, args, kwargs)
        if is_composite(func):
            # Under inference_mode composite ops (reshape, einsum, softmax, to, ...) reach this mode whole;
            # record what they decompose into, as outside inference_mode, so every recorded op has exact
            # aliasing and, mostly, an out= overload.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        info = op_info(func)
        bound = bind(info, args, kwargs)
        slots = {id(t): self._input(t) for t in tensors_in(bound.values())}
        self._check_task_outputs(func, slots.values())
        written = tensors_in(bound.get(name) for name in info.writes) if info.writes else []
        if self._restore:
            for t in written:
                if not slots[id(t)].group.created:
                    self._snapshot(t)
        watch = [(t, tensor_geometry(t)) for t in written] if info.restrides or info.inplace_view else []
        try:
            result = (
                self._run(func, info, args, kwargs, bound, slots)
                if self.dry
                else self._computed(func, info, args, kwargs, bound)
            )
        except Exception as exc:
            name_op(exc, func)
            raise
        for t, geometry in watch:
            if tensor_geometry(t) != geometry:
                self._restrided(func, slots[id(t)], t)
        self._record(func, info, args, kwargs, bound, slots, result)
        self._used.update(s.index for s in slots.values() if not s.group.created)
        return result

    def _restrided(self, func: torch._ops.OpOverload, slot: Slot, t: torch.Tensor) -> None:
        """``func`` changed the metadata of ``t`` in place (t_, transpose_, as_strided_, resize_, an out=
        resize). The ops recorded before it used ``t`` with its old geometry and those after use the new
        one, as on a device, where each kernel bakes in the geometry it was launched with: ``slot`` keeps
        the old geometry (replay rebuilds it over the same storage) and ``t`` gets a slot of its own, held
        (replay uses the object itself). A tensor from before capture cannot be split so (the recording
        holds it weakly and checks it before each replay): re-strided after the recording used it, it is a
        :class:`CaptureError`."""
        if not slot.group.created:
            if slot.index in self._used:
                size, stride = list(slot.meta[0]), list(slot.meta[1])
                raise CaptureError(
                    f"{func} changed the shape or strides of a tensor from before capture (shape {size} "
                    f"stride {stride} -> {list(t.shape)} {list(t.stride())}) after the capture used it: a "
                    "device graph's earlier kernels keep its old geometry, its later ones the new one. "
                    "Re-stride a view (x = x.t()) instead, or change it before capture."
                )
            return
        slot.tensor, slot.ref = None, None  # rebuilt with its recorded (old) geometry when recording ends
        storage = t.untyped_storage()
        group = self._storage_group(storage) or self._new_group(True, storage)
        self._add(t, group, strong=True)

    def _computed(
        self,
        func: torch._ops.OpOverload,
        info: OpInfo,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        bound: Mapping[str, Any],
    ) -> Any:
        """An op of a recording that computes; its signature is then known to pass the kernel's checks."""
        result = func(*args, **kwargs)
        if not _always_run(info):
            _verified(func, bound)
        return result

    def _run(
        self,
        func: torch._ops.OpOverload,
        info: OpInfo,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        bound: Mapping[str, Any],
        slots: Mapping[int, Slot],
    ) -> Any:
        """A dry op: views, metadata changes, resizes, random and non-tensor ops run; so does any op whose
        signature has not run for real yet (:data:`VERIFIED`: what a kernel checks beyond its meta kernel
        is raised here, at capture, as a computing capture raises it), an op indexing by a tensor from
        before capture (its bounds are checked on those values, as a computing capture checks them), and
        a write whose target overlaps itself or another argument (overlap is checked by the kernel, per
        call). The rest is not computed: a write is skipped, a functional op over :data:`DRY_FROM_BYTES`
        shaped by its meta kernel."""
        if _always_run(info):
            return func(*args, **kwargs)
        indices = tensors_in(bound.get(name) for name in _INDEX_ARGS)
        if any(not slots[id(t)].group.created for t in indices):
            return func(*args, **kwargs)
        key = _signature(func, bound)
        if key is None or key not in VERIFIED:
            result = func(*args, **kwargs)
            if key is not None:
                VERIFIED.add(key)
            return result
        if info.writes:
            if len(info.writes) != len(info.returns_alias) or not all(info.returns_alias):
                return func(*args, **kwargs)
            written = [bound[name] for name in info.writes]  # in-place: what the op returns is its target
            if _overlapping(written, tensors_in(bound.values())):
                return func(*args, **kwargs)
            return written[0] if len(written) == 1 else tuple(written)
        if any(info.returns_alias):
            return func(*args, **kwargs)
        tensors = tensors_in(bound.values())
        if not tensors or nbytes(tensors) <= DRY_FROM_BYTES:  # cheaper computed than shaped by meta
            return func(*args, **kwargs)
        try:
            return shaped_like_result(func, args, kwargs, tensors[0].device)
        except NotImplementedError:
            return func(*args, **kwargs)

    # ---- slots ----------------------------------------------------------------------------------------

    def _known(self, t: torch.Tensor) -> Slot | None:
        slot = self.emulator.by_id.get(id(t))
        return slot if slot is not None and slot.held() is t else None

    def _add(self, t: torch.Tensor, group: Group, strong: bool) -> Slot:
        em = self.emulator
        strong = strong or t.is_conj() or t.is_neg() or t.layout != torch.strided  # not rebuildable
        slot = Slot(em.next_index, t, group, strong)
        em.next_index += 1
        em.by_id[slot.key] = slot
        self.slots.append(slot)
        self.segment.slots.append(slot)
        return slot

    def _new_group(self, created: bool, storage: torch.UntypedStorage) -> Group:
        group = Group(created, storage, self.segment.group if created else None)
        self.emulator.by_sid[group.sid] = group
        self.groups.append(group)
        self.segment.groups.append(group)
        return group

    def _storage_group(self, storage: torch.UntypedStorage) -> Group | None:
        group = self.emulator.by_sid.get(storage._cdata)
        return group if group is not None and group.storage() is storage else None

    def _input(self, t: torch.Tensor) -> Slot:
        slot = self._known(t)
        if slot is None:
            # Existed before capture (an input), or made outside the dispatcher (a wrapped scalar): held.
            storage = t.untyped_storage()
            group = self._storage_group(storage) or self._new_group(False, storage)
            slot = self._add(t, group, strong=True)
            slot.input = True  # until settle finds nothing outside the recording holds it
        return slot

    def _result(self, t: torch.Tensor, fresh: dict[int, Group]) -> tuple[Slot, bool]:
        slot = self._known(t)
        if slot is not None:
            return slot, False
        storage = t.untyped_storage()
        group = self._storage_group(storage)
        if group is not None:  # a view or alias: shares a storage the recording already knows
            return self._add(t, group, strong=not group.created), False
        group = fresh.get(storage._cdata)
        if group is None:
            group = fresh[storage._cdata] = self._new_group(True, storage)
        return self._add(t, group, strong=False), True

    def _template(self, value: Any, slots: Mapping[int, Slot]) -> Any:
        if isinstance(value, torch.Tensor):
            return slots[id(value)]
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, torch.Tensor) for v in value):
                return Seq([self._template(v, slots) for v in value], isinstance(value, tuple))
            return list(value) if isinstance(value, list) else value  # a copy: host lists are baked
        return value

    # ---- checks and snapshots -------------------------------------------------------------------------

    def _check_task_outputs(self, func: torch._ops.OpOverload, slots: Iterable[Slot]) -> None:
        for slot in slots:
            owner = slot.group.owner
            if owner is not None and owner != self.segment.group:
                label = self.emulator.task_label(owner)
                raise CaptureError(
                    f"{func} reads a tensor that task {label!r} created inside its task group; when the "
                    "task is re-issued with new host arguments that tensor would go stale. Have the task "
                    "write its results into a preallocated tensor passed among its tensor_args."
                )

    def _snapshot(self, t: torch.Tensor) -> None:
        """Save the bytes of ``t``'s storage that ``t`` spans (once per range), for :meth:`restore`."""
        if t.numel() == 0:
            return
        item = t.element_size()
        lo = t.storage_offset() * item
        hi = lo + (1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True))) * item
        storage = t.untyped_storage()
        spans = self._spans.setdefault(storage._cdata, [])
        if any(a <= lo and hi <= b for a, b in spans):
            return
        spans.append((lo, hi))
        # Restoring in reverse order leaves every byte with the value of the earliest snapshot covering it,
        # taken before any write to that byte.
        view = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(storage, lo, (hi - lo,), (1,))
        self._snapshots.append((view, view.clone()))

    def restore(self) -> None:
        """Put back every pre-existing byte range written during this recording session."""
        with torch.inference_mode():
            for view, saved in reversed(self._snapshots):
                view.copy_(saved)
        self._snapshots.clear()
        self._spans.clear()

    def discard(self) -> None:
        """Forget every slot and storage this (failed) session registered."""
        self.emulator.forget(self.slots, self.groups)

    # ---- recording ------------------------------------------------------------------------------------

    def _record(
        self,
        func: torch._ops.OpOverload,
        info: OpInfo,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        bound: Mapping[str, Any],
        slots: Mapping[int, Slot],
        result: Any,
    ) -> None:
        single = len(info.returns_alias) == 1
        values: tuple[Any, ...] = (result,) if single else tuple(result or ())
        fresh: dict[int, Group] = {}
        new: set[int] = set()
        all_new = bool(values)
        pattern: list[Any] = []
        for value in values:
            if isinstance(value, torch.Tensor):
                slot, is_new = self._result(value, fresh)
                pattern.append(slot)
                if is_new:
                    new.add(slot.index)
                all_new = all_new and is_new
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                items: list[Slot | None] = []
                for v in value:
                    if isinstance(v, torch.Tensor):
                        slot, is_new = self._result(v, fresh)
                        items.append(slot)
                        if is_new:
                            new.add(slot.index)
                        all_new = all_new and is_new
                    else:
                        items.append(None)
                        all_new = False
                pattern.append(items)
            else:
                pattern.append(None)
                all_new = False
        node = Node(
            func,
            info,
            tuple(self._template(a, slots) for a in args),
            {k: self._template(v, slots) for k, v in kwargs.items()},
            tuple(pattern),
            frozenset(new),
            all_new,
        )
        node.binding = uses_binding(func, info, args, kwargs, bound)
        if all_new and not info.writes and not self.dry and nbytes(values) <= CHECK_AT_RECORD_BYTES:
            # Cheap now, on the exact inputs; needed only if the results turn out static.
            key = node.recipe_key()
            if key not in RECIPES:
                RECIPES[key] = find_recipe(func, info, bound, values, None if info.seeded else values)
        self.segment.nodes.append(node)


def _always_run(info: OpInfo) -> bool:
    """Ops a dry recording always runs (random, in-place view, re-striding, no tensor out): never verified."""
    return info.seeded or info.inplace_view or info.restrides or not info.tensors_out


def _verified(func: torch._ops.OpOverload, bound: Mapping[str, Any]) -> None:
    """Records that ``func``'s signature ran for real (:data:`VERIFIED`)."""
    key = _signature(func, bound)
    if key is not None:
        VERIFIED.add(key)


def _signature(func: torch._ops.OpOverload, bound: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a kernel's checks beyond its meta kernel may depend on (see :data:`VERIFIED`); None if a host
    argument cannot be keyed (then the op always runs)."""
    try:
        key = (func, tuple((name, _key(v)) for name, v in bound.items()))
        hash(key)
    except TypeError:
        return None
    return key


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value
        return (torch.Tensor, t.dtype, t.device.type, t.dim(), t.is_contiguous(), t.layout)
    if isinstance(value, (list, tuple)):
        return (type(value), frozenset(_key(v) for v in value))
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return (type(value), (value > 0) - (value < 0), value == value and abs(value) != float("inf"))
    if isinstance(value, complex):
        return complex
    return (type(value), value)


def _overlapping(written: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> bool:
    """A written tensor with elements sharing memory (an expanded view), or sharing its storage with another
    tensor argument (the kernel refuses a partial overlap: ``x[1:].copy_(x[:-1])``)."""
    for w in written:
        if torch._debug_has_internal_overlap(w) != 0:
            return True
        sid = w.untyped_storage()._cdata
        if any(t is not w and t.untyped_storage()._cdata == sid for t in tensors):
            return True
    return False


#: The note :func:`name_op` adds: ``{op}`` is the aten op.
OP_NOTE = "graphbuf: raised by {op} during capture"


def name_op(exc: BaseException, func: torch._ops.OpOverload) -> None:
    """Note on ``exc`` the op that raised it (the innermost one), as ``BaseException.add_note`` does from
    Python 3.11; its type and message stay the caller's to catch."""
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        notes = exc.__notes__ = []
    if not any(isinstance(n, str) and n.startswith("graphbuf: raised by") for n in notes):
        notes.append(OP_NOTE.format(op=func))

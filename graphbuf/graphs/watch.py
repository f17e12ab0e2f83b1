"""Watched tensors: what a captured graph uses but does not own, checked before every replay.

A device graph bakes in the address, shape, strides and element type of every tensor it reads or writes. A
tensor that was rebound (``set_``), resized, restrided or re-typed (``t.data = t.data.view(torch.int32)``)
after capture, or freed, makes the next replay read the wrong memory (or released memory, or the old type's
bits) without any error. :class:`Watch` holds each such tensor weakly, with the geometry it had
at capture, and :meth:`Watch.check` verifies all of them in one pass: a list of weak-reference calls and one
comparison of tuples, no per-tensor branching on the fast path.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from graphbuf.errors import AddressChangedError, LivenessError

__all__ = ["Checked", "Watch"]

_Geometry = tuple[int, torch.Size, tuple[int, ...], torch.dtype]


def _geometry(t: torch.Tensor) -> _Geometry:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


class Checked(list):
    """The live tensors one :meth:`Watch.check` returned, and the watch that checked them."""

    __slots__ = ("watch",)


class Watch:
    """Tensors checked before each replay: alive, and at their captured address, shape, stride and dtype.

    Entries keep the order they were given in (one tensor may appear more than once). The watch holds no
    strong reference: a tensor freed after capture is reported, not kept. Liveness is that of the tensor
    object the capture received: dropping that object counts as freeing it even if a base or another view
    keeps its memory (keep the tensors a graph uses alive as long as the graph, as servers do).
    """

    __slots__ = ("_expected", "_ids", "_labels", "_refs")

    def __init__(self, entries: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        self._labels: list[str] = []
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self._ids: dict[int, int] = {}
        self._expected: list[_Geometry] = []
        for label, t in entries:
            self._append(label, t, _geometry(t))

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def labels(self) -> tuple[str, ...]:
        """How each watched tensor is named in errors, in watch order."""
        return tuple(self._labels)

    def named(self, names: Mapping[str, torch.Tensor]) -> Watch:
        """A watch that calls each tensor of ``names`` by its key (``label -> tensor``) and watches those it
        did not watch yet, appended at the end. Tensors already watched keep their captured geometry."""
        by_id = {id(t): label for label, t in names.items()}
        out = Watch()
        for label, ref, geometry in zip(self._labels, self._refs, self._expected, strict=True):
            t = ref()
            if t is None:  # already dead: keep the entry so the next check reports it
                out._append_dead(label, ref, geometry)
                continue
            out._append(by_id.get(id(t), label), t, geometry)
        for label, t in names.items():
            if id(t) not in out._ids:
                out._append(label, t, _geometry(t))
        return out

    def _append(self, label: str, t: torch.Tensor, geometry: _Geometry) -> None:
        self._ids.setdefault(id(t), len(self._refs))
        self._labels.append(label)
        self._refs.append(weakref.ref(t))
        self._expected.append(geometry)

    def _append_dead(self, label: str, ref: weakref.ref[torch.Tensor], geometry: _Geometry) -> None:
        self._labels.append(label)
        self._refs.append(ref)
        self._expected.append(geometry)

    def check(self, where: str = "replay") -> Checked:
        """The watched tensors, in watch order, after checking that each is alive and unmoved.

        Raises :class:`~graphbuf.errors.LivenessError` for a freed tensor and
        :class:`~graphbuf.errors.AddressChangedError` for one rebound, resized, restrided or re-typed;
        ``where`` says what was about to happen (it prefixes the message).
        """
        live = Checked([r() for r in self._refs])
        live.watch = self
        try:
            now = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in live]  # type: ignore[union-attr]
        except AttributeError:  # a None: freed
            raise self._error(live, where) from None
        if now != self._expected:
            raise self._error(live, where)
        return live

    def _error(self, live: Sequence[torch.Tensor | None], where: str) -> Exception:
        for label, t, (ptr, shape, stride, dtype) in zip(self._labels, live, self._expected, strict=True):
            if t is None:
                return LivenessError(
                    f"{where}: {label} (captured at {ptr:#x}, shape {list(shape)}) was freed after capture; "
                    "the graph would read or write released memory. Keep every tensor a graph uses alive "
                    "as long as the graph, or capture again."
                )
            if _geometry(t) != (ptr, shape, stride, dtype):
                return AddressChangedError(
                    f"{where}: {label} moved: captured at {ptr:#x} shape {list(shape)} stride "
                    f"{list(stride)} {_name(dtype)}, now {t.data_ptr():#x} shape {list(t.shape)} stride "
                    f"{list(t.stride())} {_name(t.dtype)}; the graph still uses the captured address and "
                    "type. It was rebound (set_, .data = or a new tensor), resized, restrided or re-typed "
                    "instead of written in place; copy into it (t.copy_(new)) or capture again."
                )
        return AddressChangedError(f"{where}: watched tensors changed")  # unreachable: the lists differed


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

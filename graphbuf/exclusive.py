"""One caller at a time: the guard :class:`graphbuf.StaticBuffers` and :class:`graphbuf.GraphRunner` take on
every public call. A second caller raises :class:`~graphbuf.errors.ConcurrentUseError` instead of waiting
(waiting would hide a sharing bug behind a stall)."""

from __future__ import annotations

import threading
from types import TracebackType

from graphbuf.errors import ConcurrentUseError

__all__ = ["Exclusive"]


class Exclusive:
    """A non-blocking lock: ``with guard.hold("refresh()"):`` runs the block, or raises
    :class:`ConcurrentUseError` (``busy`` formatted with ``{call}``) while another caller holds it."""

    __slots__ = ("_busy", "lock", "release")

    def __init__(self, busy: str) -> None:
        self._busy = busy
        #: The lock itself; native callers (staged writes) take it without waiting (``acquire(False)``).
        self.lock = threading.Lock()
        #: Release the guard taken by :meth:`enter` (the lock's own method: no Python frame on the hot path).
        self.release = self.lock.release

    def enter(self, call: str) -> None:
        """Take the guard for ``call`` without a ``with`` block; pair with :meth:`release` in ``finally``
        (the form :meth:`graphbuf.StaticBuffers.refresh` uses: two calls fewer per refresh)."""
        if not self.lock.acquire(False):
            raise self.busy(call)

    def busy(self, call: str) -> ConcurrentUseError:
        """The error a second caller of ``call`` gets."""
        return ConcurrentUseError(self._busy.format(call=call))

    def hold(self, call: str) -> Exclusive:
        """Take the guard for ``call``; the ``with`` block that follows releases it."""
        if not self.lock.acquire(False):
            raise self.busy(call)
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock.release()

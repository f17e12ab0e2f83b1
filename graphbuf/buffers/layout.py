"""The layout, resolved once when buffers are made: per buffer everything the hot path needs, and the errors
that name a buffer. Nothing here touches buffer memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphbuf.errors import RefreshError
from graphbuf.planning.planner import BufferPlan, Plan

__all__ = ["NP_OF_TORCH", "Layout", "ResolvedBuffer", "dtype_name", "where"]

#: The dtypes torch and numpy share, by name.
_SHARED = "bool uint8 int8 int16 int32 int64 float16 float32 float64 uint16 uint32 uint64"
NP_OF_TORCH: dict[torch.dtype, np.dtype] = {getattr(torch, n): np.dtype(n) for n in _SHARED.split()}


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def where(op: str, size: int | str) -> str:
    """The call label errors start with: ``refresh(size=8)``, ``eager(size=40)``, or a name (``bind()``)."""
    return f"{op}(size={size})" if isinstance(size, int) else size


@dataclass(frozen=True)
class ResolvedBuffer:
    """One buffer, resolved once."""

    plan: BufferPlan
    index: int  # position in slab order
    np_dtype: np.dtype  # element type of numpy views of the slab (int16 bits for bfloat16)
    bf16: bool
    kind: str  # numpy kind of the logical dtype: b, i, u, f
    pad: Any  # pad as a numpy scalar of np_dtype (0 when repeat_last: the clean value)
    repeat_last: bool
    capacity: dict[int, tuple[int, int]]  # capture size → (rows, cols); cols 0 for 1-D
    rows_of_requests: tuple[int, ...] | None  # live requests → rows; None: rows don't depend on them
    requests_of_rows: dict[int, int] | None
    lo: int | None
    hi: int | None
    fast: frozenset[np.dtype]  # host dtypes cast safely without a value check; empty for float buffers
    ndim: int
    itemsize: int  # bytes per element
    bounded: bool  # min or max declared
    name: str  # the plan's name (a field: the hot paths read it per source)


class Layout:
    """Every buffer of a plan as a :class:`ResolvedBuffer`, plus the facts refresh front-ends share."""

    def __init__(self, plan: Plan, backend: Any) -> None:
        self.plan = plan
        self.backend = backend  #: runs every check and write (a :class:`graphbuf.buffers.backend.Backend`)
        self.tokens_per_request = tpr = plan.tokens_per_request
        self.max_requests = {s: s // tpr for s in plan.capture_sizes}
        self.slots: dict[str, ResolvedBuffer] = {b.name: self._slot(i, b) for i, b in enumerate(plan.buffers)}
        self.order = tuple(self.slots.values())
        self.required = frozenset(s.name for s in self.order if not s.plan.keep)
        self.per_group = frozenset(b.spec_name for b in plan.buffers if b.group is not None)

    def _slot(self, index: int, b: BufferPlan) -> ResolvedBuffer:
        bf16 = b.dtype == torch.bfloat16
        np_dtype = np.dtype(np.int16) if bf16 else NP_OF_TORCH[b.dtype]
        kind = "f" if bf16 else np_dtype.kind
        capacity = {s: self._shape(b, s) for s in self.plan.capture_sizes}
        rows_of_requests = requests_of_rows = None
        if b.rows.names & {"tokens", "requests"}:
            rows_of_requests = tuple(self._rows(b, r) for r in range(max(self.max_requests.values()) + 1))
            requests_of_rows = {n: r for r, n in reversed(list(enumerate(rows_of_requests)))}  # the fewest
        repeat_last = b.pad == "repeat_last"
        pad = host_value(0 if repeat_last else b.pad, b.dtype, np_dtype)
        # float sources take the general path: it looks for NaN
        fast = frozenset(d for d in NP_OF_TORCH.values() if kind != "f" and np.can_cast(d, np_dtype, "safe"))
        return ResolvedBuffer(
            b, index, np_dtype, bf16, kind, pad, repeat_last, capacity, rows_of_requests, requests_of_rows,
            b.min, b.max, fast, b.ndim, np_dtype.itemsize, b.min is not None or b.max is not None, b.name,
        )  # fmt: skip

    def capacity(self, slot: ResolvedBuffer, size: int) -> tuple[int, int]:
        """(rows, cols) ``slot`` holds at ``size`` tokens: a capture size, or any count for an eager step."""
        cap = slot.capacity.get(size)
        return cap if cap is not None else self._shape(slot.plan, size)

    def _shape(self, b: BufferPlan, size: int) -> tuple[int, int]:
        shape = self.plan.shape_at(b, size)
        return shape[0], shape[1] if len(shape) > 1 else 0

    def _rows(self, b: BufferPlan, requests: int) -> int:
        return b.rows.eval(self.plan.env(requests * self.tokens_per_request))

    def eager_bytes(self, size: int, limit: int) -> int:
        """Bytes of every buffer's shape at ``size`` tokens (an eager step), summed until above ``limit``."""
        total = 0
        for slot in self.order:
            rows, cols = self.capacity(slot, size)
            total += rows * (cols or 1) * slot.itemsize
            if total > limit:
                break
        return total

    def rows_at(self, slot: ResolvedBuffer, size: int, num_reqs: int) -> int:
        """The live rows of ``slot`` at ``num_reqs`` requests (its capacity if rows don't follow requests)."""
        table = slot.rows_of_requests
        if table is None:
            return self.capacity(slot, size)[0]
        return table[num_reqs] if num_reqs < len(table) else self._rows(slot.plan, num_reqs)

    @staticmethod
    def fail(cls: type[RefreshError], name: str, label: str, msg: str) -> RefreshError:
        return cls(f"{label}: buffer {name!r}: {msg}")

    def size_error(self, op: str, size: Any) -> RefreshError:
        sizes = ", ".join(map(str, self.plan.capture_sizes))
        return RefreshError(f"{op}(size={size!r}): not a capture size; sizes: {sizes}")

    def missing_error(self, label: str, given: Iterable[str]) -> RefreshError:
        missing = ", ".join(sorted(self.required.difference(given)))
        return RefreshError(
            f"{label}: missing buffer(s) {missing}; only buffers declared 'keep: true' may be omitted"
        )

    def slot(self, label: str, name: Any) -> ResolvedBuffer:
        slot = self.slots.get(name) if isinstance(name, str) else None
        if slot is None:
            if isinstance(name, str) and name in self.per_group:
                names = ", ".join(s.name for s in self.order if s.plan.spec_name == name)
                raise self.fail(
                    RefreshError, name, label, f"is declared per group; pass each group's buffer: {names}"
                )
            raise self.fail(RefreshError, str(name), label, f"unknown buffer; known: {', '.join(self.slots)}")
        return slot


def host_value(value: Any, dtype: torch.dtype, np_dtype: np.dtype) -> Any:
    """``value`` as the numpy scalar stored in the slab (bfloat16 as its int16 bits)."""
    if dtype == torch.bfloat16:
        return np.int16(torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item())
    return np_dtype.type(value)

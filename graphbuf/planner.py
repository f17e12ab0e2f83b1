"""The memory plan: every buffer resolved to dtype, shape at the largest capture size, bytes and offset.

A plan is pure host-side arithmetic; nothing is allocated. :class:`graphbuf.StaticBuffers` allocates one slab
of :attr:`Plan.total_bytes` and carves every buffer out of it at :attr:`BufferPlan.offset`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from graphbuf.errors import PlanTooLargeError
from graphbuf.expr import Expr, parse_expr
from graphbuf.spec import GraphSpec, capture_sizes_of, check_spec, load_spec

__all__ = ["ALIGNMENT", "BufferPlan", "Plan", "WorkspacePlan", "plan", "torch_dtype"]

#: Byte alignment of every buffer inside the slab (covers CUDA's 256 B and Ascend's 512 B).
ALIGNMENT = 512


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name."""
    return getattr(torch, name)


@dataclass(frozen=True)
class BufferPlan:
    """One allocated buffer. ``shape`` is the allocation (the largest rows/cols over all capture sizes)."""

    name: str
    spec_name: str
    group: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    rows: Expr
    cols: Expr | None
    pad: int | float | str
    overflow: str
    keep: bool
    min: int | None
    max: int | None
    description: str = ""

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class WorkspacePlan:
    """Memory a task materializes per capture size (reported, not allocated by graphbuf)."""

    name: str
    dtype: torch.dtype
    shape: tuple[Expr, ...]
    description: str = ""


@dataclass(frozen=True)
class Plan:
    """A resolved spec: constants, capture sizes (sorted), buffer layout and total slab bytes."""

    spec: GraphSpec
    constants: Mapping[str, int | None]
    tokens_per_request: int
    capture_sizes: tuple[int, ...]
    buffers: tuple[BufferPlan, ...]
    workspaces: tuple[WorkspacePlan, ...]
    total_bytes: int
    max_bytes: int
    _by_name: Mapping[str, BufferPlan] = field(repr=False, compare=False, default_factory=dict)
    _requests_memo: dict[tuple[str, int], int | None] = field(repr=False, compare=False, default_factory=dict)

    def __getitem__(self, name: str) -> BufferPlan:
        return self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers)

    def env(self, tokens: int) -> dict[str, int | None]:
        """Expression environment at a token count: the constants plus ``tokens`` and ``requests``."""
        return {**self.constants, "tokens": tokens, "requests": tokens // self.tokens_per_request}

    def shape_at(self, buf: BufferPlan, tokens: int) -> tuple[int, ...]:
        """The shape of ``buf`` captured at ``tokens``."""
        env = self.env(tokens)
        rows = buf.rows.eval(env)
        return (rows,) if buf.cols is None else (rows, buf.cols.eval(env))

    def requests_for_rows(self, name: str, rows: int) -> int | None:
        """The smallest live request count at which buffer ``name`` has ``rows`` rows (None if none does).

        Searches request counts up to ``rows + 1`` times the largest capture's requests; rules are expected
        to grow with the request count (``requests``, ``requests + 1``, ``tokens``).
        """
        key = (name, rows)
        if key not in self._requests_memo:
            self._requests_memo[key] = self._solve_requests(self[name], rows)
        return self._requests_memo[key]

    def _solve_requests(self, buf: BufferPlan, rows: int) -> int | None:
        limit = (rows + 1) * max(1, self.capture_sizes[-1] // self.tokens_per_request)
        for r in range(limit + 1):
            n = buf.rows.eval({**self.constants, "tokens": r * self.tokens_per_request, "requests": r})
            if n == rows:
                return r
            if n > rows:
                return None
        return None

    def workspace_bytes(self, ws: WorkspacePlan, tokens: int) -> int:
        env = self.env(tokens)
        n = 1
        for dim in ws.shape:
            n *= dim.eval(env)
        return n * _itemsize(ws.dtype)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: buffers, totals and, per capture size, captured rows and workspaces."""
        return {
            "name": self.spec.name,
            "constants": dict(self.constants),
            "tokens_per_request": self.tokens_per_request,
            "capture_sizes": list(self.capture_sizes),
            "total_bytes": self.total_bytes,
            "max_bytes": self.max_bytes,
            "buffers": [
                {
                    "name": b.name,
                    "dtype": str(b.dtype).removeprefix("torch."),
                    "shape": list(b.shape),
                    "bytes": b.nbytes,
                    "offset": b.offset,
                    "pad": b.pad,
                    "min": b.min,
                    "max": b.max,
                }
                for b in self.buffers
            ],
            "sizes": {
                str(s): {
                    "requests": s // self.tokens_per_request,
                    "rows": {b.name: self.shape_at(b, s)[0] for b in self.buffers},
                    "workspace_bytes": {w.name: self.workspace_bytes(w, s) for w in self.workspaces},
                }
                for s in self.capture_sizes
            },
        }


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan(
    spec: GraphSpec | str,
    *,
    overrides: Mapping[str, int] | None = None,
    max_bytes: int | None = None,
) -> Plan:
    """Resolve ``spec`` (a GraphSpec, a path or a shipped name) into a :class:`Plan`.

    ``overrides`` replaces constants (values known only at run time or per rank); the spec is re-checked with
    them. Raises :class:`PlanTooLargeError` when the slab would exceed ``max_bytes`` (default: the spec's
    ``limits.max_bytes``, 1 GiB unless set) — before anything is allocated.
    """
    source = None
    if not isinstance(spec, GraphSpec):
        source = str(spec)
        spec = load_spec(spec, overrides=overrides)
    elif overrides:
        check_spec(spec, overrides=overrides)
    where = source or spec.name
    constants = spec.constants_with(overrides, where)
    tpr = parse_expr(spec.capture.tokens_per_request).eval(constants)
    sizes = tuple(sorted(capture_sizes_of(spec)))

    entries: list[tuple[str, str, str | None]] = []
    for name, b in spec.buffers.items():
        groups: list[str | None] = list(spec.groups) if b.per_group else [None]
        entries += [(f"{name}.{g}" if g else name, name, g) for g in groups]
    # Buffers that may be omitted from a refresh go last, so one contiguous upload covers the rest; within
    # that, buffers of one dtype sit together, so refresh checks each dtype's bounds in one vector pass.
    first_of = {}
    for b in spec.buffers.values():
        first_of.setdefault(b.dtype, len(first_of))
    entries.sort(key=lambda e: (spec.buffers[e[1]].keep, first_of[spec.buffers[e[1]].dtype]))

    def bound(text: Any) -> int | None:
        if text is None:
            return None
        expr = parse_expr(text)
        return None if any(constants.get(n) is None for n in expr.names) else expr.eval(constants)

    buffers: list[BufferPlan] = []
    offset = 0
    for name, spec_name, group in entries:
        b = spec.buffers[spec_name]
        rows = parse_expr(b.rows)
        cols = None if b.cols is None else parse_expr(b.cols)
        env_at = [{**constants, "tokens": s, "requests": s // tpr} for s in sizes]
        shape: tuple[int, ...] = (max(rows.eval(e) for e in env_at),)
        if cols is not None:
            shape += (max(cols.eval(e) for e in env_at),)
        dtype = torch_dtype(b.dtype)
        nbytes = _itemsize(dtype)
        for d in shape:
            nbytes *= d
        offset = _align(offset)
        buffers.append(
            BufferPlan(
                name=name,
                spec_name=spec_name,
                group=group,
                dtype=dtype,
                shape=shape,
                offset=offset,
                nbytes=nbytes,
                rows=rows,
                cols=cols,
                pad=b.pad,
                overflow=b.overflow,
                keep=b.keep,
                min=bound(b.min),
                max=bound(b.max),
                description=b.description,
            )
        )
        offset += nbytes
    total = _align(offset)
    limit = spec.limits.max_bytes if max_bytes is None else max_bytes
    if total > limit:
        biggest = max(buffers, key=lambda b: b.nbytes)
        raise PlanTooLargeError(
            f"{where}: limits.max_bytes: the plan needs {total} bytes, above the limit of {limit} bytes "
            f"(largest buffer: {biggest.name}, {biggest.nbytes} bytes, shape {list(biggest.shape)}); "
            "shrink the capture envelope or raise limits.max_bytes"
        )
    workspaces = []
    for name, w in spec.workspaces.items():
        shape_exprs = tuple(parse_expr(d) for d in w.shape)
        workspaces.append(WorkspacePlan(name, torch_dtype(w.dtype), shape_exprs, w.description))
    return Plan(
        spec=spec,
        constants=MappingProxyType(constants),
        tokens_per_request=tpr,
        capture_sizes=sizes,
        buffers=tuple(buffers),
        workspaces=tuple(workspaces),
        total_bytes=total,
        max_bytes=limit,
        _by_name=MappingProxyType({b.name: b for b in buffers}),
    )

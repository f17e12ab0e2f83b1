"""The memory plan: every buffer resolved to dtype, shape at the largest capture size, bytes and offset.

A plan is pure host-side arithmetic; nothing is allocated, and torch is not imported (dtype names and sizes
come from the spec layer; :attr:`BufferPlan.dtype` imports torch on first use).
:class:`graphbuf.StaticBuffers`
allocates one slab of :attr:`Plan.total_bytes` and carves every buffer out of it at :attr:`BufferPlan.offset`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from graphbuf.errors import PlanTooLargeError, SpecError
from graphbuf.spec.expr import Expr, parse_expr
from graphbuf.spec.models import ITEMSIZE, GraphSpec, capture_sizes_of, check_spec, load_spec

if TYPE_CHECKING:
    import torch

    from graphbuf.spec.factories import RouteCost

__all__ = [
    "ALIGNMENT",
    "STAGING_COPIES",
    "BufferPlan",
    "Plan",
    "SizeMemory",
    "WorkspacePlan",
    "plan",
    "torch_dtype",
]

#: Byte alignment of every buffer inside the slab (covers CUDA's 256 B and Ascend's 512 B).
ALIGNMENT = 512


#: Host staging copies of the slab a refresh on an accelerator assembles and uploads from (double-buffered).
STAGING_COPIES = 2


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name (imports torch)."""
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class BufferPlan:
    """One allocated buffer. ``shape`` is the allocation (the largest rows/cols over all capture sizes)."""

    name: str
    spec_name: str
    group: str | None
    dtype_name: str
    itemsize: int
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

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch on first use; the plan itself never does)."""
        return torch_dtype(self.dtype_name)


@dataclass(frozen=True)
class WorkspacePlan:
    """Memory a task materializes per capture size (reported, not allocated by graphbuf)."""

    name: str
    dtype_name: str
    itemsize: int
    shape: tuple[Expr, ...]
    description: str = ""
    #: ``(task, mode)`` of the route that materializes it; None: every route needs it.
    route: tuple[str, str] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        return torch_dtype(self.dtype_name)


@dataclass(frozen=True)
class SizeMemory:
    """Memory at one capture size: the buffer rows the graph reads (views into the slab), the host staging
    copies a refresh fills (the slab's size, shared by every capture size) and the task workspaces of the
    routes the task options select (``unselected_workspace_bytes``: those of the other routes, apart)."""

    tokens: int
    requests: int
    buffer_bytes: int
    staging_bytes: int
    workspace_bytes: int
    unselected_workspace_bytes: int = 0


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
    # name -> {rows: smallest request count} over 0..the largest capture's requests, built on first use:
    # bounded by the plan (buffers x capture range), never by the calls made.
    _rows_table: dict[str, tuple[dict[int, int], int]] = field(
        repr=False, compare=False, default_factory=dict
    )

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

        Rows reached within the largest capture come from a table built once per buffer; others are
        searched by bisection up to ``rows + 1`` times the largest capture's requests, so rules must not
        decrease as the request count grows (``requests``, ``requests + 1``, ``tokens``). Memory stays
        fixed whatever ``rows`` callers ask about.
        """
        buf = self[name]
        known = self._rows_table.get(name)
        if known is None:
            table: dict[int, int] = {}
            for r in range(self.capture_sizes[-1] // self.tokens_per_request + 1):
                table.setdefault(self._rows_at(buf, r), r)
            known = self._rows_table[name] = (table, max(table))
        table, top = known
        found = table.get(rows)
        if found is not None or rows <= top:
            return found
        lo, hi = 0, (rows + 1) * max(1, self.capture_sizes[-1] // self.tokens_per_request)
        if self._rows_at(buf, hi) < rows:
            return None
        while lo < hi:  # the smallest r whose rows reach ``rows``
            mid = (lo + hi) // 2
            if self._rows_at(buf, mid) < rows:
                lo = mid + 1
            else:
                hi = mid
        return lo if self._rows_at(buf, lo) == rows else None

    def _rows_at(self, buf: BufferPlan, requests: int) -> int:
        tpr = self.tokens_per_request
        return buf.rows.eval({**self.constants, "tokens": requests * tpr, "requests": requests})

    def workspace_bytes(self, ws: WorkspacePlan, tokens: int) -> int:
        env = self.env(tokens)
        n = 1
        for dim in ws.shape:
            n *= dim.eval(env)
        return n * ws.itemsize

    def route_costs(self, tokens: int, context: int | None = None) -> list[tuple[str, RouteCost]]:
        """``(task name, RouteCost)`` for every route and mode of the spec's tasks at capture size ``tokens``,
        from the cost hooks their registered factories declare (:class:`graphbuf.spec.factories.TaskFactory`).
        ``context``: live tokens of context per request to assume (None: each hook's worst case). Tasks
        without a hook, or whose options need an unset constant, report nothing."""
        from graphbuf.spec.factories import registered_factories, resolve_options

        env = self.env(tokens)
        out: list[tuple[str, RouteCost]] = []
        for task in self.spec.tasks:
            decl = registered_factories().get(task.factory)
            if decl is None or decl.costs is None:
                continue
            values, problems = resolve_options(task.factory, task.options, self.constants)
            try:
                options = decl.options.model_validate(values)
            except ValidationError:  # an option over an unset constant is still an expression
                continue
            if problems:
                continue
            out += [(task.name, cost) for cost in decl.costs(options, env, context)]
        return out

    def workspace_selected(self, ws: WorkspacePlan) -> bool:
        """Whether the task options select the route ``ws`` belongs to: True for a workspace of every route
        and for a route whose task declares no costs (counted, not guessed away); False when the spec has no
        task of that name (nothing materializes it)."""
        if ws.route is None:
            return True
        task, mode = ws.route
        if task not in {t.name for t in self.spec.tasks}:
            return False
        costs = [c for name, c in self.route_costs(self.capture_sizes[0]) if name == task]
        return not costs or any(c.mode == mode and c.selected for c in costs)

    def memory_at(self, tokens: int) -> SizeMemory:
        """The memory a graph captured at ``tokens`` uses (see :class:`SizeMemory`)."""
        selected = {w.name: self.workspace_selected(w) for w in self.workspaces}
        buffer_bytes = 0
        for b in self.buffers:
            n = b.itemsize
            for d in self.shape_at(b, tokens):
                n *= d
            buffer_bytes += n
        return SizeMemory(
            tokens=tokens,
            requests=tokens // self.tokens_per_request,
            buffer_bytes=buffer_bytes,
            staging_bytes=STAGING_COPIES * self.total_bytes,
            workspace_bytes=sum(self.workspace_bytes(w, tokens) for w in self.workspaces if selected[w.name]),
            unselected_workspace_bytes=sum(
                self.workspace_bytes(w, tokens) for w in self.workspaces if not selected[w.name]
            ),
        )

    def memory_totals(self) -> dict[str, int]:
        """Whole-plan memory: the device slab (one, shared by every size), the host staging copies, and the
        task workspaces of the selected routes: the peak over sizes (graphs share one memory pool, as engines
        capture them) and the sum (a pool per graph); the workspaces of routes the options do not select,
        apart (their peak)."""
        per = [self.memory_at(s) for s in self.capture_sizes]
        return {
            "slab_bytes": self.total_bytes,
            "staging_bytes": STAGING_COPIES * self.total_bytes,
            "workspace_peak_bytes": max((m.workspace_bytes for m in per), default=0),
            "workspace_sum_bytes": sum(m.workspace_bytes for m in per),
            "unselected_workspace_peak_bytes": max((m.unselected_workspace_bytes for m in per), default=0),
        }

    def to_dict(self, context: int | None = None) -> dict[str, Any]:
        """A JSON-ready summary: buffers, totals and, per capture size, captured rows, workspaces and what
        each task route reads and materializes per step (``context``: see :meth:`route_costs`)."""
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
                    "dtype": b.dtype_name,
                    "shape": list(b.shape),
                    "bytes": b.nbytes,
                    "offset": b.offset,
                    "pad": json_number(b.pad),
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
                    "workspaces_selected": {w.name: self.workspace_selected(w) for w in self.workspaces},
                    "memory": _memory_dict(self.memory_at(s)),
                    "routes": [{"task": name, **asdict(cost)} for name, cost in self.route_costs(s, context)],
                }
                for s in self.capture_sizes
            },
            "memory_totals": self.memory_totals(),
        }


def _memory_dict(m: SizeMemory) -> dict[str, int]:
    return {
        "buffers": m.buffer_bytes,
        "staging": m.staging_bytes,
        "workspaces": m.workspace_bytes,
        "unselected_workspaces": m.unselected_workspace_bytes,
    }


def json_number(value: int | float | str) -> int | float | str:
    """``value`` for strict JSON: NaN and ±inf become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan(
    spec: GraphSpec | str,
    *,
    overrides: Mapping[str, int] | None = None,
    max_bytes: int | None = None,
    allow_factories: Iterable[str] = (),
) -> Plan:
    """Resolve ``spec`` (a GraphSpec, a path or a shipped name) into a :class:`Plan`.

    ``overrides`` replaces constants (values known only at run time or per rank); the spec is re-checked with
    them. Raises :class:`PlanTooLargeError` when the slab would exceed ``max_bytes`` (default: the spec's
    ``limits.max_bytes``, 1 GiB unless set) — before anything is allocated. ``allow_factories``: see
    :func:`graphbuf.spec.models.load_spec`.
    """
    source = None
    if not isinstance(spec, GraphSpec):
        source = str(spec)
        spec = load_spec(spec, overrides=overrides, allow_factories=allow_factories)
    elif overrides:
        check_spec(spec, overrides=overrides, allow_factories=allow_factories)
    where = source or spec.name
    constants = spec.constants_with(overrides, where)
    tpr = parse_expr(spec.capture.tokens_per_request).eval(constants)
    sizes = tuple(sorted(capture_sizes_of(spec)))

    buffers: list[BufferPlan] = []
    offset = 0
    for name, spec_name, group in _entries(spec):
        buffers.append(_buffer_plan(spec, constants, sizes, tpr, name, spec_name, group, _align(offset)))
        offset = buffers[-1].offset + buffers[-1].nbytes
    total = _align(offset)
    limit = spec.limits.max_bytes if max_bytes is None else max_bytes
    _check_limit(where, buffers, total, limit)
    workspaces = []
    for name, w in spec.workspaces.items():
        shape_exprs = tuple(parse_expr(d) for d in w.shape)
        route = tuple(w.route.split(".", 1)) if w.route is not None else None
        workspaces.append(WorkspacePlan(name, w.dtype, ITEMSIZE[w.dtype], shape_exprs, w.description, route))
    p = Plan(
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
    _check_workspace_routes(p, where)
    return p


def _check_workspace_routes(p: Plan, where: str) -> None:
    """A workspace's ``route`` names a mode its task's cost hook lists (a task without one: unchecked)."""
    routed = [w for w in p.workspaces if w.route is not None]
    costs = p.route_costs(p.capture_sizes[0]) if routed else []
    for w in routed:
        task, mode = w.route  # type: ignore[misc]
        modes = sorted({c.mode for name, c in costs if name == task})
        if modes and mode not in modes:
            raise SpecError(
                f"{where}: workspaces.{w.name}.route: task {task!r} has no mode {mode!r}; its modes: "
                f"{', '.join(modes)}"
            )


def _entries(spec: GraphSpec) -> list[tuple[str, str, str | None]]:
    """``(buffer name, spec buffer, group)`` in slab order: buffers a refresh may omit (``keep``) go last,
    so one contiguous upload covers the rest; within that, buffers of one dtype sit together, so refresh
    checks each dtype's bounds in one vector pass."""
    entries: list[tuple[str, str, str | None]] = []
    for name, b in spec.buffers.items():
        groups: list[str | None] = list(spec.groups) if b.per_group else [None]
        entries += [(f"{name}.{g}" if g else name, name, g) for g in groups]
    first_of: dict[str, int] = {}
    for b in spec.buffers.values():
        first_of.setdefault(b.dtype, len(first_of))
    entries.sort(key=lambda e: (spec.buffers[e[1]].keep, first_of[spec.buffers[e[1]].dtype]))
    return entries


def _bound(text: Any, constants: Mapping[str, Any]) -> int | None:
    """A ``min``/``max`` rule's value, or None when it is absent or names an unset constant."""
    if text is None:
        return None
    expr = parse_expr(text)
    return None if any(constants.get(n) is None for n in expr.names) else expr.eval(constants)


def _buffer_plan(
    spec: GraphSpec,
    constants: Mapping[str, Any],
    sizes: tuple[int, ...],
    tpr: int,
    name: str,
    spec_name: str,
    group: str | None,
    offset: int,
) -> BufferPlan:
    """One buffer at ``offset``: its shape is its rules' largest value over the capture sizes."""
    b = spec.buffers[spec_name]
    rows = parse_expr(b.rows)
    cols = None if b.cols is None else parse_expr(b.cols)
    env_at = [{**constants, "tokens": s, "requests": s // tpr} for s in sizes]
    shape: tuple[int, ...] = (max(rows.eval(e) for e in env_at),)
    if cols is not None:
        shape += (max(cols.eval(e) for e in env_at),)
    nbytes = ITEMSIZE[b.dtype]
    for d in shape:
        nbytes *= d
    return BufferPlan(
        name=name,
        spec_name=spec_name,
        group=group,
        dtype_name=b.dtype,
        itemsize=ITEMSIZE[b.dtype],
        shape=shape,
        offset=offset,
        nbytes=nbytes,
        rows=rows,
        cols=cols,
        pad=b.pad,
        overflow=b.overflow,
        keep=b.keep,
        min=_bound(b.min, constants),
        max=_bound(b.max, constants),
        description=b.description,
    )


def _check_limit(where: str, buffers: list[BufferPlan], total: int, limit: int) -> None:
    """Raise :class:`PlanTooLargeError` when ``total`` bytes exceed ``limit``, naming the largest buffer."""
    if total > limit:
        biggest = max(buffers, key=lambda b: b.nbytes)
        raise PlanTooLargeError(
            f"{where}: limits.max_bytes: the plan needs {total} bytes, above the limit of {limit} bytes "
            f"(largest buffer: {biggest.name}, {biggest.nbytes} bytes, shape {list(biggest.shape)}); "
            "shrink the capture envelope or raise limits.max_bytes"
        )

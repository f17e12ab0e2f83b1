"""The spec: pydantic models (validation, JSON Schema, docs) plus YAML loading.

A spec declares named integer constants, the capture envelope (tokens per request and capture sizes), the
KV cache groups, and the buffers a captured graph reads. Shape fields are restricted expressions
(:mod:`graphbuf.spec.expr`) over the constants and, in ``rows``/``cols``, the capture variables ``tokens`` and
``requests`` (= tokens // tokens_per_request).

Every invalid spec raises :class:`graphbuf.SpecError` naming the file, the field path and what is allowed.
Use :func:`load_spec` or :meth:`GraphSpec.model_validate`; both run the semantic checks.
"""

from __future__ import annotations

import math
import operator
import os
import re
import types
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from graphbuf.errors import SpecError
from graphbuf.spec.expr import MAX_LITERAL_DIGITS, MAX_VALUE, Expr, ExprError, parse_expr
from graphbuf.spec.factories import resolve_options

__all__ = [
    "DTYPES",
    "ITEMSIZE",
    "BufferSpec",
    "CaptureSpec",
    "GraphSpec",
    "LimitsSpec",
    "SizeRange",
    "TaskSpec",
    "WorkspaceSpec",
    "load_spec",
    "shipped_specs",
]

#: dtype name → (kind, bits). Kind: "b" bool, "i" signed, "u" unsigned, "f" float.
DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("b", 8),
    "uint8": ("u", 8),
    "int8": ("i", 8),
    "int16": ("i", 16),
    "int32": ("i", 32),
    "int64": ("i", 64),
    "float16": ("f", 16),
    "bfloat16": ("f", 16),
    "float32": ("f", 32),
    "float64": ("f", 64),
}
#: dtype name → bytes per element.
ITEMSIZE: dict[str, int] = {name: bits // 8 for name, (_, bits) in DTYPES.items()}
_FLOAT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
DTypeName = Literal[
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"
]
CAPTURE_VARS = ("tokens", "requests")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_RESERVED = frozenset((*CAPTURE_VARS, "min", "max", "cdiv"))
DEFAULT_MAX_BYTES = 1 << 30

#: An integer within ±(2**63 - 1); a bool is refused.
BoundedInt = Annotated[StrictInt, Field(ge=-MAX_VALUE, le=MAX_VALUE)]
IntExpr = BoundedInt | str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class SizeRange(_Strict):
    """Capture sizes ``start, start+step, ..., stop`` (stop inclusive)."""

    start: BoundedInt = Field(description="First capture size (tokens).")
    stop: BoundedInt = Field(description="Last capture size (tokens), inclusive.")
    step: BoundedInt = Field(1, description="Distance between sizes.")


class CaptureSpec(_Strict):
    """The capture envelope: one graph is captured per size."""

    tokens_per_request: IntExpr = Field(
        1, description="Uniform decode query length, e.g. '1 + num_speculative_tokens'. Constants only."
    )
    sizes: SizeRange | list[BoundedInt] = Field(description="Token counts to capture: a range or a list.")
    max_requests: IntExpr | None = Field(
        None,
        description="The serving envelope: most concurrent requests (e.g. 'max_num_seqs'). Constants only. "
        "`graphbuf check` reports which uniform decode batches of 1..max_requests requests replay a graph.",
    )


class BufferSpec(_Strict):
    """One captured buffer: shape rule, dtype, padding policy and value bounds."""

    dtype: DTypeName = Field(description="Element type.")
    rows: IntExpr = Field(description="Rows captured at a size; may use 'tokens' and 'requests'.")
    cols: IntExpr | None = Field(None, description="Columns (omit for a 1-D buffer).")
    per_group: bool = Field(False, description="One buffer per KV group, named '<name>.<group>'.")
    pad: StrictBool | StrictInt | StrictFloat | Literal["repeat_last"] = Field(
        0,
        description="Value of padded rows and stale columns, or 'repeat_last' (repeat the last live row). "
        "true/false only for a bool buffer.",
    )
    overflow: Literal["reject", "truncate"] = Field(
        "reject", description="A source wider than the allocation: reject (WidthError) or drop extra columns."
    )
    keep: bool = Field(False, description="May be omitted from a refresh; then it keeps its contents.")
    min: IntExpr | None = Field(None, description="Smallest allowed source value (constants only).")
    max: IntExpr | None = Field(None, description="Largest allowed source value (constants only).")
    description: str = ""


class WorkspaceSpec(_Strict):
    """Memory a task materializes per capture size; reported by ``graphbuf plan``, never allocated here."""

    dtype: DTypeName
    shape: list[IntExpr] = Field(description="Dimensions; may use 'tokens' and 'requests'.")
    per_group: bool = False
    route: str | None = Field(
        None,
        description="'<task>.<mode>': the task route that materializes it, as `graphbuf plan` lists routes "
        "(e.g. 'verify.dense'); the memory totals count it only when the task's options select that mode. "
        "Omitted: every route needs it.",
    )
    description: str = ""


class TaskSpec(_Strict):
    """A task ``graphbuf drill`` captures: an importable ``module:function`` factory and its options."""

    name: str
    factory: str = Field(description="'package.module:function' building the task (see graphbuf.drill).")
    group: str | None = Field(None, description="KV group whose per-group buffers the task binds.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the factory.")


class LimitsSpec(_Strict):
    max_bytes: BoundedInt = Field(DEFAULT_MAX_BYTES, description="Largest slab a plan may allocate (bytes).")


class GraphSpec(_Strict):
    """A graphbuf spec (``version: 1``)."""

    version: Literal[1]
    name: str
    description: str = ""
    constants: dict[str, IntExpr | None] = Field(
        default_factory=dict,
        description="Named integers, or expressions over other constants (any order; no cycles); "
        "null = set at run time (--set / overrides).",
    )
    capture: CaptureSpec
    groups: list[str] = Field(default_factory=lambda: ["default"], description="KV cache groups.")
    buffers: dict[str, BufferSpec]
    workspaces: dict[str, WorkspaceSpec] = Field(default_factory=dict)
    tasks: list[TaskSpec] = Field(default_factory=list)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    meta: dict[str, Any] = Field(default_factory=dict, description="Free-form facts (model, hardware).")

    @classmethod
    def model_validate(  # type: ignore[override]
        cls,
        obj: Any,
        *,
        source: str | None = None,
        overrides: Mapping[str, int] | None = None,
        allow_factories: Iterable[str] = (),
        **kwargs: Any,
    ) -> GraphSpec:
        """Validate ``obj`` (a mapping) into a spec; raise SpecError naming ``source`` and field paths.

        ``allow_factories``: modules whose task factories may be imported though no ``graphbuf.tasks`` entry
        point registers them (see :mod:`graphbuf.spec.factories`)."""
        if not isinstance(obj, Mapping):
            raise SpecError(
                f"{source or '<spec>'}: (top level): expected a mapping of spec fields, "
                f"got {type(obj).__name__}"
            )
        try:
            spec = super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise SpecError(_format_pydantic(exc, source)) from None
        except (RecursionError, TypeError, ValueError) as exc:  # e.g. a self-referencing mapping
            raise SpecError(
                f"{source or '<spec>'}: (top level): cannot validate: {type(exc).__name__}"
            ) from None
        check_spec(spec, source=source, overrides=overrides, allow_factories=allow_factories)
        return spec

    def constants_with(
        self, overrides: Mapping[str, int] | None = None, source: str | None = None
    ) -> dict[str, int | None]:
        """Resolved constants, in declaration order, with ``overrides`` applied.

        An expression constant may use any other constant, declared above or below it (resolved by
        dependency; a cycle is a SpecError naming it); one that needs an unset (null) constant is unset too.
        An override (any integer, numpy's included) replaces a constant's value, derived ones included.
        Unknown names are SpecErrors.
        """
        where = source or "<spec>"
        checked: dict[str, int] = {}
        for key, value in dict(overrides or {}).items():
            if key not in self.constants:
                known = ", ".join(self.constants) or "(none)"
                raise SpecError(f"{where}: overrides.{key}: unknown constant; declared: {known}")
            try:
                if isinstance(value, bool):
                    raise TypeError
                number = operator.index(value)
            except TypeError:
                raise SpecError(
                    f"{where}: overrides.{key}: expected an integer, got {_short(value)}"
                ) from None
            if not -MAX_VALUE <= number <= MAX_VALUE:
                raise SpecError(f"{where}: overrides.{key}: {_short(number)} is beyond ±(2**63 - 1)")
            checked[key] = number
        declared = set(self.constants)
        exprs: dict[str, Expr] = {}
        for key, raw in self.constants.items():
            if key in checked or raw is None:
                continue
            try:
                exprs[key] = parse_expr(raw)
            except ExprError as exc:
                raise SpecError(f"{where}: constants.{key}: {exc}") from None
            unknown = exprs[key].names - declared
            if unknown:
                raise SpecError(
                    f"{where}: constants.{key}: unknown name(s) {', '.join(sorted(unknown))} in "
                    f"{_short(raw)}; constants: {_short(', '.join(self.constants), 400)}"
                )
        values = _resolve_all(self.constants, exprs, checked, where)
        return {key: values[key] for key in self.constants}


def _resolve_all(
    raw: Mapping[str, Any], exprs: Mapping[str, Expr], overrides: Mapping[str, int], where: str
) -> dict[str, int | None]:
    """Every constant's value: an iterative depth-first walk, linear in the constants and their references
    (no recursion, so a chain of any length resolves in any order); a cycle is a SpecError listing it."""
    values: dict[str, int | None] = {}
    on_path: dict[str, int] = {}  # constant → its index in ``path``
    path: list[str] = []  # the walk's current dependency path (empty between roots)
    todo: list[tuple[str, Iterator[str]]] = []  # per constant on the path: the dependencies left to visit

    def enter(key: str) -> None:
        """Settle ``key`` if it needs no evaluation; else push it onto the path."""
        if key in overrides:
            values[key] = overrides[key]
        elif key not in exprs:
            values[key] = raw[key]
        else:
            on_path[key] = len(path)
            path.append(key)
            todo.append((key, iter(sorted(exprs[key].names))))

    for root in raw:
        if root in values:
            continue
        enter(root)
        while todo:
            key, deps = todo[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep in values:
                    continue
                if dep in on_path:
                    raise SpecError(f"{where}: constants.{dep}: {_cycle(path[on_path[dep] :])}")
                enter(dep)
                continue
            todo.pop()
            path.pop()
            del on_path[key]
            env = {n: values[n] for n in exprs[key].names}
            if any(v is None for v in env.values()):
                values[key] = None
                continue
            try:
                values[key] = exprs[key].eval(env)
            except ExprError as exc:
                raise SpecError(f"{where}: constants.{key}: {exc}") from None
    return values


def _cycle(members: list[str]) -> str:
    """``dependency cycle: a -> b -> a (2 constants)``: every member, in order."""
    return f"dependency cycle: {' -> '.join([*members, members[0]])} ({len(members)} constants)"


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, clipped; never raises (huge ints included)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ or a repr limit
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# ----------------------------------------------------------------------------------------------------------
# Semantic checks (expressions, sizes, pads); every problem is collected with its field path.


def _fmt_path(parts: Iterable[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _format_pydantic(exc: ValidationError, source: str | None) -> str:
    """One line per mistake: ``<source>: <field path>: ...``. A value no arm of a union field accepts (or a
    value outside a literal's choices) is one line naming the value and the allowed forms; a value whose type
    picks an arm (a mapping for a range, an integer out of bounds) reports that arm's own errors."""
    where = source or "<spec>"
    order: list[str | tuple[str | int, ...]] = []  # a line, or a union field whose lines go there
    unions: dict[tuple[str | int, ...], list[tuple[dict[str, Any], str, list[str | int]]]] = {}
    for err in exc.errors():
        field, tag, rest = _split_union(list(err["loc"]))
        if tag is None:
            order.append(f"{where}: {_fmt_path(field)}: {_plain_message(err, field)}")
            continue
        if tuple(field) not in unions:
            order.append(tuple(field))
        unions.setdefault(tuple(field), []).append((err, tag, rest))
    lines: list[str] = []
    for item in order:
        lines += [item] if isinstance(item, str) else _union_lines(where, list(item), unions[item])
    return "\n".join(dict.fromkeys(lines))


def _plain_message(err: Mapping[str, Any], loc: list[str | int]) -> str:
    if err["type"] == "missing":
        return str(err["msg"])
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
        parent = _MODEL_FOR.get(_parent_kind(loc))
        return msg + (f"; allowed: {', '.join(parent.model_fields)}" if parent is not None else "")
    ann = _annotation_at(loc)
    choice = get_origin(_base(ann)) is Literal or type(None) in get_args(ann)  # constrained or nullable
    if choice and err["type"].endswith(("_type", "_parsing", "literal_error")):
        return f"got {_short(err.get('input'))}; allowed: {_forms(ann)}"
    return f"{err['msg']}, got {_short(err.get('input'))}"


def _union_lines(
    where: str, field: list[str | int], errs: list[tuple[dict[str, Any], str, list[str | int]]]
) -> list[str]:
    top = [e for e, _, rest in errs if not rest]
    value = (top or [errs[0][0]])[0].get("input")
    picked = [(e, rest) for e, tag, rest in errs if _arm_takes(tag, value)]
    if picked and all(rest for _, rest in picked):  # the value's type picked an arm: that arm's own errors
        return [f"{where}: {_fmt_path(field + r)}: {_plain_message(e, field + r)}" for e, r in picked]
    reason = ""
    if picked and not picked[0][0]["type"].endswith(("_type", "_parsing", "literal_error")):
        reason = f"{picked[0][0]['msg']}, "  # e.g. an integer out of bounds
    forms = _forms(_annotation_at(field))
    return [f"{where}: {_fmt_path(field)}: {reason}got {_short(value)}; allowed: {forms}"]


def _split_union(loc: list[str | int]) -> tuple[list[str | int], str | None, list[str | int]]:
    """``loc`` as (the union field's path, the arm's tag, the path inside the arm); (loc, None, []) when no
    union field is on the path."""
    for i in range(1, len(loc)):
        part = loc[i]
        if isinstance(part, str) and part in _UNION_TAGS and _is_union(_annotation_at(loc[:i])):
            return loc[:i], part, [p for p in loc[i + 1 :] if not (isinstance(p, str) and p in _UNION_TAGS)]
    return loc, None, []


def _arms(ann: Any) -> tuple[Any, ...]:
    """The arms of a union annotation (None left out), or ``(ann,)``."""
    if get_origin(ann) in (Union, types.UnionType):
        return tuple(a for a in get_args(ann) if a is not type(None))
    return (ann,)


def _is_union(ann: Any) -> bool:
    return len(_arms(ann)) > 1


def _base(ann: Any) -> Any:
    return get_args(ann)[0] if get_origin(ann) is Annotated else ann


def _annotation_at(loc: Iterable[str | int]) -> Any:
    """The annotation of the spec field at ``loc`` (union tags left out), or None."""
    ann: Any = GraphSpec
    for part in loc:
        for arm in map(_base, _arms(ann)):
            if isinstance(arm, type) and issubclass(arm, BaseModel) and part in arm.model_fields:
                ann = arm.model_fields[part].annotation
                break
            if get_origin(arm) is dict and isinstance(part, str):
                ann = get_args(arm)[1]
                break
            if get_origin(arm) is list and isinstance(part, int):
                ann = get_args(arm)[0]
                break
        else:
            return None
    return ann


def _arm_takes(tag: str, value: Any) -> bool:
    """Whether the union arm ``tag`` is the one a value of this Python type was meant for."""
    if isinstance(value, bool):
        return tag == "bool"
    if isinstance(value, (int, _HugeInteger)):
        return tag in ("int", "constrained-int")
    if isinstance(value, float):
        return tag == "float"
    if isinstance(value, str):
        return tag == "str" or tag.startswith("literal[")
    if isinstance(value, list):
        return tag.startswith("list[")
    if isinstance(value, Mapping):
        return tag in _MODEL_FOR_TAG
    return False


def _forms(ann: Any) -> str:
    """The forms an annotation allows, in words."""
    arms = _arms(ann)
    nullable = get_origin(ann) in (Union, types.UnionType) and type(None) in get_args(ann)
    has_int = any(_base(a) is int for a in arms)
    words = [_form(a, has_int) for a in arms] + (["null"] if nullable else [])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _form(arm: Any, expression: bool) -> str:
    base = _base(arm)
    if get_origin(base) is Literal:
        choices = list(map(repr, get_args(base)))
        return choices[0] if len(choices) == 1 else f"one of {', '.join(choices)}"
    if base is bool:
        return "true or false"
    if base is int:
        bounded = get_origin(arm) is Annotated and len(get_args(arm)) > 2  # BoundedInt
        return "an integer within ±(2**63 - 1)" if bounded else "an integer"
    if base is float:
        return "a number"
    if base is str:
        return "an expression over constants (a string)" if expression else "a string"
    if get_origin(base) is list:
        return f"a list (each {_forms(get_args(base)[0])})"
    if isinstance(base, type) and issubclass(base, BaseModel):
        return f"a mapping with keys {', '.join(base.model_fields)}"
    return str(base)


_UNION_TAGS = frozenset(
    (
        "SizeRange",
        "list[int]",
        "list[constrained-int]",
        "constrained-int",
        "bool",
        "int",
        "str",
        "float",
        "literal['repeat_last']",
        "function-after[_dtype(), str]",
    )
)


def _parent_kind(loc: list[str | int]) -> str:
    head = [p for p in loc[:-1]]
    if not head:
        return "spec"
    if head[0] in ("buffers", "workspaces") and len(head) == 2:
        return head[0]
    if head[0] == "tasks" and len(head) == 2:
        return "tasks"
    if head == ["capture", "sizes"]:
        return "sizes"
    return str(head[0]) if len(head) == 1 else ""


_MODEL_FOR_TAG = frozenset(("SizeRange",))  # union arms that are models (a mapping picks them)

_MODEL_FOR: dict[str, type[BaseModel]] = {
    "spec": GraphSpec,
    "capture": CaptureSpec,
    "buffers": BufferSpec,
    "workspaces": WorkspaceSpec,
    "tasks": TaskSpec,
    "limits": LimitsSpec,
    "sizes": SizeRange,
}


class _Problems:
    def __init__(self, source: str | None) -> None:
        self.source = source or "<spec>"
        self.items: list[str] = []

    def add(self, path: str, msg: str) -> None:
        self.items.append(f"{self.source}: {path}: {msg}")

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecError("\n".join(self.items))


def _parse(problems: _Problems, path: str, text: IntExpr, allowed: frozenset[str]) -> Expr | None:
    try:
        expr = parse_expr(text)
    except ExprError as exc:
        problems.add(path, str(exc))
        return None
    unknown = expr.names - allowed
    if unknown:
        problems.add(
            path,
            f"unknown name(s) {', '.join(sorted(unknown))} in {str(text)!r}; allowed: "
            f"{', '.join(sorted(allowed)) or '(none)'}",
        )
        return None
    return expr


#: Largest serving envelope (``capture.max_requests``) a coverage certificate enumerates.
MAX_REQUESTS = 1 << 16

#: Most capture sizes a spec may declare (each one is a captured graph).
MAX_CAPTURE_SIZES = 4096


def capture_sizes_of(spec: GraphSpec) -> list[int]:
    """The capture sizes as listed (a range expanded); unsorted, duplicates kept. Empty for a range that is
    invalid or longer than :data:`MAX_CAPTURE_SIZES` (the checks report why)."""
    sizes = spec.capture.sizes
    if isinstance(sizes, SizeRange):
        if sizes.step <= 0 or (sizes.stop - sizes.start) // sizes.step >= MAX_CAPTURE_SIZES:
            return []
        return list(range(sizes.start, sizes.stop + 1, sizes.step))
    return list(sizes) if len(sizes) <= MAX_CAPTURE_SIZES else []


def pad_fits(dtype: str, pad: int | float | str) -> bool:
    """Whether ``pad`` is representable in ``dtype`` (``repeat_last`` always is)."""
    if pad == "repeat_last":
        return True
    kind, bits = DTYPES[dtype]
    if kind == "f":
        return math.isnan(pad) or math.isinf(pad) or abs(pad) <= _FLOAT_MAX.get(dtype, math.inf)
    if isinstance(pad, float) and not pad.is_integer():
        return False
    value = int(pad)
    if kind == "b":
        return value in (0, 1)
    if kind == "u":
        return 0 <= value < (1 << bits)
    return -(1 << (bits - 1)) <= value < (1 << (bits - 1))


def check_spec(
    spec: GraphSpec,
    *,
    source: str | None = None,
    overrides: Mapping[str, int] | None = None,
    allow_factories: Iterable[str] = (),
) -> None:
    """Run the semantic checks (with ``overrides`` applied); raise one SpecError listing every problem.

    Task factories are checked against :mod:`graphbuf.spec.factories` (registered, or a module in
    ``allow_factories``) before anything is imported, and their options against the factory's schema."""
    p = _Problems(source)
    constants = spec.constants_with(overrides, source)
    for name in constants:
        if not _IDENT.match(name) or name in _RESERVED:
            p.add(f"constants.{name}", f"not a usable name; reserved: {', '.join(sorted(_RESERVED))}")
    names = frozenset(constants)
    shape_names = names | frozenset(CAPTURE_VARS)
    tpr = _check_capture(p, spec, constants, names)
    sizes = _check_sizes(p, spec, constants, tpr)
    _check_groups(p, spec)
    if not spec.buffers:
        p.add("buffers", "at least one buffer is required")
    for name, buf in spec.buffers.items():
        _check_buffer(p, name, buf, constants, names, shape_names, sizes, tpr)
    for name, ws in spec.workspaces.items():
        task, dot, mode = (ws.route or "").partition(".")
        if ws.route is not None and not (task and dot and mode):
            p.add(f"workspaces.{name}.route", f"expected '<task>.<mode>', got {_short(ws.route)}")
        for i, dim in enumerate(ws.shape):
            expr = _parse(p, f"workspaces.{name}.shape[{i}]", dim, shape_names)
            if expr is not None and tpr is not None:
                _check_positive(p, f"workspaces.{name}.shape[{i}]", expr, constants, sizes, tpr)
    for i, task in enumerate(spec.tasks):
        if ":" not in task.factory:
            p.add(f"tasks[{i}].factory", f"expected 'package.module:function', got {_short(task.factory)}")
        else:
            for field, msg in resolve_options(task.factory, task.options, constants, allow_factories)[1]:
                p.add(f"tasks[{i}].{field}", msg)
        if task.group is not None and task.group not in spec.groups:
            p.add(f"tasks[{i}].group", f"unknown group {task.group!r}; groups: {', '.join(spec.groups)}")
    if spec.limits.max_bytes <= 0:
        p.add("limits.max_bytes", f"must be positive, got {spec.limits.max_bytes}")
    p.raise_if_any()


def _check_capture(
    p: _Problems, spec: GraphSpec, constants: dict[str, Any], names: frozenset[str]
) -> int | None:
    """``capture.tokens_per_request`` (returned, None when unusable) and ``capture.max_requests``."""
    tpr = None
    tpr_expr = _parse(p, "capture.tokens_per_request", spec.capture.tokens_per_request, names)
    if tpr_expr is not None:
        try:
            tpr = tpr_expr.eval(constants)
            if tpr <= 0:
                p.add("capture.tokens_per_request", f"must be ≥ 1, got {tpr}")
                tpr = None
        except ExprError as exc:
            p.add("capture.tokens_per_request", str(exc))
    if spec.capture.max_requests is not None:
        expr = _parse(p, "capture.max_requests", spec.capture.max_requests, names)
        if expr is not None and all(constants.get(n) is not None for n in expr.names):
            try:
                value = expr.eval(constants)
                if not 1 <= value <= MAX_REQUESTS:
                    p.add("capture.max_requests", f"must be in 1..{MAX_REQUESTS}, got {value}")
            except ExprError as exc:
                p.add("capture.max_requests", str(exc))
    return tpr


def _check_groups(p: _Problems, spec: GraphSpec) -> None:
    if not spec.groups:
        p.add("groups", "at least one group is required")
    for i, g in enumerate(spec.groups):
        if not _IDENT.match(g):
            p.add(f"groups[{i}]", f"{g!r} is not an identifier")
    for i, g in enumerate(spec.groups):
        if g in spec.groups[:i]:
            p.add(f"groups[{i}]", f"duplicate group {g!r}")


def _check_buffer(
    p: _Problems,
    name: str,
    buf: BufferSpec,
    constants: dict[str, Any],
    names: frozenset[str],
    shape_names: frozenset[str],
    sizes: Any,
    tpr: int | None,
) -> None:
    """One buffer: its name, shape rules (≥ 0, never decreasing), pad and bounds."""
    base = f"buffers.{name}"
    if not _IDENT.match(name):
        p.add(base, "buffer names must be identifiers (no dots: per-group names are derived)")
    for field in ("rows", "cols"):
        text = getattr(buf, field)
        if text is None:
            continue
        expr = _parse(p, f"{base}.{field}", text, shape_names)
        if expr is not None and tpr is not None:
            _check_positive(p, f"{base}.{field}", expr, constants, sizes, tpr)
            _check_growth(p, f"{base}.{field}", expr, constants, sizes, tpr)
    if isinstance(buf.pad, bool) and buf.dtype != "bool":
        p.add(f"{base}.pad", f"{buf.pad!r} is a bool; a {buf.dtype} buffer needs a number")
    elif not pad_fits(buf.dtype, buf.pad):
        p.add(f"{base}.pad", f"{_short(buf.pad)} is not representable in {buf.dtype}")
    bounds = {}
    for field in ("min", "max"):
        text = getattr(buf, field)
        if text is None:
            continue
        expr = _parse(p, f"{base}.{field}", text, names)
        if expr is not None and all(constants.get(n) is not None for n in expr.names):
            try:
                bounds[field] = expr.eval(constants)
            except ExprError as exc:
                p.add(f"{base}.{field}", str(exc))
    if "min" in bounds and "max" in bounds and bounds["min"] > bounds["max"]:
        p.add(f"{base}.max", f"max {bounds['max']} is below min {bounds['min']}")
    if buf.pad != "repeat_last":
        if "min" in bounds and buf.pad < bounds["min"]:
            p.add(f"{base}.pad", f"pad {buf.pad} is below the buffer's min {bounds['min']}")
        if "max" in bounds and buf.pad > bounds["max"]:
            p.add(f"{base}.pad", f"pad {buf.pad} is above the buffer's max {bounds['max']}")


def _check_sizes(
    p: _Problems, spec: GraphSpec, constants: Mapping[str, int | None], tpr: int | None
) -> list[int]:
    raw = spec.capture.sizes
    if isinstance(raw, SizeRange):
        if raw.step <= 0:
            p.add("capture.sizes.step", f"must be ≥ 1, got {raw.step}")
        if raw.start <= 0:
            p.add("capture.sizes.start", f"must be ≥ 1, got {raw.start}")
        if raw.stop < raw.start:
            p.add("capture.sizes.stop", f"{raw.stop} is below start {raw.start}")
        elif raw.step > 0 and (raw.stop - raw.start) // raw.step >= MAX_CAPTURE_SIZES:
            count = (raw.stop - raw.start) // raw.step + 1
            p.add(
                "capture.sizes", f"{count} sizes; at most {MAX_CAPTURE_SIZES} (each size is a captured graph)"
            )
        where = ["capture.sizes"] * len(capture_sizes_of(spec))
    else:
        if len(raw) > MAX_CAPTURE_SIZES:
            p.add(
                "capture.sizes",
                f"{len(raw)} sizes; at most {MAX_CAPTURE_SIZES} (each size is a captured graph)",
            )
        where = [f"capture.sizes[{i}]" for i in range(len(capture_sizes_of(spec)))]
    sizes = capture_sizes_of(spec)
    too_many = any(item.endswith("(each size is a captured graph)") for item in p.items)
    if not sizes and not too_many:  # too many sizes are not none
        p.add("capture.sizes", "no capture sizes")
    max_tokens = constants.get("max_num_batched_tokens")
    max_seqs = constants.get("max_num_seqs")
    good = []
    for i, (path, s) in enumerate(zip(where, sizes)):
        if s <= 0:
            p.add(path, f"size {s} must be positive")
            continue
        if s in sizes[:i]:
            p.add(path, f"size {s} is duplicated")
            continue
        if tpr is not None and s % tpr:
            p.add(path, f"size {s} is not a multiple of tokens_per_request ({tpr})")
            continue
        if max_tokens is not None and s > max_tokens:
            p.add(path, f"size {s} exceeds max_num_batched_tokens ({max_tokens})")
            continue
        if max_seqs is not None and tpr is not None and s // tpr > max_seqs:
            p.add(path, f"size {s} implies {s // tpr} requests, above max_num_seqs ({max_seqs})")
            continue
        good.append(s)
    return good


def _check_positive(
    p: _Problems, path: str, expr: Expr, constants: Mapping[str, int | None], sizes: list[int], tpr: int
) -> None:
    for s in sizes:
        try:
            value = expr.eval({**constants, "tokens": s, "requests": s // tpr})
        except ExprError as exc:
            p.add(path, str(exc))
            return
        if value <= 0:
            p.add(path, f"{_short(expr.text)} evaluates to {value} at capture size {s}; must be ≥ 1")
            return


#: Most request counts a rows/cols rule is evaluated at (beyond it, sampled).
_GROWTH_POINTS = 4096


def _check_growth(
    p: _Problems, path: str, expr: Expr, constants: Mapping[str, int | None], sizes: list[int], tpr: int
) -> None:
    """A rule must be ≥ 0 and non-decreasing from 0 requests up to the largest capture size: the allocation is
    its value at the largest size, and a live batch maps to the smallest capture size that holds it."""
    if not sizes or not (expr.names & set(CAPTURE_VARS)):
        return
    top = max(sizes) // tpr
    points = (
        range(top + 1)
        if top <= _GROWTH_POINTS
        else sorted({*range(0, top + 1, max(1, top // _GROWTH_POINTS)), top, *(s // tpr for s in sizes)})
    )
    prev = None
    for r in points:
        try:
            value = expr.eval({**constants, "tokens": r * tpr, "requests": r})
        except ExprError as exc:
            p.add(path, f"{exc} at {r} requests")
            return
        if value < 0:
            p.add(path, f"{_short(expr.text)} is {value} at {r} requests ({r * tpr} tokens); must be ≥ 0")
            return
        if prev is not None and value < prev[1]:
            p.add(
                path,
                f"{_short(expr.text)} shrinks from {prev[1]} at {prev[0]} requests to {value} at {r}; a rows "
                "or cols rule must not decrease as requests grow",
            )
            return
        prev = (r, value)


# ----------------------------------------------------------------------------------------------------------
# YAML loading


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader (libyaml's when built) that rejects duplicate mapping keys (PyYAML keeps the last one)."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # `<<: *base`: merged keys may be overridden by the mapping's own
            continue
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain scalar (complex keys are not allowed)",
                key_node.start_mark,
            )  # fmt: skip
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_short(key)}", key_node.start_mark
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _HugeInteger:
    """An integer literal beyond Python's string-conversion digit limit; :func:`parse_yaml` names its path."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int | _HugeInteger:
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        loader.huge_integers = True
        return _HugeInteger(sum(c.isdigit() for c in str(node.value)))


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _huge_integer_path(data: Any) -> tuple[str, _HugeInteger] | None:
    """The field path of the first :class:`_HugeInteger` in ``data`` (walked iteratively, aliases once)."""
    seen: set[int] = set()
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while todo:
        node, path = todo.pop()
        if isinstance(node, _HugeInteger):
            return _fmt_path(path), node
        if id(node) in seen or not isinstance(node, (dict, list)):
            continue
        seen.add(id(node))
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, value in reversed(items):
            if isinstance(key, _HugeInteger):
                return f"{_fmt_path(path)} (a key)", key
            todo.append((value, (*path, key if isinstance(node, list) else str(key))))
    return None


def shipped_specs() -> dict[str, Path]:
    """Shipped spec names → their files."""
    import importlib.resources  # ~20 ms: only when a spec is named rather than given as a path

    root = importlib.resources.files("graphbuf.specs")
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".yaml")}


def resolve_spec_path(path_or_name: str | Path) -> Path:
    """A spec file path, or a shipped spec's bare name (with or without ``.yaml``, no directory part) → an
    existing file. A path never resolves to a shipped spec: ``x/gemma4-tiny-model.yaml`` that does not exist
    is an error, not the shipped spec of that name."""
    path = Path(path_or_name)
    try:
        if path.is_file():
            return path
        is_dir = path.is_dir()
    except OSError as exc:  # e.g. a name over the OS's limit (ENAMETOOLONG)
        shown = _short(str(path_or_name))
        raise SpecError(f"{shown}: cannot be used as a spec path: {exc.strerror}") from None
    if is_dir:
        raise SpecError(f"{path_or_name}: is a directory; a spec is a YAML file (e.g. {path}/spec.yaml)")
    shipped = shipped_specs()
    text = str(path_or_name)
    bare = "/" not in text and os.sep not in text  # a name, not a path
    key = path.name[:-5] if path.name.endswith(".yaml") else path.name
    if bare and key in shipped:
        return shipped[key]
    if key in shipped:
        raise SpecError(
            f"{path_or_name}: no such spec file; a path never names a shipped spec (give the bare name "
            f"{key!r} for the shipped one)"
        )
    raise SpecError(
        f"{path_or_name}: no such spec file and no shipped spec of that name; shipped: "
        f"{', '.join(sorted(shipped)) or '(none)'}"
    )


def load_spec(
    path_or_name: str | Path,
    *,
    overrides: Mapping[str, int] | None = None,
    allow_factories: Iterable[str] = (),
) -> GraphSpec:
    """Load and validate a YAML spec from a path or a shipped spec name; raise SpecError if invalid.

    ``allow_factories``: modules whose task factories may be imported unregistered
    (:mod:`graphbuf.spec.factories`).
    """
    path = resolve_spec_path(path_or_name)
    source = str(path_or_name)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{source}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{source}: not UTF-8 text (byte {exc.start}): a spec is a UTF-8 YAML file") from None
    data = parse_yaml(text, source)
    return GraphSpec.model_validate(data, source=source, overrides=overrides, allow_factories=allow_factories)


def parse_yaml(text: str, source: str) -> Any:
    """YAML text → Python data (safe tags only, merge keys allowed, duplicate and complex keys refused)."""
    try:
        loader = _UniqueKeyLoader(text)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except RecursionError:
        raise SpecError(f"{source}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{source}: {where}invalid YAML: {problem}") from None
    except (ValueError, OverflowError, TypeError) as exc:  # e.g. an integer beyond Python's digit limit
        raise SpecError(f"{source}: invalid YAML value: {_short(str(exc))}") from None
    if getattr(loader, "huge_integers", False):
        found = _huge_integer_path(data)
        if found is not None:
            raise SpecError(
                f"{source}: {found[0]}: integer literal of {found[1].digits} digits; at most "
                f"{MAX_LITERAL_DIGITS} (|value| <= 2**63 - 1)"
            )
    return data

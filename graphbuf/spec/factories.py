"""Task factories a spec may name (``tasks[].factory``), and the schema of their options.

A spec names code, so naming a factory must not be enough to run it. A factory is usable when

* a package registers it: an entry point in the group ``graphbuf.tasks`` whose value is a :class:`TaskFactory`
  declared in a light module (importing it must not import the factory's module, nor torch), or
* the caller allows its module explicitly (``--allow-factory MODULE`` / ``allow_factories=("MODULE",)``; a
  package allows its submodules). Then the module is imported and the factory function must carry its
  schema as ``graphbuf_options`` (see :func:`declare_options`).

Anything else is refused before any import. Options are validated against the schema after expressions over
constants are resolved; an option that needs an unset constant is checked once the constant is set.

A registered factory may also declare ``costs``: a pure-arithmetic hook (importing neither torch nor the
factory's module) that says, per capture size, what each route of the task reads and materializes per step,
in every mode its options can select. ``graphbuf plan`` reports them; graphbuf itself names no engine.
"""

from __future__ import annotations

import configparser
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from graphbuf.spec.expr import ExprError, parse_expr

__all__ = [
    "ENTRY_POINT_GROUP",
    "CostHook",
    "RouteCost",
    "TaskFactory",
    "declare_options",
    "registered_factories",
    "resolve_options",
    "task_strategy",
]

#: The entry point group that registers task factories.
ENTRY_POINT_GROUP = "graphbuf.tasks"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RouteCost:
    """What one route of a task does per step at one capture size, in one mode.

    ``route``: the task's route (e.g. one kernel path); ``mode``: the option value selecting it; ``selected``:
    the task's options select this mode; ``kv_read_bytes``: bytes of cached state the route reads per step
    (all layers); ``workspace_bytes``: peak bytes it materializes per call (inputs and outputs excluded);
    ``layers``: the calls per step; ``context``: the tokens of context per request the figures assume.
    """

    route: str
    mode: str
    selected: bool
    kv_read_bytes: int
    workspace_bytes: int
    layers: int
    context: int


CostHook = Callable[[BaseModel, Mapping[str, int | None], int | None], Sequence[RouteCost]]
"""``costs(options, env, context)``: the task's validated options, the plan's expression environment at one
capture size (constants, ``tokens``, ``requests``) and the live context per request to assume (None: the
hook's worst case) -> one :class:`RouteCost` per route and mode."""


@dataclass(frozen=True)
class TaskFactory:
    """A registered factory: ``factory`` is ``'package.module:function'``; ``options`` validates its keyword
    options (a pydantic model; declare it with ``extra='forbid'`` so a typo is an error); ``costs``: an
    optional :data:`CostHook` for ``graphbuf plan``; ``strategy``, if any, is ``'package.module:function'`` of
    the relation its tasks need between buffers (a Hypothesis strategy factory, see :mod:`graphbuf.testing`),
    imported only by the drill and the strategies."""

    factory: str
    options: type[BaseModel]
    costs: CostHook | None = None
    strategy: str | None = None


def declare_options(options: type[BaseModel], strategy: str | None = None) -> Callable[[F], F]:
    """Decorator: attach ``options`` (a pydantic model) and, optionally, the ``'module:function'`` of its
    batch relation (see :class:`TaskFactory`) to a factory allowed with ``--allow-factory``."""

    def mark(fn: F) -> F:
        fn.graphbuf_options = options  # type: ignore[attr-defined]
        fn.graphbuf_strategy = strategy  # type: ignore[attr-defined]
        return fn

    return mark


_REGISTRY: dict[str, TaskFactory] | None = None


def registered_factories() -> dict[str, TaskFactory]:
    """``'module:function'`` → its declaration, from every installed ``graphbuf.tasks`` entry point."""
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[str, TaskFactory] = {}
        for value in _entry_points():
            module, _, attr = value.partition(":")
            try:
                decl: Any = importlib.import_module(module.strip())
                for part in attr.strip().split("."):
                    decl = getattr(decl, part)
            except Exception:  # a broken third-party registration must not break every spec
                continue
            if isinstance(decl, TaskFactory):
                found[decl.factory] = decl
        _REGISTRY = found
    return _REGISTRY


def _entry_points() -> list[str]:
    """The ``module:attr`` values of the installed ``graphbuf.tasks`` entry points (of each distribution, the
    first on ``sys.path`` wins, as for imports). Reads only ``entry_points.txt`` files: importing and
    scanning with ``importlib.metadata`` costs 15-100 ms more on every ``check``."""
    seen: set[str] = set()
    out: list[str] = []
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            project = name.rsplit(".", 1)[0].split("-")[0].lower().replace("_", "-")
            if project in seen:
                continue
            seen.add(project)
            try:
                with open(os.path.join(entry or ".", name, "entry_points.txt"), encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            if f"[{ENTRY_POINT_GROUP}]" not in text:
                continue
            parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
            parser.optionxform = str  # type: ignore[assignment,method-assign]
            try:
                parser.read_string(text)
            except configparser.Error:
                continue
            out += [value.strip() for _, value in parser.items(ENTRY_POINT_GROUP)]
    return out


def _allowed(module: str, allow: Iterable[str]) -> bool:
    if isinstance(allow, str):  # one module given as a plain string
        allow = (allow,)
    return any(module == m or module.startswith(m + ".") for m in allow)


def _schema(factory: str, allow: Iterable[str]) -> type[BaseModel]:
    """The options model of ``factory``; raise ValueError (the message) if it is not usable."""
    decl = registered_factories().get(factory)
    if decl is not None:
        return decl.options
    module, _, attr = factory.partition(":")
    if not _allowed(module, allow):
        known = ", ".join(sorted(registered_factories())) or "(none)"
        raise ValueError(
            f"{factory!r} is neither registered (entry point group {ENTRY_POINT_GROUP!r}) nor allowed; "
            f"registered: {known}; allow its module explicitly with --allow-factory {module}"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # the user's module: any import failure is reported, not raised
        raise ValueError(f"cannot import {factory!r}: {type(exc).__name__}: {exc}") from None
    options = getattr(fn, "graphbuf_options", None)
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise ValueError(
            f"{factory!r} declares no options schema; decorate it with "
            "graphbuf.spec.factories.declare_options(<pydantic model>)"
        )
    return options


def task_strategy(factory: str, allow: Iterable[str] = ()) -> Callable[..., Any] | None:
    """The batch relation ``factory`` declares (imported), or None if it declares none.

    Raises ValueError naming the factory if it is not usable (as for its options) or its relation does not
    import."""
    decl = registered_factories().get(factory)
    if decl is not None:
        path = decl.strategy
    else:
        _schema(factory, allow)  # refuses an unregistered, unallowed factory before any import
        module, _, attr = factory.partition(":")
        path = getattr(getattr(importlib.import_module(module), attr), "graphbuf_strategy", None)
    if path is None:
        return None
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
    except Exception as exc:
        raise ValueError(
            f"{factory!r}: its strategy {path!r} does not import: {type(exc).__name__}: {exc}"
        ) from None


def resolve_options(
    factory: str,
    options: Mapping[str, Any],
    constants: Mapping[str, int | None],
    allow: Iterable[str] = (),
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Options with expressions over constants evaluated, and the problems found as ``(field, message)``
    pairs (``field`` is ``'factory'`` or ``'options.<key>'``). Imports nothing for a registered factory."""
    try:
        schema = _schema(factory, allow)
    except ValueError as exc:
        return {}, [("factory", str(exc))]
    problems: list[tuple[str, str]] = []
    values: dict[str, Any] = {}
    pending: set[str] = set()
    for key, value in options.items():
        if isinstance(value, str):
            try:
                expr = parse_expr(value)
            except ExprError:
                expr = None  # a plain string option (e.g. "dense")
            if expr is not None and expr.names and expr.names <= set(constants):
                if any(constants[n] is None for n in expr.names):
                    pending.add(key)
                    continue
                try:
                    value = expr.eval(constants)
                except ExprError as exc:
                    problems.append((f"options.{key}", str(exc)))
                    continue
        values[key] = value
    try:
        validated = schema.model_validate(values)
    except ValidationError as exc:
        allowed = ", ".join(schema.model_fields)
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(options)"
            if err["type"] == "missing" and key in pending:
                continue
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = f"unknown option; allowed: {allowed}"
            elif err["type"] != "missing":
                msg += f", got {_short(err.get('input'))}"
            problems.append((f"options.{key}", msg))
        return values, problems
    return {**validated.model_dump(exclude_unset=True), **{k: options[k] for k in pending}}, problems


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

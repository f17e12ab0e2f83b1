"""A CPU emulator of a device graph.

The emulator records a function at the dispatcher level (below autograd, one entry per aten op) and replays
the recorded ops the way a CUDA or NPU graph replays kernels on fixed addresses:

- in-place updates to captured tensors between replays are seen by replay; rebinding a Python name is not;
- Python scalars and host lists used during capture are baked into the recording;
- tensors produced during capture that are still reachable when capture ends (returned, held by the caller,
  or sharing storage with such a tensor) are static: each replay rewrites them in place (same ``data_ptr``);
- every other tensor produced during capture is transient: the recording holds no reference to it, so it is
  freed as soon as the captured function drops it, and each replay produces it afresh and drops it after
  its last use (a device graph's private memory pool likewise holds intermediates only while they are live);
- replay runs no Python of the captured function: it is one generated function of pre-resolved op calls;
- like a device graph, capture does not change anything that existed before it: every tensor that existed
  before capture and was written during capture is restored when capture ends (tensors created during
  capture keep their capture-time values until the first replay rewrites them).

Tensors are told apart by a registry of slots keyed by ``id`` and checked against a weak reference (so a
reused ``id`` is never mistaken for a dead tensor); tensors that existed before capture, or that reach the
recorder without being produced by a recorded op, are held strongly. Whether a storage created during
capture is static is decided when capture ends: static if the storage is still alive.

Each op is resolved into the cheapest call that reproduces it: views of static tensors are skipped (the
static view already aliases its static base) and views of transient ones re-run; in-place and out= ops run as
recorded; functional ops with transient results run as recorded; functional ops with static results write
into them through a native out= overload, or ``copy_`` (+ an in-place twin), falling back to
``static.copy_(op(...))``. A shortcut is used only after it reproduced the recorded op on scratch tensors;
verdicts are cached per op and argument signature (dtypes, ranks, contiguity), and ops whose results are
large are checked only if they turn out static. Calls go through torch's generated bindings where those
provably dispatch to the recorded op with the recorded arguments. Composite ops that reach the recorder
whole (under ``inference_mode``) are recorded as what they decompose into.

The recorder applies the capture guards of :mod:`graphbuf.guards` (host read-back, data-dependent shapes)
op by op.
"""

from __future__ import annotations

import keyword
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphbuf.errors import CaptureError
from graphbuf.guards import HostReadGuard, check_dispatch, op_overloads

__all__ = ["Emulator"]

# --------------------------------------------------------------------------------------------------------
# Op analysis (cached per OpOverload)
# --------------------------------------------------------------------------------------------------------

_DROPPABLE = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})
_UNINITIALIZED = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)
# Ops that may change a written tensor's size, strides or storage (as may any out= argument: a resize).
_RESTRIDING = frozenset(
    {"resize_", "resize_as_", "set_", "_resize_output_", "resize_as_sparse_", "sparse_resize_"}
)


@dataclass(frozen=True)
class _OpInfo:
    positional: tuple[str, ...]  # argument names that may be passed positionally, in schema order
    writes: tuple[str, ...]  # arguments the op mutates (alias annotation with "!")
    returns_alias: tuple[bool, ...]  # per return: aliases an argument (a view or the mutated tensor)
    inplace_view: bool  # changes a tensor's metadata only (t_, squeeze_, as_strided_, ...)
    uninitialized: bool  # allocates without writing (empty, empty_like, ...)
    restrides: bool  # may change a written tensor's metadata: an out= argument or resize_/set_
    seeded: bool  # random: two runs legitimately differ


_INFOS: dict[torch._ops.OpOverload, _OpInfo] = {}
_OUTS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, tuple[str, ...]] | None] = {}


def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    info = _INFOS.get(func)
    if info is None:
        schema = func._schema
        tags = func.tags
        name = func.overloadpacket.__name__
        info = _OpInfo(
            positional=tuple(a.name for a in schema.arguments if not a.kwarg_only),
            writes=tuple(
                a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
            ),
            returns_alias=tuple(r.alias_info is not None for r in schema.returns),
            inplace_view=torch.Tag.inplace_view in tags,
            uninitialized=name in _UNINITIALIZED,
            restrides=name in _RESTRIDING or any(a.is_out for a in schema.arguments),
            seeded=torch.Tag.nondeterministic_seeded in tags,
        )
        _INFOS[func] = info
    return info


def _out_overload(func: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, tuple[str, ...]] | None:
    """The out= overload of a functional op that takes the same arguments, or None.

    Same arguments: every non-out argument of the candidate is an argument of ``func`` with the same type,
    and ``func``'s arguments it lacks are only tensor options (dtype, layout, device, pin_memory,
    memory_format), which the out tensor fixes. It has one out argument per return, of the return's type.
    """
    if func in _OUTS:
        return _OUTS[func]
    schema = func._schema
    arg_types = {a.name: str(a.type) for a in schema.arguments}
    return_types = [str(r.type) for r in schema.returns]
    found = None
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        if cand is func:
            continue
        cargs = cand._schema.arguments
        outs = [a for a in cargs if a.is_out]
        ins = [a for a in cargs if not a.is_out]
        if not outs or [str(a.type) for a in outs] != return_types:
            continue
        if any(arg_types.get(a.name) != str(a.type) for a in ins):
            continue
        if not set(arg_types) - {a.name for a in ins} <= _DROPPABLE:
            continue
        found = (cand, tuple(a.name for a in outs))
        break
    _OUTS[func] = found
    return found


_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_COMPOSITE: dict[torch._ops.OpOverload, bool] = {}


def _is_composite(func: torch._ops.OpOverload) -> bool:
    composite = _COMPOSITE.get(func)
    if composite is None:
        composite = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _CIA)
    return composite


def _bind(info: _OpInfo, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = dict(zip(info.positional, args, strict=False))
    bound.update(kwargs)
    return bound


def _tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(a, b))


_NAMESPACES = tuple(
    ns
    for ns in (
        torch._C._VariableFunctions,
        getattr(torch._C, "_nn", None),
        getattr(torch._C, "_special", None),
        getattr(torch._C, "_linalg", None),
        getattr(torch._C, "_fft", None),
        torch._C.TensorBase,
    )
    if ns is not None
)


def _binding(name: str) -> Callable[..., Any] | None:
    """The generated Python binding of aten op ``name`` (``torch.<name>`` or ``Tensor.<name>``), if any.

    It is a faster call path than ``OpOverload._op``; every use is validated against ``_op`` first.
    """
    for ns in _NAMESPACES:
        fn = getattr(ns, name, None)
        if fn is not None:
            return fn
    return None


def _call_parts(
    schema: torch._C.FunctionSchema, bound: Mapping[str, Any], *, binding: bool
) -> tuple[list[Any], dict[str, Any]] | None:
    """Positional and keyword arguments for calling ``schema``'s op with the values in ``bound``.

    ``binding``: for a generated Python binding, whose out arguments are one ``out=`` (a tuple when there
    are several) and whose positional names may differ from the schema's (None if one would be needed).
    """
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    outs: list[str] = []
    gap = False
    for a in schema.arguments:
        if a.is_out:
            outs.append(a.name)
        elif a.name not in bound:
            gap = True
        elif a.kwarg_only:
            kw[a.name] = bound[a.name]
        elif not gap:
            pos.append(bound[a.name])
        elif binding:
            return None
        else:
            kw[a.name] = bound[a.name]
    if binding and outs:
        kw["out"] = bound[outs[0]] if len(outs) == 1 else tuple(bound[o] for o in outs)
    else:
        kw.update((o, bound[o]) for o in outs)
    return pos, kw


def _scratch(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    return [_scratch(v) for v in value]


def _agree(probes: list[torch.Tensor], layout: list[tuple[Any, ...]], expected: list[torch.Tensor]) -> bool:
    if layout != _layout(probes) or len(probes) != len(expected):
        return False
    return all(_same_values(p, e) for p, e in zip(probes, expected, strict=True))


def _layout(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.data_ptr(), t.size(), t.stride()) for t in tensors]


def _nbytes(values: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors_in(values))


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (_sid(t), t.size(), t.stride(), t.storage_offset())


def _contiguous(size: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


# --------------------------------------------------------------------------------------------------------
# Shortcuts for functional ops with static results (validated, verdicts cached per signature)
# --------------------------------------------------------------------------------------------------------

_COPY = torch._C.TensorBase.copy_
_COPY_LIKE = frozenset(op_overloads("clone", "_to_copy", "lift_fresh_copy"))
_INPLACE: dict[torch._ops.OpOverload, torch._ops.OpOverload | None] = {}
# A functional op's results are checked against a shortcut right when it runs only up to this size; larger
# ones are checked at the end of capture, and only if they turned out static (the results of big ops are
# mostly intermediates, and checking re-runs the op).
_CHECK_AT_RECORD_BYTES = 1 << 20


def _inplace_overload(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``func``'s in-place twin (``foo_.<same overload>``) with the same argument names and types."""
    if func in _INPLACE:
        return _INPLACE[func]
    packet = getattr(torch.ops.aten, func.overloadpacket.__name__ + "_", None)
    cand = getattr(packet, func._overloadname, None) if packet is not None else None
    if cand is not None:
        sig = [(a.name, str(a.type), a.kwarg_only) for a in func._schema.arguments]
        if sig != [(a.name, str(a.type), a.kwarg_only) for a in cand._schema.arguments]:
            cand = None
    _INPLACE[func] = cand
    return cand


@dataclass(frozen=True)
class _Recipe:
    """A way to write a functional op's results into given (static) tensors.

    ``out``: ``fn`` is the op's out= overload (its generated binding when ``binding``), called with the op's
    arguments plus ``out_names`` bound to the results. ``direct``: ``copy_(result, self)``, then ``fn`` (the
    in-place twin, on the result) unless ``fn`` is None (copy-like ops: clone, _to_copy).
    """

    kind: str
    fn: Callable[..., Any] | None
    binding: bool
    schema: torch._C.FunctionSchema | None
    out_names: tuple[str, ...] = ()


_Parts = tuple[Callable[..., Any], list[Any], dict[str, Any]]
_RECIPES: dict[tuple[Any, ...], _Recipe | None] = {}  # signature -> the first recipe that agreed, or None
_MISSING = object()


def _recipe_calls(recipe: _Recipe, bound: Mapping[str, Any], results: Sequence[Any]) -> list[_Parts] | None:
    """The calls that apply ``recipe`` with arguments ``bound`` and result tensors ``results`` (values or
    slots alike); None if the binding would need an argument by a name it may not accept."""
    if recipe.kind == "out":
        parts = _call_parts(
            recipe.schema,  # type: ignore[arg-type]
            {**bound, **dict(zip(recipe.out_names, results, strict=True))},
            binding=recipe.binding,
        )
        return None if parts is None else [(recipe.fn, *parts)]  # type: ignore[list-item]
    calls: list[_Parts] = [(_COPY, [results[0], bound["self"]], {})]
    if recipe.fn is not None:
        parts = _call_parts(recipe.schema, {**bound, "self": results[0]}, binding=recipe.binding)  # type: ignore[arg-type]
        if parts is None:
            return None
        calls.append((recipe.fn, *parts))
    return calls


def _candidates(
    func: torch._ops.OpOverload, info: _OpInfo, bound: Mapping[str, Any], results: Sequence[Any]
) -> Iterator[_Recipe]:
    """Recipes in order of preference: a native out= kernel; copy_ / copy_ + in-place op; an autogenerated
    out= overload (it computes the functional result and copies it: an extra pass and allocation)."""
    found = _out_overload(func)
    outs: list[_Recipe] = []
    if found is not None:
        cand, out_names = found
        fast = None if info.seeded else _binding(cand.overloadpacket.__name__)
        if fast is not None:
            outs.append(_Recipe("out", fast, True, cand._schema, out_names))
        outs.append(_Recipe("out", cand._op, False, cand._schema, out_names))
    generated = found is not None and torch.Tag.generated in found[0].tags
    if not generated:
        yield from outs
    yield from _direct_recipes(func, info, bound, results)
    if generated:
        yield from outs


def _direct_recipes(
    func: torch._ops.OpOverload, info: _OpInfo, bound: Mapping[str, Any], results: Sequence[Any]
) -> list[_Recipe]:
    if info.seeded or len(results) != 1 or not isinstance(results[0], torch.Tensor):
        return []
    static, src = results[0], bound.get("self")
    if not isinstance(src, torch.Tensor) or src.shape != static.shape:
        return []
    if func in _COPY_LIKE:
        return [_Recipe("direct", None, False, None)]
    inplace = _inplace_overload(func)
    if inplace is None or src.dtype != static.dtype:
        return []
    recipes = []
    fast = _binding(inplace.overloadpacket.__name__)
    if fast is not None:
        recipes.append(_Recipe("direct", fast, True, inplace._schema))
    recipes.append(_Recipe("direct", inplace._op, False, inplace._schema))
    return recipes


def _find_recipe(
    func: torch._ops.OpOverload,
    info: _OpInfo,
    bound: Mapping[str, Any],
    results: Sequence[Any],
    reference: Sequence[Any] | None,
) -> _Recipe | None:
    """The first candidate recipe that, run into scratch tensors of the results' layout, keeps their
    addresses and strides and (unless ``reference`` is None: random ops) reproduces ``reference`` exactly."""
    for recipe in _candidates(func, info, bound, results):
        probes = [_scratch(r) for r in results]
        calls = _recipe_calls(recipe, bound, probes)
        if calls is None:
            continue
        flat = _tensors_in(probes)
        layout = _layout(flat)
        try:
            for fn, pos, kw in calls:
                fn(*pos, **kw)
        except Exception:
            continue
        if reference is None:
            if layout == _layout(flat):
                return recipe
        elif _agree(flat, layout, _tensors_in(reference)):
            return recipe
    return None


# --------------------------------------------------------------------------------------------------------
# Generated bindings: used only where they provably dispatch the recorded call
# --------------------------------------------------------------------------------------------------------


class _ProbeHit(Exception):
    """Stops a probed call at its first dispatched op, before any kernel runs."""


class _Probe(TorchDispatchMode):
    def __init__(self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        super().__init__()
        self.expected = (func, args, kwargs)
        self.match = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        want, want_args, want_kwargs = self.expected
        self.match = func is want and _same_args(args, want_args) and _same_args(kwargs or {}, want_kwargs)
        raise _ProbeHit


def _same_args(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_same_args(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same_args(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and bool(a == b)


def _type_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_type_signature(v) for v in value))
    return type(value)


_BINDINGS: dict[tuple[Any, ...], bool] = {}


def _uses_binding(
    func: torch._ops.OpOverload,
    info: _OpInfo,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    bound: Mapping[str, Any],
) -> bool:
    """True if ``func``'s generated binding, called with ``bound`` laid out by :func:`_call_parts`,
    dispatches exactly ``func(*args, **kwargs)``. Checked once per argument type signature by calling the
    binding under a mode that stops it at its first op (nothing runs); random ops always use ``_op``."""
    if info.seeded:
        return False
    fast = _binding(func.overloadpacket.__name__)
    if fast is None:
        return False
    parts = _call_parts(func._schema, bound, binding=True)
    if parts is None:
        return False
    key = (func, _type_signature(tuple(args)), tuple((k, _type_signature(v)) for k, v in kwargs.items()))
    verdict = _BINDINGS.get(key)
    if verdict is None:
        probe = _Probe(func, args, kwargs)
        try:
            with probe:
                fast(*parts[0], **parts[1])
        except Exception:  # _ProbeHit, or the binding rejected the arguments
            pass
        verdict = _BINDINGS[key] = probe.match
    return verdict


# --------------------------------------------------------------------------------------------------------
# Slots and nodes: what a recording refers to, without holding intermediates
# --------------------------------------------------------------------------------------------------------


class _Group:
    """A storage the recording refers to (every slot viewing it shares the group)."""

    __slots__ = ("created", "nbytes", "owner", "sid", "static", "storage")

    def __init__(self, created: bool, storage: torch.UntypedStorage, owner: int | None) -> None:
        self.created = created  # allocated by a recorded op; else it existed before, or came from outside
        self.storage = weakref.ref(storage)
        self.sid = storage._cdata
        self.owner = owner  # the task group whose op allocated it, or None
        self.static = not created  # a created storage is static iff it is alive when its recording ends
        self.nbytes = storage.nbytes()


class _Slot:
    """A tensor the recording refers to. ``tensor`` holds it strongly (inputs; after recording, every static
    slot); during recording a created tensor is only weakly referenced (``ref``), so it dies with its last
    user. After recording, a slot with ``tensor`` None is transient: replay produces it as a local."""

    __slots__ = ("group", "index", "key", "meta", "ref", "tensor")

    def __init__(self, index: int, t: torch.Tensor, group: _Group, strong: bool) -> None:
        self.index = index
        self.key = id(t)
        self.group = group
        self.meta = (t.size(), t.stride(), t.storage_offset(), t.dtype, t.device)
        self.tensor: torch.Tensor | None = t if strong else None
        self.ref: weakref.ref[torch.Tensor] | None = None if strong else weakref.ref(t)

    def held(self) -> torch.Tensor | None:
        if self.tensor is not None:
            return self.tensor
        return None if self.ref is None else self.ref()


class _Seq:
    """A list or tuple argument that holds tensors, with the tensors replaced by their slots."""

    __slots__ = ("is_tuple", "items")

    def __init__(self, items: list[Any], is_tuple: bool) -> None:
        self.items = items
        self.is_tuple = is_tuple


def _slots_in(value: Any) -> list[_Slot]:
    if isinstance(value, _Slot):
        return [value]
    if isinstance(value, _Seq):
        value = value.items
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _slots_in(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _slots_in(v)]
    return []


def _materialize(value: Any) -> Any:
    """``value`` with every slot replaced by its (held) tensor."""
    if isinstance(value, _Slot):
        return value.tensor
    if isinstance(value, _Seq):
        items = [_materialize(v) for v in value.items]
        return tuple(items) if value.is_tuple else items
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    return value


def _rebuild(meta: tuple[Any, ...], storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor with a dead slot's recorded geometry over its (static, alive) storage."""
    size, stride, offset, dtype, device = meta
    return torch.empty((0,), dtype=dtype, device=device).set_(storage, offset, size, stride)


def _kind(value: Any, first: Any) -> Any:
    """What a recipe's validity may depend on: per tensor its dtype, rank, contiguity, emptiness, device and
    whether it has the first result's shape; per host value its type."""
    if isinstance(value, _Slot):
        size, stride, _, dtype, device = value.meta
        return (dtype, len(size), _contiguous(size, stride), 0 in size, device.type, size == first)
    if isinstance(value, (_Seq, list, tuple)):
        items = value.items if isinstance(value, _Seq) else value
        return (type(value), tuple(_kind(v, first) for v in items))
    return type(value)


class _Node:
    """One recorded op over slots; ``calls`` is how replay runs it (set when its recording ends)."""

    __slots__ = ("all_new", "args", "binding", "calls", "func", "info", "kwargs", "new", "results", "single")

    def __init__(
        self,
        func: torch._ops.OpOverload,
        info: _OpInfo,
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
        self.calls: tuple[_Call, ...] = ()

    def bound(self) -> dict[str, Any]:
        return _bind(self.info, self.args, self.kwargs)

    def recipe_key(self) -> tuple[Any, ...]:
        first = _slots_in(self.results)[0].meta[0]
        bound = self.bound()
        return (
            self.func,
            tuple((name, _kind(v, first)) for name, v in bound.items()),
            tuple(_kind(r, first) for r in self.results),
        )


class _Call:
    """One call of the generated replay function: ``fn(*pos, **kw)`` over slots and constants. Its returns
    (``results``, shaped like the node's) bind transient slots; slots in ``copies`` are static results the
    returned tensors are copied into."""

    __slots__ = ("copies", "fn", "kw", "pos", "results", "single")

    def __init__(
        self,
        fn: Callable[..., Any],
        pos: Sequence[Any],
        kw: Mapping[str, Any],
        results: tuple[Any, ...] | None = None,
        single: bool = True,
        copies: frozenset[int] = frozenset(),
    ) -> None:
        self.fn = fn
        self.pos = list(pos)
        self.kw = dict(kw)
        self.results = results
        self.single = single
        self.copies = copies

    def reads(self) -> list[int]:
        """Indices of the transient slots this call reads."""
        return [s.index for s in _slots_in(self.pos) + _slots_in(self.kw) if s.tensor is None]

    def returns(self) -> list[tuple[str, _Slot]]:
        """(subscript into the call's return value, slot) for every slot it returns."""
        found: list[tuple[str, _Slot]] = []
        for i, value in enumerate(self.results or ()):
            base = "" if self.single else f"[{i}]"
            if isinstance(value, _Slot):
                found.append((base, value))
            elif isinstance(value, list):
                found.extend((f"{base}[{j}]", s) for j, s in enumerate(value) if s is not None)
        return found


def _generate(calls: Sequence[_Call]) -> tuple[Callable[[], None], str]:
    """Compile ``calls`` into one function. Transient slots are its locals, deleted after their last use;
    static slots, callables and host values are globals of its namespace."""
    namespace: dict[str, Any] = {"__builtins__": {}}
    names: dict[int, str] = {}

    def const(obj: Any) -> str:
        name = names.get(id(obj))
        if name is None:
            name = names[id(obj)] = f"k{len(names)}"
            namespace[name] = obj
        return name

    def expr(value: Any) -> str:
        if isinstance(value, _Slot):
            return f"v{value.index}" if value.tensor is None else const(value.tensor)
        if isinstance(value, (_Seq, list, tuple)):
            items = value.items if isinstance(value, _Seq) else value
            is_tuple = value.is_tuple if isinstance(value, _Seq) else isinstance(value, tuple)
            if not any(isinstance(v, (_Slot, _Seq)) for v in items):
                return const(value)
            if all(s.tensor is not None for s in _slots_in(value)):
                return const(_materialize(value))
            inner = ", ".join(expr(v) for v in items)
            return f"({inner},)" if is_tuple else f"[{inner}]"
        if value is None or type(value) in (bool, int):
            return repr(value)
        return const(value)

    reads = [call.reads() for call in calls]
    last: dict[int, int] = {}
    for i, used in enumerate(reads):
        for index in used:
            last[index] = i
    copy = const(_COPY)
    defined: set[int] = set()
    lines: list[str] = []
    for i, call in enumerate(calls):
        missing = [index for index in reads[i] if index not in defined]
        if missing:
            raise RuntimeError(
                f"graphbuf emulator: replay would read transient slots {missing} before they exist"
            )
        parts = [expr(a) for a in call.pos]
        odd = {}
        for name, value in call.kw.items():
            if name.isidentifier() and not keyword.iskeyword(name):
                parts.append(f"{name}={expr(value)}")
            else:
                odd[name] = value
        if odd:
            parts.append("**{" + ", ".join(f"{name!r}: {expr(v)}" for name, v in odd.items()) + "}")
        text = f"{const(call.fn)}({', '.join(parts)})"
        binds: list[tuple[str, str]] = []
        copies: list[tuple[str, str]] = []
        for sub, slot in call.returns():
            if slot.tensor is None:
                if last.get(slot.index, -1) > i:
                    binds.append((sub, f"v{slot.index}"))
                    defined.add(slot.index)
            elif slot.index in call.copies:
                copies.append((sub, const(slot.tensor)))
        if not binds and not copies:
            lines.append(text)
        elif len(binds) + len(copies) == 1 and (binds or copies)[0][0] == "":
            lines.append(f"{binds[0][1]} = {text}" if binds else f"{copy}({copies[0][1]}, {text})")
        else:
            lines.append(f"_r = {text}")
            lines.extend(f"{name} = _r{sub}" for sub, name in binds)
            lines.extend(f"{copy}({name}, _r{sub})" for sub, name in copies)
            lines.append("del _r")
        dead = sorted({index for index in reads[i] if last[index] == i})
        if dead:
            lines.append("del " + ", ".join(f"v{index}" for index in dead))
    body = "\n".join(f"    {line}" for line in lines) or "    pass"
    source = f"def _replay():\n{body}\n"
    exec(compile(source, "<graphbuf replay>", "exec"), namespace)
    return namespace["_replay"], source


# --------------------------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------------------------


class _Segment:
    """A run of recorded nodes: the main recording between tasks, or one task group."""

    __slots__ = ("group", "groups", "kinds", "label", "nodes", "slots")

    def __init__(self, group: int | None, label: str = "") -> None:
        self.group = group  # index in Emulator._segments when this is a task group, else None
        self.label = label
        self.nodes: list[_Node] = []
        self.slots: list[_Slot] = []  # slots first registered while this segment was recording
        self.groups: list[_Group] = []  # storages first seen while this segment was recording
        self.kinds: Counter[str] = Counter()


_STATE = threading.local()


def _recording() -> bool:
    return getattr(_STATE, "recording", False)


class _Recorder(TorchDispatchMode):
    """Runs each aten op, records it as a node over slots, and snapshots pre-existing memory it writes."""

    def __init__(self, emulator: Emulator, segment: _Segment, restore: bool) -> None:
        super().__init__()
        self.emulator = emulator
        self.segment = segment
        self._restore = restore
        self.slots: list[_Slot] = []  # every slot registered by this recording session
        self.groups: list[_Group] = []  # every storage group first seen by it
        self._spans: dict[int, list[tuple[int, int]]] = {}
        self._snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_dispatch(func, args, kwargs)
        if _is_composite(func):
            # Under inference_mode composite ops (reshape, einsum, softmax, to, ...) reach this mode whole;
            # record what they decompose into, as outside inference_mode, so every recorded op has exact
            # aliasing and, mostly, an out= overload.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        info = _op_info(func)
        bound = _bind(info, args, kwargs)
        slots = {id(t): self._input(t) for t in _tensors_in(bound.values())}
        self._check_task_outputs(func, slots.values())
        written = _tensors_in(bound.get(name) for name in info.writes) if info.writes else []
        if self._restore:
            for t in written:
                if not slots[id(t)].group.created:
                    self._snapshot(t)
        watch = [(t, _geometry(t)) for t in written if slots[id(t)].tensor is None] if info.restrides else []
        result = func(*args, **kwargs)
        # A created tensor whose metadata changes (t_, resize_, an out= resize) keeps its recorded geometry
        # only as this object: hold it, so it stays static and replay uses the object itself.
        for t, geometry in watch:
            if _geometry(t) != geometry:
                self._pin(slots[id(t)], t)
        if info.inplace_view:
            for t in written:
                self._pin(slots[id(t)], t)
        self._record(func, info, args, kwargs, bound, slots, result)
        return result

    # ---- slots ----------------------------------------------------------------------------------------

    def _known(self, t: torch.Tensor) -> _Slot | None:
        slot = self.emulator._by_id.get(id(t))
        return slot if slot is not None and slot.held() is t else None

    def _add(self, t: torch.Tensor, group: _Group, strong: bool) -> _Slot:
        em = self.emulator
        strong = strong or t.is_conj() or t.is_neg() or t.layout != torch.strided  # not rebuildable
        slot = _Slot(em._next_index, t, group, strong)
        em._next_index += 1
        em._by_id[slot.key] = slot
        self.slots.append(slot)
        self.segment.slots.append(slot)
        return slot

    def _new_group(self, created: bool, storage: torch.UntypedStorage) -> _Group:
        group = _Group(created, storage, self.segment.group if created else None)
        self.emulator._by_sid[group.sid] = group
        self.groups.append(group)
        self.segment.groups.append(group)
        return group

    def _storage_group(self, storage: torch.UntypedStorage) -> _Group | None:
        group = self.emulator._by_sid.get(storage._cdata)
        return group if group is not None and group.storage() is storage else None

    def _input(self, t: torch.Tensor) -> _Slot:
        slot = self._known(t)
        if slot is None:
            # Existed before capture, or made outside the dispatcher (torch.tensor(host list)): held.
            storage = t.untyped_storage()
            group = self._storage_group(storage) or self._new_group(False, storage)
            slot = self._add(t, group, strong=True)
        return slot

    def _result(self, t: torch.Tensor, fresh: dict[int, _Group]) -> tuple[_Slot, bool]:
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

    def _pin(self, slot: _Slot, t: torch.Tensor) -> None:
        slot.tensor, slot.ref = t, None

    def _template(self, value: Any, slots: Mapping[int, _Slot]) -> Any:
        if isinstance(value, torch.Tensor):
            return slots[id(value)]
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, torch.Tensor) for v in value):
                return _Seq([self._template(v, slots) for v in value], isinstance(value, tuple))
            return list(value) if isinstance(value, list) else value  # a copy: host lists are baked
        return value

    # ---- checks and snapshots -------------------------------------------------------------------------

    def _check_task_outputs(self, func: torch._ops.OpOverload, slots: Iterable[_Slot]) -> None:
        for slot in slots:
            owner = slot.group.owner
            if owner is not None and owner != self.segment.group:
                label = self.emulator._segments[owner].label
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
        self.emulator._forget(self.slots, self.groups)

    # ---- recording ------------------------------------------------------------------------------------

    def _record(
        self,
        func: torch._ops.OpOverload,
        info: _OpInfo,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        bound: Mapping[str, Any],
        slots: Mapping[int, _Slot],
        result: Any,
    ) -> None:
        single = len(info.returns_alias) == 1
        values: tuple[Any, ...] = (result,) if single else tuple(result or ())
        fresh: dict[int, _Group] = {}
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
                items: list[_Slot | None] = []
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
        node = _Node(
            func,
            info,
            tuple(self._template(a, slots) for a in args),
            {k: self._template(v, slots) for k, v in kwargs.items()},
            tuple(pattern),
            frozenset(new),
            all_new,
        )
        node.binding = _uses_binding(func, info, args, kwargs, bound)
        if all_new and not info.writes and _nbytes(values) <= _CHECK_AT_RECORD_BYTES:
            # Cheap now, on the exact inputs; needed only if the results turn out static.
            key = node.recipe_key()
            if key not in _RECIPES:
                _RECIPES[key] = _find_recipe(func, info, bound, values, None if info.seeded else values)
        self.segment.nodes.append(node)


# --------------------------------------------------------------------------------------------------------
# Emulator
# --------------------------------------------------------------------------------------------------------


class Emulator:
    """A recording of aten ops that replays like a device graph (see the module docstring).

    Invariants: ``captured`` is true only after a capture ended without an exception; a failed capture or
    task update leaves no mode installed, restores every pre-existing tensor it wrote and keeps the previous
    state. The recording holds strongly only the tensors that existed before capture (or came from outside
    the dispatcher) and the static ones; transient intermediates live only during capture and during each
    replay. Replay runs under ``torch.inference_mode()`` (so tensors captured under inference mode, as vLLM
    does, can be rewritten; autograd never records replay).

    ``restore_inputs=False`` skips the snapshot/restore of pre-existing tensors written during capture
    (faster for very large written tensors, e.g. a KV cache; capture then applies its writes once).
    """

    def __init__(self, *, restore_inputs: bool = True) -> None:
        self._restore = restore_inputs
        self._segments: list[_Segment] = []
        self._by_id: dict[int, _Slot] = {}  # id(tensor) -> slot, checked against the slot's reference
        self._by_sid: dict[int, _Group] = {}  # storage _cdata -> group, checked against its weak reference
        self._next_index = 0
        self._replay: Callable[[], None] | None = None
        self._num_steps = 0
        self._source = ""
        self._captured = False
        self._recorder: _Recorder | None = None

    @property
    def captured(self) -> bool:
        """True once a capture has completed and until :meth:`reset`."""
        return self._captured

    @property
    def capturing(self) -> bool:
        """True while inside :meth:`capture`."""
        return self._recorder is not None

    @property
    def num_steps(self) -> int:
        """Number of op calls one replay makes."""
        return self._num_steps

    @property
    def stats(self) -> dict[str, int]:
        """Recorded ops by replay strategy: ``transient`` (functional op producing transient results),
        ``view`` (view of a transient tensor, re-run), ``out`` (out= overload into the static result),
        ``direct`` (copy_ / copy_ + in-place op into the static result), ``copy`` (the op, then a copy into
        its static results), ``as_recorded`` (in-place / out= op), ``skipped`` (views of static tensors,
        metadata-only and uninitialized ops)."""
        total: Counter[str] = Counter()
        for seg in self._segments:
            total.update(seg.kinds)
        return dict(total)

    @property
    def slots(self) -> dict[str, int]:
        """Tensors the recorded ops refer to: ``static`` (created during capture and still reachable when it
        ended: held, rewritten in place by replay), ``transient`` (created during capture and dropped by
        then: not held, re-created by each replay and freed after their last use), ``external`` (existed
        before capture, or came from outside the dispatcher: held); ``static_bytes`` / ``transient_bytes``:
        the sizes of their distinct storages. Only ``static_bytes`` stays allocated between replays."""
        counts: Counter[str] = Counter()
        groups: dict[int, _Group] = {}
        seen: set[int] = set()
        for seg in self._segments:
            for node in seg.nodes:
                for slot in _slots_in(node.args) + _slots_in(node.kwargs) + _slots_in(node.results):
                    if slot.index in seen:
                        continue
                    seen.add(slot.index)
                    group = slot.group
                    if not group.created:
                        counts["external"] += 1
                        continue
                    counts["static" if group.static else "transient"] += 1
                    groups[id(group)] = group
        static_bytes = transient_bytes = 0
        for group in groups.values():
            storage = group.storage() if group.static else None
            if storage is not None:
                static_bytes += storage.nbytes()
            else:
                transient_bytes += group.nbytes
        return {
            "static": counts["static"],
            "transient": counts["transient"],
            "external": counts["external"],
            "static_bytes": static_bytes,
            "transient_bytes": transient_bytes,
        }

    def reset(self) -> None:
        """Drop the recording; the emulator can capture again."""
        if self.capturing:
            raise CaptureError("Emulator.reset() inside capture(); leave the capture block first")
        self._clear()

    def _clear(self) -> None:
        self._segments = []
        self._by_id = {}
        self._by_sid = {}
        self._replay = None
        self._num_steps = 0
        self._source = ""
        self._captured = False

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Record every aten op run in the body, under the capture guards (strict about ``.cpu()``)."""
        if self.capturing:
            raise CaptureError("capture() is already active on this emulator")
        if self._captured:
            raise CaptureError("this emulator already holds a capture; call reset() before capturing again")
        if _recording():
            raise CaptureError("nested capture: another graph is capturing on this thread")
        self._clear()
        recorder = _Recorder(self, _Segment(None), self._restore)
        self._segments = [recorder.segment]
        self._recorder = recorder
        _STATE.recording = True
        ok = False
        try:
            with HostReadGuard(strict_cpu=True), recorder:
                yield
            ok = True
        finally:
            _STATE.recording = False
            self._recorder = None
            recorder.restore()
            if ok:
                try:
                    self._settle(recorder, self._segments)
                    self._compile()
                except BaseException:
                    self._clear()
                    raise
                self._captured = True
            else:
                self._clear()

    def begin_group(self, label: str) -> int:
        """Start a task group inside capture; returns its id (for end_group / rerecord_group)."""
        recorder = self._recorder
        if recorder is None:
            raise CaptureError("begin_group() outside capture()")
        if recorder.segment.group is not None:
            raise CaptureError(
                f"task {label!r} started inside task {recorder.segment.label!r}; task groups do not nest"
            )
        seg = _Segment(len(self._segments), label)
        self._segments.append(seg)
        recorder.segment = seg
        return seg.group  # type: ignore[return-value]

    def end_group(self, group: int) -> None:
        """End the task group ``group``; ops after it are recorded into the main recording again."""
        recorder = self._recorder
        if recorder is None or recorder.segment.group != group:
            raise CaptureError(f"end_group({group}) does not match the open task group")
        after = _Segment(None)
        self._segments.append(after)
        recorder.segment = after

    def rerecord_group(self, group: int, run: Callable[[], object]) -> None:
        """Replace task group ``group`` with the ops ``run()`` issues now (fresh host arguments).

        Runs after capture, under the same guards. On error the previous group is kept. Every tensor that
        existed before is restored afterwards, so the update takes effect at the next replay.
        """
        if self.capturing:
            raise CaptureError("a task can be re-issued only after capture() has ended")
        if not self._captured:
            raise CaptureError("no capture to update: the graph was reset or never captured")
        if _recording():
            raise CaptureError("cannot re-issue a task while another graph is capturing on this thread")
        old = self._segments[group]
        if old.group != group:
            raise CaptureError(f"{group} is not a task group of this capture")
        seg = _Segment(group, old.label)
        recorder = _Recorder(self, seg, self._restore)
        _STATE.recording = True
        ok = False
        try:
            with HostReadGuard(strict_cpu=True), recorder:
                run()
            ok = True
        finally:
            _STATE.recording = False
            recorder.restore()
            if not ok:
                recorder.discard()
        try:
            self._settle(recorder, [seg])
            self._segments[group] = seg
            self._compile()
        except BaseException:
            self._segments[group] = old
            recorder.discard()
            self._compile()
            raise
        self._forget(old.slots, old.groups)

    def _forget(self, slots: Iterable[_Slot], groups: Iterable[_Group]) -> None:
        """Drop registry entries that still point at ``slots`` / ``groups``."""
        for slot in slots:
            if self._by_id.get(slot.key) is slot:
                del self._by_id[slot.key]
        for group in groups:
            if self._by_sid.get(group.sid) is group:
                del self._by_sid[group.sid]

    def _settle(self, recorder: _Recorder, segments: Sequence[_Segment]) -> None:
        """End a recording session: decide which created storages are static (still alive), hold their
        tensors (rebuilding dead views of them from the storage), forget the transient ones, and plan how
        replay runs each node of ``segments``."""
        alive = []
        for group in recorder.groups:
            if group.created:
                storage = group.storage()
                group.static = storage is not None
                if storage is not None:
                    alive.append(storage)  # held while its slots are settled
        with torch.inference_mode():
            for slot in recorder.slots:
                if slot.tensor is None and slot.group.static:
                    t = slot.ref() if slot.ref is not None else None
                    slot.tensor = t if t is not None else _rebuild(slot.meta, slot.group.storage())  # type: ignore[arg-type]
                slot.ref = None
            self._forget(
                [s for s in recorder.slots if s.tensor is None], [g for g in recorder.groups if not g.static]
            )
            for seg in segments:
                seg.kinds.clear()
                for node in seg.nodes:
                    seg.kinds[self._plan(node)] += 1
        del alive

    def _plan(self, node: _Node) -> str:
        """Set ``node.calls`` (how replay runs it) and return the strategy's name (see :attr:`stats`)."""
        info = node.info
        results = _slots_in(node.results)
        local = any(s.tensor is None for s in results)
        static_new = frozenset(s.index for s in results if s.index in node.new and s.tensor is not None)
        if info.inplace_view or (info.uninitialized and not local):
            node.calls = ()
            return "skipped"
        if static_new:
            if node.all_new and not info.writes and len(static_new) == len(results):
                recipe = self._recipe(node)
                calls = _recipe_calls(recipe, node.bound(), node.results) if recipe is not None else None
                if calls is not None:
                    node.calls = tuple(_Call(fn, pos, kw) for fn, pos, kw in calls)
                    return recipe.kind  # type: ignore[union-attr]
            node.calls = (self._as_recorded(node, static_new),)
            return "copy"
        if local:
            node.calls = (self._as_recorded(node),)
            if any(s.index in node.new for s in results):
                return "transient"
            return "as_recorded" if info.writes or not info.returns_alias else "view"
        if info.writes or not info.returns_alias:
            node.calls = (self._as_recorded(node),)
            return "as_recorded"
        node.calls = ()
        return "skipped"

    def _as_recorded(self, node: _Node, copies: frozenset[int] = frozenset()) -> _Call:
        """The node's own call (its generated binding where proven equivalent, else ``OpOverload._op``)."""
        func = node.func
        if node.binding:
            parts = _call_parts(func._schema, node.bound(), binding=True)
            if parts is not None:
                fn = _binding(func.overloadpacket.__name__)
                return _Call(fn, parts[0], parts[1], node.results, node.single, copies)  # type: ignore[arg-type]
        return _Call(func._op, node.args, node.kwargs, node.results, node.single, copies)

    def _recipe(self, node: _Node) -> _Recipe | None:
        """A validated recipe for a functional node whose results are all static: the cached verdict for
        its signature, else one checked now on its inputs if they are all held, else None (copy)."""
        key = node.recipe_key()
        recipe = _RECIPES.get(key, _MISSING)
        if recipe is not _MISSING:
            return recipe  # type: ignore[return-value]
        if any(s.tensor is None for s in _slots_in(node.args) + _slots_in(node.kwargs)):
            return None
        args = [_materialize(a) for a in node.args]
        kwargs = {k: _materialize(v) for k, v in node.kwargs.items()}
        results = [_materialize(r) for r in node.results]
        reference = None
        if not node.info.seeded:
            try:
                ref = node.func._op(*args, **kwargs)
            except Exception:
                return None
            reference = (ref,) if node.single else tuple(ref)
        recipe = _RECIPES[key] = _find_recipe(
            node.func, node.info, _bind(node.info, args, kwargs), results, reference
        )
        return recipe

    def _compile(self) -> None:
        calls = [call for seg in self._segments for node in seg.nodes for call in node.calls]
        self._replay, self._source = _generate(calls)
        self._num_steps = len(calls)

    def replay(self) -> None:
        """Run the recorded ops once, in order; static tensors are rewritten in place."""
        if not self._captured or self._replay is None:
            raise CaptureError("replay() before a completed capture")
        if torch.is_inference_mode_enabled():
            self._replay()
            return
        with torch.inference_mode():
            self._replay()

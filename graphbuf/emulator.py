"""A CPU emulator of a device graph, and the capture guards that every device's capture uses.

The emulator records a function at the dispatcher level (below autograd, one entry per aten op) and replays
the recorded ops on the recorded tensor objects, the way a CUDA or NPU graph replays kernels on fixed
addresses:

- in-place updates to captured tensors between replays are seen by replay; rebinding a Python name is not;
- Python scalars and host lists used during capture are baked into the recording;
- tensors produced during capture are static: each replay rewrites them in place (same ``data_ptr``);
- replay runs no Python of the captured function: it is a loop over pre-resolved op calls;
- like a device graph, capture does not change anything that existed before it: every tensor that existed
  before capture and was written during capture is restored when capture ends (tensors created during
  capture keep their capture-time values until the first replay rewrites them).

Each op is resolved once, at record time, into the cheapest call that reproduces it on the static tensors:
views are skipped (the static view already aliases its static base); in-place and out= ops run as
recorded; functional ops write into their static result through a native out= overload, or ``copy_`` (+ an
in-place twin), falling back to ``static.copy_(op(...))``. Every shortcut is checked once against the
recorded op on scratch tensors; calls go through torch's generated bindings where those agree. Composite
ops that reach the recorder whole (under ``inference_mode``) are recorded as what they decompose into.

The guards (:class:`HostReadGuard`, :class:`DispatchGuard`) raise :class:`~graphbuf.errors.CaptureError` for
host read-back (``.item()``, ``.tolist()``, ``bool(t)``, ...) and for ops whose output shape depends on tensor
values (``nonzero``, ``x[mask]``, ``unique``, ...). They live here because the emulator's recorder applies the
same checks op by op; :class:`graphbuf.graph.Graph` installs them around cuda and npu captures too.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphbuf.errors import CaptureError

__all__ = [
    "DispatchGuard",
    "Emulator",
    "HostReadGuard",
    "capture_guards",
    "check_dispatch",
]

Step = Callable[[], object]

# --------------------------------------------------------------------------------------------------------
# Guards
# --------------------------------------------------------------------------------------------------------

_T = torch.Tensor
_HOST_READS: dict[object, str] = {
    _T.item: "Tensor.item()",
    _T.tolist: "Tensor.tolist()",
    _T.numpy: "Tensor.numpy()",
    _T.__bool__: "bool(tensor)",
    _T.__int__: "int(tensor)",
    _T.__float__: "float(tensor)",
    _T.__complex__: "complex(tensor)",
    _T.__index__: "using a tensor as a Python int (tensor.__index__)",
    _T.__array__: "numpy.asarray(tensor) (tensor.__array__)",
}
_HOST_READ_WHY = (
    "reads tensor data back to the host during graph capture; a graph records device work and cannot stop "
    "to hand a value to Python at replay. Keep the value on the device (tensor ops, torch.where) or read "
    "it before capture."
)


def _to_cpu_error(what: str, src: torch.Tensor) -> CaptureError:
    where = "an emulated-device (cpu)" if src.device.type == "cpu" else f"a {src.device.type}"
    return CaptureError(
        f"{what} copies {where} tensor of shape {tuple(src.shape)} to the host during graph "
        "capture; on a device graph that is a synchronizing device-to-host copy that cannot be recorded "
        "(the cpu emulator rejects it too, to behave like one). Keep the data in a device tensor or copy "
        "it out after replay()."
    )


class HostReadGuard(TorchFunctionMode):
    """Torch-function mode that raises :class:`CaptureError` for host read-back during capture.

    Rejects ``Tensor.item``, ``tolist``, ``numpy``, ``__bool__``, ``__int__``, ``__float__``, ``__complex__``,
    ``__index__``, ``__array__`` on any tensor, and ``Tensor.cpu`` / ``Tensor.to(<cpu>)`` on a non-cpu
    tensor. With ``strict_cpu`` (the cpu emulator, where cpu stands for the device) also ``Tensor.cpu()`` and
    ``Tensor.to("cpu")`` (a device given as a string) on cpu tensors; ``x.to(torch.device)`` /
    ``x.to(other_tensor)`` stay allowed there, as device code that moves nothing. It sees top-level calls
    only; :class:`DispatchGuard` catches reads that reach the dispatcher.
    """

    def __init__(self, *, strict_cpu: bool) -> None:
        super().__init__()
        self._strict_cpu = strict_cpu

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        try:
            what = _HOST_READS.get(func)
        except TypeError:  # an unhashable callable cannot be one of ours
            what = None
        if what is not None:
            raise CaptureError(f"{what} {_HOST_READ_WHY}")
        if (func is _T.cpu or func is _T.to) and args and isinstance(args[0], torch.Tensor):
            self._check_host_copy(func, args, kwargs)
        return func(*args, **kwargs)

    def _check_host_copy(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        src = args[0]
        if func is _T.cpu:
            if self._strict_cpu or src.device.type != "cpu":
                raise _to_cpu_error("Tensor.cpu()", src)
            return
        try:
            target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        except Exception:  # let the real call report malformed arguments
            return
        if target is None or target.type != "cpu":
            return
        if src.device.type != "cpu":
            raise _to_cpu_error("Tensor.to(<cpu>)", src)
        # On the emulator cpu stands for the device: only a literal "cpu" string asks for the host. A
        # torch.device or a tensor target (x.to(q.device), mask.to(scores)) is device code moving nowhere.
        spelled = args[1] if len(args) > 1 else kwargs.get("device")
        if self._strict_cpu and isinstance(spelled, str):
            raise _to_cpu_error(f"Tensor.to({spelled!r})", src)


_aten = torch.ops.aten
_OK, _DYNAMIC, _DATA_DEP, _BOOL_READ, _BOOL_WRITE, _REPEAT, _TO_COPY, _COPY = range(8)


def _overloads(*names: str) -> list[torch._ops.OpOverload]:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return found


_SPECIAL: dict[torch._ops.OpOverload, int] = {
    **dict.fromkeys(_overloads("index.Tensor", "index.Tensor_out"), _BOOL_READ),
    **dict.fromkeys(
        _overloads("index_put", "index_put_", "index_put.out", "_index_put_impl_", "_index_put_impl.out"),
        _BOOL_WRITE,
    ),
    **dict.fromkeys(_overloads("repeat_interleave.Tensor", "repeat_interleave.Tensor_out"), _REPEAT),
    **dict.fromkeys(_overloads("equal", "is_nonzero"), _DATA_DEP),
    **dict.fromkeys(_overloads("_to_copy", "_to_copy.out"), _TO_COPY),
    **dict.fromkeys(_overloads("copy_", "copy.out"), _COPY),
}
_VERDICTS: dict[torch._ops.OpOverload, int] = {}


def _verdict(func: torch._ops.OpOverload) -> int:
    verdict = _VERDICTS.get(func)
    if verdict is None:
        verdict = _SPECIAL.get(func)
        if verdict is None:
            tags = getattr(func, "tags", ())
            if torch.Tag.data_dependent_output in tags:
                verdict = _DATA_DEP
            elif torch.Tag.dynamic_output_shape in tags:
                verdict = _DYNAMIC
            else:
                verdict = _OK
        _VERDICTS[func] = verdict
    return verdict


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], pos: int, name: str, default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def check_dispatch(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`CaptureError` if the aten op ``func`` cannot be recorded into a device graph.

    Rejected: ops tagged ``data_dependent_output`` (plus ``equal``, ``is_nonzero``); ops tagged
    ``dynamic_output_shape``, except ``index.Tensor`` without a boolean/uint8 index and
    ``repeat_interleave`` with ``output_size``; ``index_put`` with a boolean mask unless ATen turns it into a
    ``masked_fill_`` (one mask on the tensor's device, a one-element cpu value, no accumulate); device-to-host
    copies (``_to_copy``/``copy_`` from a non-cpu tensor into cpu).
    """
    verdict = _verdict(func)
    if verdict == _OK:
        return
    if verdict == _DATA_DEP:
        raise CaptureError(f"{func} {_HOST_READ_WHY}")
    if verdict == _DYNAMIC:
        raise CaptureError(
            f"{func} cannot be captured: its output shape depends on tensor values, so a graph would have to "
            "read data back to size the output at replay. Use a fixed-shape form instead (torch.where / "
            "masked_fill over the full tensor, nonzero_static, repeat_interleave(..., output_size=N))."
        )
    if verdict == _BOOL_READ:
        if any(_is_mask(i) for i in _arg(args, kwargs, 1, "indices", ())):
            raise CaptureError(
                f"boolean-mask indexing x[mask] ({func}) cannot be captured: the result has one row per True "
                "element, a shape that depends on tensor values. Keep the full shape with "
                "torch.where(mask, x, fill) or x.masked_fill(~mask, fill)."
            )
        return
    if verdict == _BOOL_WRITE:
        indices = [i for i in _arg(args, kwargs, 1, "indices", ()) if i is not None]
        if not any(_is_mask(i) for i in indices):
            return
        target = args[0]
        values = _arg(args, kwargs, 2, "values")
        accumulate = _arg(args, kwargs, 3, "accumulate", False)
        masked_fill = (
            not accumulate
            and len(indices) == 1
            and indices[0].device == target.device
            and isinstance(values, torch.Tensor)
            and values.numel() == 1
            and values.device.type == "cpu"
        )
        if not masked_fill:
            raise CaptureError(
                f"boolean-mask assignment x[mask] = values ({func}) cannot be captured: placing the values "
                "needs nonzero(mask), a data-dependent shape. Assign a scalar (x[mask] = 0.0 becomes "
                "masked_fill_), or use torch.where(mask, values, x) / masked_scatter_."
            )
        return
    if verdict == _REPEAT:
        if kwargs.get("output_size") is None:
            raise CaptureError(
                f"{func} with tensor repeats and no output_size cannot be captured: the output length is the "
                "sum of the repeats, a value on the device. Pass output_size=<static length>."
            )
        return
    if verdict == _TO_COPY:
        src = args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and src.device.type != "cpu":
            raise _to_cpu_error(str(func), src)
        return
    if verdict == _COPY:
        dst, src = args[0], _arg(args, kwargs, 1, "src")
        if isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu":
            raise _to_cpu_error(str(func), src)


class DispatchGuard(TorchDispatchMode):
    """Torch-dispatch mode that applies :func:`check_dispatch` to every aten op and then runs it."""

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_dispatch(func, args, kwargs)
        return func(*args, **kwargs)


@contextmanager
def capture_guards(*, strict_cpu: bool) -> Iterator[None]:
    """Install :class:`HostReadGuard` and :class:`DispatchGuard` for the body; both are removed on exit."""
    with HostReadGuard(strict_cpu=strict_cpu), DispatchGuard():
        yield


# --------------------------------------------------------------------------------------------------------
# Op analysis (cached per OpOverload)
# --------------------------------------------------------------------------------------------------------

_DROPPABLE = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})
_UNINITIALIZED = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)


@dataclass(frozen=True)
class _OpInfo:
    positional: tuple[str, ...]  # argument names that may be passed positionally, in schema order
    writes: tuple[str, ...]  # arguments the op mutates (alias annotation with "!")
    returns_alias: tuple[bool, ...]  # per return: aliases an argument (a view or the mutated tensor)
    skip: bool  # nothing to replay: in-place view (metadata only) or uninitialized memory
    seeded: bool  # random: two runs legitimately differ


_INFOS: dict[torch._ops.OpOverload, _OpInfo] = {}
_OUTS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, tuple[str, ...]] | None] = {}


def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    info = _INFOS.get(func)
    if info is None:
        schema = func._schema
        tags = func.tags
        info = _OpInfo(
            positional=tuple(a.name for a in schema.arguments if not a.kwarg_only),
            writes=tuple(
                a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
            ),
            returns_alias=tuple(r.alias_info is not None for r in schema.returns),
            skip=torch.Tag.inplace_view in tags or func.overloadpacket.__name__ in _UNINITIALIZED,
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


def _scratch(value: Any, *, copy: bool = False) -> Any:
    if isinstance(value, torch.Tensor):
        new = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
        return new.copy_(value) if copy else new
    return [_scratch(v, copy=copy) for v in value]


def _substitute(value: Any, table: Mapping[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return table.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(v, table) for v in value)
    return value


def _agree(probes: list[torch.Tensor], layout: list[tuple[Any, ...]], expected: list[torch.Tensor]) -> bool:
    if layout != [(p.data_ptr(), p.size(), p.stride()) for p in probes]:
        return False
    return all(_same_values(p, e) for p, e in zip(probes, expected, strict=True))


def _layout(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.data_ptr(), t.size(), t.stride()) for t in tensors]


def _out_step(
    func: torch._ops.OpOverload, info: _OpInfo, bound: Mapping[str, Any], results: tuple[Any, ...]
) -> Step | None:
    """A call of ``func``'s out= overload writing into the static results, or None if none agrees.

    Each candidate (the generated binding, then ``_op``) is first run on scratch tensors of the static
    results' layout: it must keep their addresses and strides and, for non-random ops, reproduce the
    functional op's values exactly.
    """
    found = _out_overload(func)
    if found is None:
        return None
    cand, out_names = found
    flat_statics = _tensors_in(results)
    fast = None if info.seeded else _binding(cand.overloadpacket.__name__)
    for fn, binding in ((fast, True), (cand._op, False)):
        if fn is None:
            continue
        probes = [_scratch(r) for r in results]
        parts = _call_parts(
            cand._schema, {**bound, **dict(zip(out_names, probes, strict=True))}, binding=binding
        )
        if parts is None:
            continue
        flat_probes = _tensors_in(probes)
        layout = _layout(flat_probes)
        try:
            fn(*parts[0], **parts[1])
        except Exception:
            continue
        if info.seeded:
            if layout != _layout(flat_probes):
                continue
        elif not _agree(flat_probes, layout, flat_statics):
            continue
        pos, kw = _call_parts(
            cand._schema, {**bound, **dict(zip(out_names, results, strict=True))}, binding=binding
        )  # type: ignore[misc]
        return functools.partial(fn, *pos, **kw)
    return None


def _write_step(
    func: torch._ops.OpOverload,
    info: _OpInfo,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    bound: Mapping[str, Any],
) -> Step:
    """The call that replays an in-place / out= op as recorded: its generated binding when that provably
    writes the same values (checked on copies of the written tensors), else ``func._op``."""
    fallback = functools.partial(func._op, *args, **kwargs)
    fast = None if info.seeded else _binding(func.overloadpacket.__name__)
    if fast is None:
        return fallback
    written = _tensors_in(bound[w] for w in info.writes if w in bound)
    written_sids = {_sid(t) for t in written}
    if not written or len(written_sids) != len(written):
        return fallback
    if any(_sid(t) in written_sids for t in _tensors_in(bound.values()) if all(t is not w for w in written)):
        return fallback  # another argument aliases a written tensor: copies would change the semantics
    ref = {id(t): _scratch(t, copy=True) for t in written}
    trial = {id(t): _scratch(t, copy=True) for t in written}
    parts = _call_parts(func._schema, {k: _substitute(v, trial) for k, v in bound.items()}, binding=True)
    if parts is None:
        return fallback
    trial_tensors = [trial[id(t)] for t in written]
    layout = _layout(trial_tensors)
    try:
        func._op(*_substitute(tuple(args), ref), **{k: _substitute(v, ref) for k, v in kwargs.items()})
        fast(*parts[0], **parts[1])
    except Exception:
        return fallback
    if not _agree(trial_tensors, layout, [ref[id(t)] for t in written]):
        return fallback
    pos, kw = _call_parts(func._schema, bound, binding=True)  # type: ignore[misc]
    return functools.partial(fast, *pos, **kw)


def _listed(step: Step | None) -> list[Step] | None:
    return None if step is None else [step]


_COPY_LIKE = frozenset(_overloads("clone", "_to_copy", "lift_fresh_copy"))
_INPLACE: dict[torch._ops.OpOverload, torch._ops.OpOverload | None] = {}


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


def _direct_steps(
    func: torch._ops.OpOverload, info: _OpInfo, bound: Mapping[str, Any], results: tuple[Any, ...]
) -> list[Step] | None:
    """Steps writing the result straight into the static tensor, or None where that does not apply.

    Copy-like ops (clone, _to_copy): ``static.copy_(self)``. Ops with an in-place twin whose result has
    ``self``'s shape and dtype: ``static.copy_(self)`` then ``static.foo_(...)``. Validated on a scratch
    tensor against the functional result.
    """
    if info.seeded or len(results) != 1 or not isinstance(results[0], torch.Tensor):
        return None
    static = results[0]
    src = bound.get("self")
    if not isinstance(src, torch.Tensor) or src.shape != static.shape:
        return None
    copy = torch._C.TensorBase.copy_
    if func in _COPY_LIKE:

        def make(target: torch.Tensor) -> list[Step]:
            return [functools.partial(copy, target, src)]

    else:
        inplace = _inplace_overload(func)
        if inplace is None or src.dtype != static.dtype:
            return None
        fast = _binding(inplace.overloadpacket.__name__)
        schema = inplace._schema
        fn, parts = None, None
        if fast is not None:
            fn, parts = fast, _call_parts(schema, {**bound, "self": static}, binding=True)
        if parts is None:
            fn, parts = inplace._op, _call_parts(schema, {**bound, "self": static}, binding=False)

        def make(target: torch.Tensor) -> list[Step]:
            pos, kw = _call_parts(schema, {**bound, "self": target}, binding=fn is fast)  # type: ignore[misc]
            return [functools.partial(copy, target, src), functools.partial(fn, *pos, **kw)]

    probe = _scratch(static)
    layout = _layout([probe])
    try:
        for step in make(probe):
            step()
    except Exception:
        return None
    if not _agree([probe], layout, [static]):
        return None
    return make(static)


def _copy_step(call: Step, picks: list[tuple[int, Any]], single: bool) -> Step:
    """Run the op and copy its fresh results into the static ones (no usable out= overload)."""
    if single and isinstance(picks[0][1], torch.Tensor):
        static = picks[0][1]

        def copy_one() -> None:
            static.copy_(call())

        return copy_one

    def copy_all() -> None:
        res = call()
        if single:
            res = (res,)
        for i, static in picks:
            if isinstance(static, torch.Tensor):
                static.copy_(res[i])
            else:
                for s, r in zip(static, res[i], strict=True):
                    s.copy_(r)

    return copy_all


# --------------------------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------------------------


class _Segment:
    """A run of recorded steps: the main recording between tasks, or one task group."""

    __slots__ = ("group", "keep", "kinds", "label", "owned", "steps")

    def __init__(self, group: int | None, label: str = "") -> None:
        self.group = group  # index in Emulator._segments when this is a task group, else None
        self.label = label
        self.steps: list[Step] = []
        self.keep: list[object] = []  # strong refs to every tensor recorded (a graph's private pool)
        self.owned: set[int] = set()  # storages created inside this task group
        self.kinds: Counter[str] = Counter()


_STATE = threading.local()


def _recording() -> bool:
    return getattr(_STATE, "recording", False)


class _Recorder(TorchDispatchMode):
    """Runs each aten op, records how to replay it, and snapshots pre-existing storages it writes."""

    def __init__(self, emulator: Emulator, segment: _Segment, restore: bool) -> None:
        super().__init__()
        self.emulator = emulator
        self.segment = segment
        self._restore = restore
        self._created: set[int] = set()
        self._snapshotted: set[int] = set()
        self._snapshots: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []

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
        inputs = _tensors_in(bound.values())
        if self.emulator._owner:
            self._check_task_outputs(func, inputs)
        if self._restore:
            for name in info.writes:
                for t in _tensors_in((bound.get(name),)):
                    self._snapshot(t)
        result = func(*args, **kwargs)
        self._record(func, info, args, kwargs, bound, inputs, result)
        return result

    def _check_task_outputs(self, func: torch._ops.OpOverload, inputs: list[torch.Tensor]) -> None:
        owner = self.emulator._owner
        for t in inputs:
            group = owner.get(_sid(t))
            if group is not None and group != self.segment.group:
                label = self.emulator._segments[group].label
                raise CaptureError(
                    f"{func} reads a tensor that task {label!r} created inside its task group; when the "
                    "task is re-issued with new host arguments that tensor would go stale. Have the task "
                    "write its results into a preallocated tensor passed among its tensor_args."
                )

    def _snapshot(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        sid = storage._cdata
        if sid in self._created or sid in self._snapshotted:
            return
        self._snapshotted.add(sid)
        if storage.nbytes():
            self._snapshots.append((storage, storage.clone()))

    def restore(self) -> None:
        """Put back every pre-existing storage written during this recording session."""
        for storage, snapshot in reversed(self._snapshots):
            storage.copy_(snapshot)
        self._snapshots.clear()

    def _record(
        self,
        func: torch._ops.OpOverload,
        info: _OpInfo,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        bound: Mapping[str, Any],
        inputs: list[torch.Tensor],
        result: Any,
    ) -> None:
        seg = self.segment
        seg.keep.append((args, kwargs, result))
        single = len(info.returns_alias) == 1
        results: tuple[Any, ...] = (result,) if single else tuple(result or ())
        in_storages: set[int] | None = None
        fresh: list[int] = []
        for i, value in enumerate(results):
            tensors = _tensors_in((value,))
            if not tensors:
                continue
            if in_storages is None:
                in_storages = {_sid(t) for t in inputs}
            sids = [_sid(t) for t in tensors]
            # A result that shares an input's storage is a view (or the mutated input, or an unannotated
            # alias such as _unsafe_view): the static result already aliases the static input. Anything
            # else is new memory whatever the schema says (a view-or-copy op that copied).
            if any(s in in_storages for s in sids):
                continue
            fresh.append(i)
            self._created.update(sids)
            if seg.group is not None:
                seg.owned.update(sids)
                self.emulator._owner.update(dict.fromkeys(sids, seg.group))

        steps: list[Step] | None = None
        kind = "skipped"
        if info.skip:
            pass
        elif not fresh:
            # In-place / out= ops, and ops with side effects only (no returns), run as recorded; pure
            # views are skipped: the static view already aliases the static base.
            if info.writes or not info.returns_alias:
                steps, kind = [_write_step(func, info, args, kwargs, bound)], "as_recorded"
        else:
            if not info.writes and len(fresh) == len(results):
                # Preference: a native out= kernel; copy_ / copy_ + in-place op (an autogenerated out=
                # overload computes the functional result and copies it: an extra pass and allocation).
                found = _out_overload(func)
                generated = found is not None and torch.Tag.generated in found[0].tags
                if found is not None and not generated:
                    steps, kind = _listed(_out_step(func, info, bound, results)), "out"
                if steps is None:
                    steps, kind = _direct_steps(func, info, bound, results), "direct"
                if steps is None and generated:
                    steps, kind = _listed(_out_step(func, info, bound, results)), "out"
            if steps is None:
                picks = [(i, results[i]) for i in fresh]
                steps = [_copy_step(functools.partial(func._op, *args, **kwargs), picks, single)]
                kind = "copy"
        seg.kinds[kind] += 1
        if steps:
            seg.steps.extend(steps)


# --------------------------------------------------------------------------------------------------------
# Emulator
# --------------------------------------------------------------------------------------------------------


class Emulator:
    """A recording of aten ops that replays like a device graph (see the module docstring).

    Invariants: ``captured`` is true only after a capture ended without an exception; a failed capture or
    task update leaves no mode installed, restores every pre-existing tensor it wrote and keeps the previous
    state. Replay runs under ``torch.inference_mode()`` (so tensors captured under inference mode, as vLLM
    does, can be rewritten; autograd never records replay).

    ``restore_inputs=False`` skips the snapshot/restore of pre-existing tensors written during capture
    (faster for very large written tensors, e.g. a KV cache; capture then applies its writes once).
    """

    def __init__(self, *, restore_inputs: bool = True) -> None:
        self._restore = restore_inputs
        self._segments: list[_Segment] = []
        self._flat: tuple[Step, ...] = ()
        self._captured = False
        self._recorder: _Recorder | None = None
        self._owner: dict[int, int] = {}  # storage id -> index of the task group that created it

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
        return len(self._flat)

    @property
    def stats(self) -> dict[str, int]:
        """Recorded ops by replay strategy: ``out`` (out= overload into the static result), ``as_recorded``
        (in-place / out= op), ``copy`` (functional op plus a copy into the static result), ``skipped``."""
        total: Counter[str] = Counter()
        for seg in self._segments:
            total.update(seg.kinds)
        return dict(total)

    def reset(self) -> None:
        """Drop the recording; the emulator can capture again."""
        if self.capturing:
            raise CaptureError("Emulator.reset() inside capture(); leave the capture block first")
        self._segments = []
        self._flat = ()
        self._owner = {}
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
                self._flatten()
                self._captured = True
            else:
                self._segments = []
                self._owner = {}

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
        try:
            with HostReadGuard(strict_cpu=True), recorder:
                run()
        finally:
            _STATE.recording = False
            recorder.restore()
        for sid in old.owned - seg.owned:
            self._owner.pop(sid, None)
        self._segments[group] = seg
        self._flatten()

    def _flatten(self) -> None:
        self._flat = tuple(step for seg in self._segments for step in seg.steps)

    def replay(self) -> None:
        """Run the recorded ops once, in order, on the recorded tensors."""
        if not self._captured:
            raise CaptureError("replay() before a completed capture")
        with torch.inference_mode():
            for step in self._flat:
                step()

"""Op analysis for the emulator: schema facts per aten op (cached), argument binding, and the generated
Python bindings that provably dispatch a recorded call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphbuf.graphs.modes import DispatchMode

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
class OpInfo:
    positional: tuple[str, ...]  # argument names that may be passed positionally, in schema order
    writes: tuple[str, ...]  # arguments the op mutates (alias annotation with "!")
    returns_alias: tuple[bool, ...]  # per return: aliases an argument (a view or the mutated tensor)
    inplace_view: bool  # changes a tensor's metadata only (t_, squeeze_, as_strided_, ...)
    uninitialized: bool  # allocates without writing (empty, empty_like, ...)
    restrides: bool  # may change a written tensor's metadata: an out= argument or resize_/set_
    seeded: bool  # random: two runs legitimately differ
    tensors_out: bool  # every return is a Tensor (not a list, scalar or optional)


_INFOS: dict[torch._ops.OpOverload, OpInfo] = {}
_OUTS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, tuple[str, ...]] | None] = {}


def op_info(func: torch._ops.OpOverload) -> OpInfo:
    info = _INFOS.get(func)
    if info is None:
        schema = func._schema
        tags = func.tags
        name = func.overloadpacket.__name__
        info = OpInfo(
            positional=tuple(a.name for a in schema.arguments if not a.kwarg_only),
            writes=tuple(
                a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
            ),
            returns_alias=tuple(r.alias_info is not None for r in schema.returns),
            inplace_view=torch.Tag.inplace_view in tags,
            uninitialized=name in _UNINITIALIZED,
            restrides=name in _RESTRIDING or any(a.is_out for a in schema.arguments),
            seeded=torch.Tag.nondeterministic_seeded in tags,
            tensors_out=bool(schema.returns) and all(str(r.type) == "Tensor" for r in schema.returns),
        )
        _INFOS[func] = info
    return info


def out_overload(func: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, tuple[str, ...]] | None:
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


def is_composite(func: torch._ops.OpOverload) -> bool:
    composite = _COMPOSITE.get(func)
    if composite is None:
        composite = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _CIA)
    return composite


def bind(info: OpInfo, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = dict(zip(info.positional, args, strict=False))
    bound.update(kwargs)
    return bound


def tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
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


def binding(name: str) -> Callable[..., Any] | None:
    """The generated Python binding of aten op ``name`` (``torch.<name>`` or ``Tensor.<name>``), if any.

    It is a faster call path than ``OpOverload._op``; every use is validated against ``_op`` first.
    """
    for ns in _NAMESPACES:
        fn = getattr(ns, name, None)
        if fn is not None:
            return fn
    return None


def call_parts(
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


def scratch(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    return [scratch(v) for v in value]


def agree(probes: list[torch.Tensor], layout: list[tuple[Any, ...]], expected: list[torch.Tensor]) -> bool:
    if layout != tensor_layout(probes) or len(probes) != len(expected):
        return False
    return all(_same_values(p, e) for p, e in zip(probes, expected, strict=True))


def tensor_layout(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.data_ptr(), t.size(), t.stride()) for t in tensors]


def nbytes(values: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(values))


def tensor_geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (_sid(t), t.size(), t.stride(), t.storage_offset())


def contiguous(size: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


# --------------------------------------------------------------------------------------------------------
# Generated bindings: used only where they provably dispatch the recorded call
# --------------------------------------------------------------------------------------------------------


class _ProbeHit(Exception):
    """Stops a probed call at its first dispatched op, before any kernel runs."""


class _Probe(DispatchMode):
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


def uses_binding(
    func: torch._ops.OpOverload,
    info: OpInfo,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    bound: Mapping[str, Any],
) -> bool:
    """True if ``func``'s generated binding, called with ``bound`` laid out by :func:`call_parts`,
    dispatches exactly ``func(*args, **kwargs)``. Checked once per argument type signature by calling the
    binding under a mode that stops it at its first op (nothing runs); random ops always use ``_op``."""
    if info.seeded:
        return False
    fast = binding(func.overloadpacket.__name__)
    if fast is None:
        return False
    parts = call_parts(func._schema, bound, binding=True)
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


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def shaped_like_result(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], device: torch.device
) -> Any:
    """What ``func(*args, **kwargs)`` returns, uninitialized: the results' sizes, strides and dtypes from
    the op's meta kernel, nothing computed (NotImplementedError where the op has no meta kernel)."""
    out = func(*_meta(list(args)), **{k: _meta(v) for k, v in kwargs.items()})
    if isinstance(out, torch.Tensor):
        return torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=device)
    return tuple(torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device) for t in out)

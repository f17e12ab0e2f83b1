"""Capture guards: what no device graph can record raises :class:`~graphbuf.errors.CaptureError`.

:class:`HostReadGuard` (a torch-function mode) rejects host read-back during capture: ``.item()``,
``.tolist()``, ``.numpy()``, ``bool(t)``, copies to the host, formatting (``print``, ``str``, ``repr``,
``format``), and tensors built from host data (``torch.tensor`` / ``as_tensor`` / ``asarray`` of lists or
numpy). :class:`DispatchGuard` (a dispatch mode) rejects ops whose output shape depends on
tensor values (``nonzero``, ``x[mask]``, ``unique``, ...) and host-to-device copies of host tensors, and
records the tensors from before capture that the captured work uses.
:class:`graphbuf.Graph` installs both around every capture (cpu, cuda, npu); the cpu emulator's recorder
applies :func:`check_dispatch` op by op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphbuf.errors import CaptureError
from graphbuf.graphs.modes import DispatchMode

__all__ = ["DispatchGuard", "HostReadGuard", "capture_guards", "check_dispatch", "op_overloads", "poison"]


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
_FORMATS: dict[object, str] = {
    _T.__repr__: "repr(tensor) / print(tensor)",
    _T.__str__: "str(tensor) / print(tensor)",
    _T.__format__: "format(tensor) / an f-string of a tensor",
}
_FROM_HOST: dict[object, str] = {
    torch.tensor: "torch.tensor(host data)",
    torch.as_tensor: "torch.as_tensor(host data)",
    torch.asarray: "torch.asarray(host data)",
}
_FROM_HOST_WHY = (
    "builds a tensor from host data during graph capture; on a device that is a host-to-device copy whose "
    "source a graph cannot re-read at replay (a real capture fails or bakes a stale value). Build the "
    "tensor before capture and refresh it in place, or pass the values as host arguments of a task."
)
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
        try:
            fmt = _FORMATS.get(func)
            made = _FROM_HOST.get(func)
        except TypeError:
            fmt = made = None
        if fmt is not None:
            raise CaptureError(
                f"{fmt} formats tensor values during graph capture, a blocking device-to-host read a graph "
                "cannot record (and would print capture-time values once, never at replay). Print after "
                "replay(), or print shapes (tensor.shape) instead."
            )
        from_tensor = bool(args) and isinstance(args[0], torch.Tensor)
        if made is not None and not from_tensor:
            raise CaptureError(f"{made} {_FROM_HOST_WHY}")
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


def op_overloads(*names: str) -> list[torch._ops.OpOverload]:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return found


_SPECIAL: dict[torch._ops.OpOverload, int] = {
    **dict.fromkeys(op_overloads("index.Tensor", "index.Tensor_out"), _BOOL_READ),
    **dict.fromkeys(
        op_overloads("index_put", "index_put_", "index_put.out", "_index_put_impl_", "_index_put_impl.out"),
        _BOOL_WRITE,
    ),
    **dict.fromkeys(op_overloads("repeat_interleave.Tensor", "repeat_interleave.Tensor_out"), _REPEAT),
    **dict.fromkeys(op_overloads("equal", "is_nonzero"), _DATA_DEP),
    **dict.fromkeys(op_overloads("_to_copy", "_to_copy.out"), _TO_COPY),
    **dict.fromkeys(op_overloads("copy_", "copy.out"), _COPY),
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
        host_src = isinstance(src, torch.Tensor) and src.device.type == "cpu" and src.dim() > 0
        if host_src and dst.device.type != "cpu":  # 0-d cpu tensors are ATen's wrapped scalars
            raise CaptureError(
                f"{func} copies a host tensor of shape {tuple(src.shape)} into a {dst.device.type} tensor "
                f"during graph capture; {_FROM_HOST_WHY}"
            )


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


class DispatchGuard(DispatchMode):
    """Torch-dispatch mode that applies :func:`check_dispatch` to every aten op and then runs it.

    ``inputs``: every tensor an op received that no op under this guard produced (the tensors from before
    capture the recorded work uses), in first-use order. ``produced``: weak references to the tensors the
    ops returned (those still alive after capture are the graph's static outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []
        self.produced: list[weakref.ref[torch.Tensor]] = []
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_dispatch(func, args, kwargs)
        seen = self._seen
        for t in _tensors((*args, *kwargs.values())):
            ref = seen.get(id(t))
            if ref is None or ref() is not t:
                seen[id(t)] = weakref.ref(t)
                self.inputs.append(t)
        out = func(*args, **kwargs)
        for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
            ref = seen.get(id(t))
            if ref is None or ref() is not t:  # an op's own argument returned (in-place) stays an input
                seen[id(t)] = ref = weakref.ref(t)
                self.produced.append(ref)
        return out


def poison(tensors: Iterable[torch.Tensor]) -> None:
    """Fill each tensor with the value an uninitialized device buffer stands for: NaN for floating and
    complex dtypes, the minimum for integers, True for bool (what a graph's outputs hold between capture
    and the first replay: a device capture runs no kernel)."""
    with torch.no_grad():
        for t in tensors:
            dtype = t.dtype
            if dtype.is_floating_point or dtype.is_complex:
                value: float | int | bool = float("nan")
            elif dtype == torch.bool:
                value = True
            else:
                try:
                    value = torch.iinfo(dtype).min
                except TypeError:  # quantized and other exotic dtypes: left as they are
                    continue
            t.detach().fill_(value)


@contextmanager
def capture_guards(*, strict_cpu: bool) -> Iterator[DispatchGuard]:
    """Install :class:`HostReadGuard` and :class:`DispatchGuard` for the body; both are removed on exit.
    Yields the dispatch guard (its ``inputs`` are the tensors from before capture the body used)."""
    with HostReadGuard(strict_cpu=strict_cpu), DispatchGuard() as guard:
        yield guard

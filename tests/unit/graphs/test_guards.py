"""``graphbuf/graphs/guards.py``: what no device graph can record raises ``CaptureError`` while the guards
are installed, and nothing else does; ``poison`` fills outputs with the value of uninitialized memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbuf import CaptureError
from graphbuf.graphs.guards import DispatchGuard, HostReadGuard, capture_guards, check_dispatch, poison

_aten = torch.ops.aten


@pytest.mark.parametrize(
    ("read", "named"),
    [
        (lambda t: t.item(), r"Tensor\.item\(\)"),
        (lambda t: t.tolist(), r"Tensor\.tolist\(\)"),
        (lambda t: t.numpy(), r"Tensor\.numpy\(\)"),
        (lambda t: bool(t), r"bool\(tensor\)"),
        (lambda t: int(t), r"int\(tensor\)"),
        (lambda t: float(t), r"float\(tensor\)"),
        (lambda t: [0, 1, 2][t], r"__index__"),
        (lambda t: np.asarray(t), r"__array__"),
        (lambda t: repr(t), r"repr\(tensor\)"),
        (lambda t: str(t), r"print\(tensor\) formats"),
        (lambda t: f"{t}", r"format\(tensor\)"),
        (lambda t: torch.tensor([1, 2]), r"torch\.tensor\(host data\)"),
        (lambda t: torch.as_tensor(np.zeros(2)), r"torch\.as_tensor\(host data\)"),
        (lambda t: torch.asarray([1.0]), r"torch\.asarray\(host data\)"),
    ],
)
def test_host_reads_during_capture_are_refused_by_name(read, named) -> None:
    t = torch.ones((), dtype=torch.int64)
    with HostReadGuard(strict_cpu=False), pytest.raises(CaptureError, match=named):
        read(t)


def test_device_code_passes_the_host_read_guard() -> None:
    t = torch.arange(4.0)
    with HostReadGuard(strict_cpu=True):
        out = torch.where(t > 1, t, torch.zeros_like(t)) * 2
        moved = t.to(torch.device("cpu"))  # a torch.device target moves nothing on the emulator
        like = t.to(out)  # a tensor target, likewise
        shaped = torch.as_tensor(t)  # built from a tensor, not from host data
    assert out.tolist() == [0.0, 0.0, 4.0, 6.0] and moved is t and like is t and shaped.shape == (4,)


def test_strict_cpu_refuses_the_host_copies_a_device_would_make() -> None:
    """On the emulator cpu stands for the device: ``cpu()`` and ``to("cpu")`` ask for the host."""
    t = torch.zeros(2, 3)
    with HostReadGuard(strict_cpu=True):
        emulated = r"^Tensor\.cpu\(\) copies an emulated-device \(cpu\) tensor of shape \(2, 3\)"
        with pytest.raises(CaptureError, match=emulated):
            t.cpu()
        with pytest.raises(CaptureError, match=r"^Tensor\.to\('cpu'\) copies"):
            t.to("cpu")
    with HostReadGuard(strict_cpu=False):  # on a real device a cpu tensor's cpu() moves nothing
        assert t.cpu() is t and t.to("cpu") is t


def test_the_guards_leave_nothing_installed_after_the_body() -> None:
    with capture_guards(strict_cpu=True) as guard:
        assert isinstance(guard, DispatchGuard)
    assert torch.ones(()).item() == 1.0


@pytest.mark.parametrize(
    ("op", "match"),
    [
        (lambda x: torch.nonzero(x), "output shape depends on tensor values"),
        (lambda x: torch.unique(x), "output shape depends on tensor values"),
        (lambda x: x[x > 0], r"boolean-mask indexing x\[mask\]"),
        (lambda x: x.__setitem__(x > 0, torch.ones(4)[:1].expand(2)), r"boolean-mask assignment"),
        (lambda x: torch.repeat_interleave(x, torch.ones(4, dtype=torch.int64)), "no output_size"),
        (lambda x: torch.equal(x, x), "reads tensor data back to the host"),
    ],
)
def test_value_dependent_shapes_are_refused_at_dispatch(op, match) -> None:
    x = torch.tensor([1.0, -1.0, 2.0, 0.0])
    with DispatchGuard(), pytest.raises(CaptureError, match=match):
        op(x)


def test_fixed_shape_forms_pass_at_dispatch() -> None:
    x = torch.tensor([1.0, -1.0, 2.0, 0.0])
    with DispatchGuard():
        x[x < 0] = 0.0  # a scalar: ATen makes it masked_fill_
        picked = x[torch.tensor([0, 2])]  # an integer index has a static shape
        rep = torch.repeat_interleave(x, torch.ones(4, dtype=torch.int64), output_size=4)
    assert x.tolist() == [1.0, 0.0, 2.0, 0.0] and picked.tolist() == [1.0, 2.0] and rep.shape == (4,)


def test_the_dispatch_guard_records_inputs_once_and_outputs_apart() -> None:
    a, b = torch.ones(3), torch.full((3,), 2.0)
    with DispatchGuard() as guard:
        c = a + b
        d = c * a
        a.add_(1)  # in place: a stays an input, not an output
    assert [id(t) for t in guard.inputs] == [id(a), id(b)]
    produced = [r() for r in guard.produced]
    assert any(t is c for t in produced) and any(t is d for t in produced)
    assert not any(t is a for t in produced)


def test_check_dispatch_refuses_a_host_tensor_copied_into_a_device_tensor() -> None:
    """A device-to-host or host-to-device copy is judged by the tensors' devices, not by the op's name
    (the meta device stands for an accelerator here: no data is touched)."""
    dev, host = torch.empty(4, device="meta"), torch.zeros(4)
    with pytest.raises(CaptureError, match=r"copies a host tensor of shape \(4,\) into a meta tensor"):
        check_dispatch(_aten.copy_.default, (dev, host), {})
    with pytest.raises(CaptureError, match=r"copies a meta tensor of shape \(4,\) to the host"):
        check_dispatch(_aten.copy_.default, (host, dev), {})
    with pytest.raises(CaptureError, match="to the host"):
        check_dispatch(_aten._to_copy.default, (dev,), {"device": torch.device("cpu")})
    check_dispatch(_aten.copy_.default, (dev, torch.tensor(1.0)), {})  # 0-d: ATen's wrapped scalar
    check_dispatch(_aten.copy_.default, (host, torch.ones(4)), {})  # host to host: the emulator's device


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, float("nan")),
        (torch.bfloat16, float("nan")),
        (torch.complex64, complex("nan+nanj")),
        (torch.int32, -(2**31)),
        (torch.int64, -(2**63)),
        (torch.uint8, 0),
        (torch.bool, True),
    ],
)
def test_poison_fills_what_uninitialized_memory_stands_for(dtype, value) -> None:
    t = torch.zeros(3, dtype=dtype)
    poison([t])
    if dtype.is_floating_point or dtype.is_complex:
        assert torch.isnan(t).all()
    else:
        assert t.tolist() == [value] * 3


def test_poison_writes_through_a_tensor_that_requires_grad() -> None:
    t = torch.zeros(2, requires_grad=True)
    poison([t])
    assert torch.isnan(t.detach()).all()

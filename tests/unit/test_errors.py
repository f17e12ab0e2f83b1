"""``graphbuf/errors.py``: one base class for everything graphbuf raises, and each error also the built-in
kind a caller already catches (a bad value is a ``ValueError``, a device-side failure a ``RuntimeError``)."""

from __future__ import annotations

import pytest

import graphbuf
from graphbuf import errors

KINDS = {
    "SpecError": (ValueError,),
    "UsageError": (ValueError,),
    "BatchFileError": (errors.UsageError,),
    "PlanTooLargeError": (errors.SpecError,),
    "RefreshError": (ValueError,),
    "RowsError": (errors.RefreshError,),
    "WidthError": (errors.RefreshError,),
    "CaptureError": (RuntimeError,),
    "AddressChangedError": (RuntimeError,),
    "ReplayError": (RuntimeError,),
    "DeviceUnavailableError": (RuntimeError,),
    "UnknownDeviceError": (ValueError,),
    "LivenessError": (RuntimeError,),
    "ConcurrentUseError": (RuntimeError,),
    "TaskError": (errors.CaptureError, ValueError),
    "ArgumentError": (TypeError,),
}


def test_every_error_is_listed_and_exported_from_graphbuf() -> None:
    declared = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    assert declared - {"GraphbufError"} <= set(KINDS) | {"ExprError"}
    assert set(errors.__all__) == declared
    for name in errors.__all__:
        assert getattr(graphbuf, name) is getattr(errors, name), name


@pytest.mark.parametrize(("name", "bases"), sorted(KINDS.items()))
def test_each_error_is_a_graphbuf_error_and_its_builtin_kind(name: str, bases: tuple[type, ...]) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.GraphbufError) and cls.__doc__
    for base in bases:
        assert issubclass(cls, base), (name, base)
    with pytest.raises(errors.GraphbufError, match=r"^what, where, allowed$"):
        raise cls("what, where, allowed")

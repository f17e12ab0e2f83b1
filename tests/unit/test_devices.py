"""``graphbuf/devices.py``: one rule for every object that takes a device name."""

from __future__ import annotations

import sys

import pytest
import torch

from graphbuf import DeviceUnavailableError, UnknownDeviceError
from graphbuf.devices import DEVICE_TYPES, resolve_device


@pytest.mark.parametrize("name", ["cpu", " cpu ", torch.device("cpu")])
def test_cpu_resolves_everywhere(name: object) -> None:
    assert resolve_device(name, "Graph") == torch.device("cpu")


@pytest.mark.parametrize(
    "name", ["gpu", "cuda:", "cuda:x", "cuda:-1", "npu:1:2", "CPU", "", None, 0, 1.5, ["cpu"]]
)
def test_unknown_names_list_what_is_allowed(name: object) -> None:
    with pytest.raises(UnknownDeviceError) as err:
        resolve_device(name, "Graph(x)")
    assert str(err.value) == f"Graph(x): unknown device {name!r}; allowed: cpu, cuda[:N], npu[:N]"


def test_an_unknown_torch_device_type_is_refused_by_name() -> None:
    with pytest.raises(UnknownDeviceError, match=r"^StaticBuffers: unknown device device\(type='meta'\)"):
        resolve_device(torch.device("meta"), "StaticBuffers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", torch.device("cuda", 3)])
def test_a_missing_cuda_device_is_unavailable_with_the_count(name: object) -> None:
    none = r"^Graph\('cuda'\): this machine has 0 CUDA device\(s\)$"
    with pytest.raises(DeviceUnavailableError, match=none):
        resolve_device(name, "Graph('cuda')")


@pytest.mark.parametrize("exc", [ImportError("no torch_npu"), OSError("libascendcl"), RuntimeError("CANN")])
def test_npu_without_torch_npu_says_what_failed(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    """Every way importing torch_npu fails without Ascend CANN is a DeviceUnavailableError."""

    class Failing:
        def find_spec(self, name: str, *a: object) -> None:
            if name == "torch_npu":
                raise exc
            return None

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Failing(), *sys.meta_path])
    needs = r"^Graph\('npu'\) needs torch_npu and an Ascend NPU; importing torch_npu failed: "
    with pytest.raises(DeviceUnavailableError, match=needs + type(exc).__name__):
        resolve_device("npu", "Graph('npu')")


def test_the_known_device_types() -> None:
    assert DEVICE_TYPES == ("cpu", "cuda", "npu")


def test_an_accelerator_without_an_index_resolves_to_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tensor made on "cuda" is on cuda:<current>; a device without its index would not compare equal
    # to it (seen on an H200: "source is on cuda:0; allowed: host memory or cuda").
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda", "t") == torch.device("cuda", 1)
    assert resolve_device("cuda:0", "t") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda"), "t") == torch.device("cuda", 1)

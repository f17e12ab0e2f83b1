"""What a device graph does, the emulator does too (issue 11 §1, §2): each property is written once and run on
every device present (cpu always; cuda where there is one, skipped without), with the same expected outcome.

- a captured input rebound (``set_``), resized or restrided → the next replay raises AddressChangedError
  naming it (a device graph would read the old address);
- a captured input freed → LivenessError (the graph holds tensors from before capture weakly);
- inside capture, a tensor built from host data, a copy from a host tensor, and formatting a tensor →
  CaptureError naming the op;
- between capture and the first replay, outputs hold poison (NaN / the integer minimum), not values;
- torch.compile'd callables (backends eager and aot_eager) capture and replay under the guards;
- a runner checks every tensor its graph uses (task arguments, tensors it does not own) before any refresh
  byte is written.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import pytest
import torch
from paged_spec import PAGED_SPEC as SPEC

import graphbuf
from graphbuf import AddressChangedError, CaptureError, Graph, GraphRunner, LivenessError, Step

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, _NO_CUDA])]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ moved inputs


def _set_new_storage(x: torch.Tensor) -> None:
    x.set_(torch.zeros_like(x))


def _resize(x: torch.Tensor) -> None:
    x.resize_(2, 4)


def _restride(x: torch.Tensor) -> None:
    x.t_()  # square: same address and shape, other strides


@pytest.mark.parametrize("move", [_set_new_storage, _resize, _restride], ids=["set_", "resize_", "t_"])
@pytest.mark.parametrize("device", DEVICES)
def test_moved_input_makes_replay_raise(device: str, move: Callable[[torch.Tensor], None]) -> None:
    x = torch.ones(4, 4, device=device)
    g = Graph(device)
    with g.capture():
        y = x * 2
    g.replay()
    _sync(device)
    assert torch.equal(y, torch.full((4, 4), 2.0, device=device))
    move(x)
    for _ in range(2):  # every replay, not once
        with pytest.raises(AddressChangedError, match=r"replay: capture input #0 \(float32 \[4, 4\]\) moved"):
            g.replay()


@pytest.mark.parametrize("device", DEVICES)
def test_freed_input_is_a_liveness_error(device: str) -> None:
    def make() -> tuple[Graph, torch.Tensor, torch.Tensor]:
        x = torch.ones(8, device=device)
        g = Graph(device)
        with g.capture():
            y = x + 1
        return g, y, x

    g, _y, x = make()
    g.replay()
    del x
    gc.collect()
    with pytest.raises(LivenessError, match=r"capture input #0 \(float32 \[8\]\) .*was freed after capture"):
        g.replay()


@pytest.mark.parametrize("device", DEVICES)
def test_task_tensor_argument_is_named_when_it_moves(device: str) -> None:
    src = torch.arange(4.0, device=device)
    out = torch.zeros(4, device=device)

    def double(a: torch.Tensor, b: torch.Tensor) -> None:
        b.copy_(a * 2)

    g = Graph(device)
    with g.capture():
        g.task("custom", double, src, out)
    g.replay()
    out.set_(torch.zeros(4, device=device))
    with pytest.raises(AddressChangedError, match=r"task 'custom' #0 tensor_args\[1\] moved"):
        g.replay()


# ---------------------------------------------------------------------------------- host data inside


_TENSOR, _AS_TENSOR = r"torch\.tensor\(host data\)", r"torch\.as_tensor\(host data\)"
HOST_OPS: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "torch.tensor(list)": (lambda x: torch.tensor([1.0, 2.0], device=x.device), _TENSOR),
    "torch.tensor(scalar)": (lambda x: x * torch.tensor(2.0, device=x.device), _TENSOR),
    "as_tensor(list)": (lambda x: torch.as_tensor([1, 2], device=x.device), _AS_TENSOR),
    "as_tensor(numpy)": (lambda x: torch.as_tensor(np.ones(3), device=x.device), _AS_TENSOR),
    "print": (lambda x: print(x), r"print\(tensor\)"),
    "str": (lambda x: str(x), r"str\(tensor\)|repr\(tensor\)"),
    "repr": (lambda x: repr(x), r"repr\(tensor\)"),
    "format": (lambda x: format(x), r"format\(tensor\)"),
    "f-string": (lambda x: f"{x}", r"f-string"),
    "tolist": (lambda x: x.tolist(), r"Tensor\.tolist\(\)"),
    "item": (lambda x: x.sum().item(), r"item"),
}


@pytest.mark.parametrize("op", sorted(HOST_OPS))
@pytest.mark.parametrize("device", DEVICES)
def test_host_data_and_formatting_inside_capture_raise(device: str, op: str) -> None:
    body, match = HOST_OPS[op]
    x = torch.ones(3, device=device)
    g = Graph(device)
    with pytest.raises(CaptureError, match=match), g.capture():
        body(x)
    assert not g.captured
    with g.capture():  # the graph is left re-capturable
        y = x * 3
    g.replay()
    _sync(device)
    assert torch.equal(y, torch.full((3,), 3.0, device=device))


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu",
            marks=pytest.mark.skip(
                reason="on the emulator cpu tensors stand for device tensors: a host tensor cannot be told "
                "apart (torch.tensor / as_tensor of host data are rejected where it is built)"
            ),
        ),
        pytest.param("cuda", marks=[pytest.mark.cuda, _NO_CUDA]),
    ],
)
def test_copy_from_a_host_tensor_inside_capture_raises(device: str) -> None:
    host = torch.arange(3.0)
    x = torch.zeros(3, device=device)
    with pytest.raises(CaptureError, match="copies a host tensor"), Graph(device).capture():
        x.copy_(host)


# --------------------------------------------------------------------------------------------- poison


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_hold_poison_until_the_first_replay(device: str) -> None:
    x = torch.arange(4.0, device=device)
    n = torch.arange(4, dtype=torch.int32, device=device)
    g = Graph(device)
    with g.capture():
        y = x * 2
        m = n + 1
    _sync(device)
    assert torch.isnan(y).all(), "a float output holds values before any replay"
    assert (m == torch.iinfo(torch.int32).min).all(), "an int output holds values before any replay"
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]  # inputs are untouched
    g.replay()
    _sync(device)
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0] and m.tolist() == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_captures_and_replays(device: str, backend: str) -> None:
    torch._dynamo.reset()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w) + 1

    compiled = torch.compile(f, backend=backend)
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, 8, device=device)
    compiled(x, w)  # warm-up outside capture (cuda graphs need it; Dynamo compiles here)
    g = Graph(device)
    with g.capture():
        y = compiled(x, w)
    for seed in range(2):
        x.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(device))
        g.replay()
        _sync(device)
        torch.testing.assert_close(y, f(x, w))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_compiling_inside_capture(device: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 3).sin(), backend="aot_eager")
    x = torch.randn(16, device=device)
    if device != "cpu":
        compiled(x)  # a device graph needs its kernels warmed up first
    g = Graph(device)
    with g.capture():
        y = compiled(x)
    x.add_(1)
    g.replay()
    _sync(device)
    torch.testing.assert_close(y, (x * 3).sin())


# ----------------------------------------------------------------------------- runner: watched tensors


def _runner_with_cache(device: str) -> tuple[GraphRunner, graphbuf.StaticBuffers, dict[str, torch.Tensor]]:
    bufs = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC), device)
    state = {"kv": torch.ones(16, 4, device=device)}  # a KV cache: not graphbuf's

    def fn(step: Step) -> torch.Tensor:
        kv = state["kv"]
        return kv[step.views["block_table"][:, 0].long()].sum(1) + step.views["seq_lens"].float()

    runner = GraphRunner(bufs, fn, output_rows="requests")
    runner.capture()
    return runner, bufs, state


def _batch(n: int, device: str) -> dict[str, torch.Tensor]:
    return {
        "block_table": torch.arange(n * 5, dtype=torch.int32).reshape(n, 5) % 16,
        "seq_lens": torch.full((n,), 3, dtype=torch.int32),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_runner_catches_a_moved_kv_cache_before_refreshing(device: str) -> None:
    runner, bufs, state = _runner_with_cache(device)
    torch.testing.assert_close(runner.run(_batch(3, device)).cpu(), torch.full((3,), 7.0))
    state["kv"].resize_(32, 4)  # grown in place: a new allocation
    slab = bufs.slab.cpu().numpy().tobytes()
    with pytest.raises(AddressChangedError, match=r"capture input #\d+ \(float32 \[16, 4\]\) moved"):
        runner.run(_batch(3, device))
    assert bufs.slab.cpu().numpy().tobytes() == slab, "the refresh wrote before the check"


@pytest.mark.parametrize("device", DEVICES)
def test_runner_catches_a_freed_kv_cache(device: str) -> None:
    runner, bufs, state = _runner_with_cache(device)
    runner.run(_batch(3, device))
    state["kv"] = torch.ones(16, 4, device=device)  # the captured cache is dropped, a new one bound
    gc.collect()
    slab = bufs.slab.cpu().numpy().tobytes()
    with pytest.raises(LivenessError, match=r"\(float32 \[16, 4\]\) .*was freed"):
        runner.run(_batch(3, device))
    assert bufs.slab.cpu().numpy().tobytes() == slab

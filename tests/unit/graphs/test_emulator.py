"""Graph("cpu"): the emulator behaves like a device graph (capture once, replay on fixed tensors)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import graphbuf.graphs.emulator.recording as recording
import graphbuf.graphs.emulator.replay as replay_module
from graphbuf.errors import CaptureError, DeviceUnavailableError, LivenessError
from graphbuf.graphs.emulator import Emulator
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.guards import capture_guards

REPEATS = torch.tensor([1, 2, 0, 1])  # built before any capture (host data is rejected inside)


def _no_modes_left() -> bool:
    return not _get_current_function_mode_stack() and not _get_current_dispatch_mode_stack()


# ---- (a)-(g) ------------------------------------------------------------------------------------------


def test_a_inplace_update_of_captured_input_is_seen() -> None:
    x = torch.arange(4.0)
    g = Graph("cpu")
    with g.capture():
        y = x * 2 + 1
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    g.replay()
    assert torch.equal(y, torch.tensor([21.0, 41.0, 61.0, 81.0]))


def test_b_rebound_python_name_is_not_seen() -> None:
    scope = {"x": torch.ones(3)}
    g = Graph("cpu")
    with g.capture():
        y = scope["x"] * 5
    kept = scope["x"]
    scope["x"] = torch.full((3,), 7.0)  # a new tensor under the old name: the graph keeps the old one
    g.replay()
    assert torch.equal(y, torch.full((3,), 5.0)) and kept.sum() == 3
    del kept  # now the captured tensor is freed: a device graph would read released memory
    with pytest.raises(LivenessError, match=r"capture input #0 \(float32 \[3\]\) .* was freed"):
        g.replay()


def test_c_python_scalars_and_host_lists_are_baked() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    scale = 3.0
    cols = [0, 2]
    weights = [1.0, 10.0, 100.0]
    g = Graph("cpu")
    with g.capture():
        y = x[:, cols] * scale
    scale = 100.0
    cols[0] = 1
    g.replay()
    assert scale == 100.0 and cols == [1, 2]  # the host values did change ...
    assert torch.equal(y, torch.tensor([[0.0, 6.0], [9.0, 15.0]]))  # ... the graph still uses the old ones
    # A tensor built from a host list is a host-to-device copy on a device: rejected, not baked.
    with pytest.raises(CaptureError, match=r"torch\.tensor\(host data\)"), Graph("cpu").capture():
        x * torch.tensor(weights)


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("item", lambda t: t.sum().item()),
        ("tolist", lambda t: t.tolist()),
        ("cpu", lambda t: t.cpu()),
        ("to_cpu", lambda t: t.to("cpu")),
        ("to_cpu_kwarg", lambda t: t.to(device="cpu", dtype=torch.float64)),
        ("numpy", lambda t: t.numpy()),
        ("np_asarray", lambda t: np.asarray(t)),
        ("bool", lambda t: bool(t[0] > 0)),
        ("int", lambda t: int(t[0])),
        ("float", lambda t: float(t[0])),
        ("index", lambda t: [1, 2, 3][t[0].long()]),
        ("if_tensor", lambda t: 1 if (t > 0).all() else 0),
        ("equal", lambda t: torch.equal(t, t)),
        ("allclose", lambda t: torch.allclose(t, t)),
    ],
)
def test_d_host_read_back_raises(name: str, read) -> None:
    x = torch.ones(4)
    g = Graph("cpu")
    with pytest.raises(CaptureError) as err, g.capture():
        read(x)
    assert "host" in str(err.value)
    assert not g.captured
    assert _no_modes_left()


@pytest.mark.parametrize(
    ("name", "op", "needle"),
    [
        ("nonzero", lambda x: torch.nonzero(x > 0), "nonzero"),
        ("where_one_arg", lambda x: torch.where(x > 0), "nonzero"),
        ("masked_select", lambda x: torch.masked_select(x, x > 0), "masked_select"),
        ("bool_mask_index", lambda x: x[x > 0], "x[mask]"),
        ("uint8_mask_index", lambda x: x[(x > 0).to(torch.uint8)], "x[mask]"),
        ("unique", lambda x: torch.unique(x), "unique"),
        (
            "repeat_interleave_tensor",
            lambda x: x.repeat_interleave(REPEATS),
            "output_size",
        ),
        (
            "bool_mask_assign_tensor",
            lambda x: x.clone().__setitem__(x > 0, torch.ones(4)),
            "x[mask] = values",
        ),
    ],
)
def test_e_data_dependent_shapes_raise(name: str, op, needle: str) -> None:
    x = torch.tensor([1.0, -2.0, 3.0, 0.5])
    g = Graph("cpu")
    with pytest.raises(CaptureError) as err, g.capture():
        op(x)
    assert needle in str(err.value)
    assert not g.captured
    assert _no_modes_left()


def test_e_static_shape_forms_are_allowed() -> None:
    x = torch.tensor([1.0, -2.0, 3.0, 0.5])
    index = torch.tensor([3, 0])
    g = Graph("cpu")
    with g.capture():
        clipped = x.clone()
        clipped[x < 0] = 0.0  # a scalar mask assignment becomes masked_fill_: no data-dependent shape
        picked = x[index]  # integer indexing has a static shape
        rep = x.repeat_interleave(REPEATS, output_size=4)
        kept = torch.where(x > 0, x, torch.zeros(()))
    x.copy_(torch.tensor([-1.0, 2.0, -3.0, 4.0]))
    g.replay()
    assert torch.equal(clipped, torch.tensor([0.0, 2.0, 0.0, 4.0]))
    assert torch.equal(picked, torch.tensor([4.0, -1.0]))
    assert torch.equal(rep, torch.tensor([-1.0, 2.0, 2.0, 4.0]))
    assert torch.equal(kept, torch.tensor([0.0, 2.0, 0.0, 4.0]))


def test_d_device_code_that_moves_nothing_is_allowed() -> None:
    x = torch.ones(3)
    scores = torch.zeros(3, dtype=torch.float64)
    g = Graph("cpu")
    with g.capture():
        a = x.to(scores) + 1  # dtype/device of another tensor: device code, not a host copy
        b = x.to(x.device) * 2
        c = x.to(torch.float16)
    g.replay()
    assert a.dtype == torch.float64 and torch.equal(a, torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.equal(b, torch.full((3,), 2.0)) and c.dtype == torch.float16


def test_f_captured_outputs_are_static_and_rewritten_in_place() -> None:
    x = torch.randn(8, 16)
    w = torch.randn(16, 4)
    g = Graph("cpu")
    with g.capture():
        h = torch.relu(x @ w)
        out = h.softmax(-1)
        flat = out.view(-1)
    ptrs = (h.data_ptr(), out.data_ptr(), flat.data_ptr())
    for _ in range(3):
        x.copy_(torch.randn(8, 16))
        g.replay()
        assert (h.data_ptr(), out.data_ptr(), flat.data_ptr()) == ptrs
        assert torch.allclose(out, torch.relu(x @ w).softmax(-1))
        assert torch.equal(flat, out.reshape(-1))


def test_g_replay_runs_no_python_of_the_captured_function() -> None:
    x = torch.ones(3)
    calls: list[int] = []
    branch = {"big": False}

    def fn() -> torch.Tensor:
        calls.append(1)
        if branch["big"]:  # Python control flow is resolved once, at capture
            return x * 1000
        return x + 1

    g = Graph("cpu")
    with g.capture():
        y = fn()
    branch["big"] = True
    for _ in range(4):
        g.replay()
    assert calls == [1]
    assert torch.equal(y, torch.full((3,), 2.0))


# ---- capture lifecycle ---------------------------------------------------------------------------------


def test_failed_capture_cleans_up_and_can_capture_again() -> None:
    x = torch.zeros(3)
    g = Graph("cpu")
    with pytest.raises(ValueError, match="boom"), g.capture():
        x.add_(5)
        raise ValueError("boom")
    assert not g.captured and not g.capturing
    assert _no_modes_left()
    assert torch.equal(x, torch.zeros(3))  # what the failed capture wrote is undone
    assert x.sum().item() == 0.0  # host reads work again outside capture
    with pytest.raises(CaptureError):
        g.replay()
    with g.capture():
        y = x + 1
    g.replay()
    assert torch.equal(y, torch.ones(3))


def test_failed_capture_from_guard_leaves_no_state() -> None:
    g = Graph("cpu")
    with pytest.raises(CaptureError), g.capture():
        torch.ones(2).tolist()
    assert _no_modes_left() and not g.captured
    assert torch.ones(2).tolist() == [1.0, 1.0]


def test_capture_does_not_change_preexisting_tensors() -> None:
    counter = torch.zeros(1, dtype=torch.long)
    cache = torch.zeros(4, 2)
    slots = torch.tensor([1, 3])
    g = Graph("cpu")
    with g.capture():
        counter += 1
        cache.index_copy_(0, slots, torch.ones(2, 2))
    assert counter.item() == 0 and cache.abs().sum().item() == 0  # like a device graph: capture records only
    g.replay()
    g.replay()
    assert counter.item() == 2
    assert torch.equal(cache[:, 0], torch.tensor([0.0, 1.0, 0.0, 1.0]))


def test_capture_lifecycle_errors_and_reset() -> None:
    x = torch.ones(2)
    g = Graph("cpu")
    with pytest.raises(CaptureError, match="before a completed capture"):
        g.replay()
    with g.capture() as same:
        assert same is g and g.capturing
        with pytest.raises(CaptureError, match="already active"), g.capture():
            pass
        y = x * 2
    assert g.captured
    with pytest.raises(CaptureError, match="reset"), g.capture():
        pass
    g.reset()
    assert not g.captured
    with g.capture():
        y = x * 3
    g.replay()
    assert torch.equal(y, torch.full((2,), 3.0))


def test_nested_capture_is_rejected() -> None:
    outer, inner = Graph("cpu"), Graph("cpu")
    with pytest.raises(CaptureError, match="nested"), outer.capture(), inner.capture():
        pass
    assert _no_modes_left() and not outer.captured and not inner.captured


def test_random_ops_draw_fresh_values_each_replay() -> None:
    g = Graph("cpu")
    with g.capture():
        r = torch.rand(64)
    g.replay()
    first = r.clone()
    g.replay()
    assert not torch.equal(first, r)
    assert bool(((r >= 0) & (r < 1)).all())


def test_inference_mode_capture_and_replay() -> None:
    with torch.inference_mode():
        x = torch.randn(2, 3, 4)
        g = Graph("cpu")
        with g.capture():
            y = x.transpose(1, 2).reshape(2, 12) * 2  # reshape of a transpose copies: must be replayed
    with torch.inference_mode():
        x.copy_(torch.randn(2, 3, 4))
    g.replay()
    assert torch.equal(y, x.transpose(1, 2).reshape(2, 12) * 2)


def test_capture_with_autograd_tensors_replays_without_recording_grad() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    g = Graph("cpu")
    with g.capture():
        y = torch.tanh(x @ w)
    x.copy_(torch.randn(2, 4))
    g.replay()
    with torch.no_grad():
        assert torch.allclose(y, torch.tanh(x @ w))


_X = torch.randn(4, 6)
_W = torch.randn(6, 6)
_MASK = torch.rand(4, 6) > 0.5
_Q, _K, _V = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
_ZOO = {
    "linear_gelu": lambda: F.gelu(F.linear(_X, _W)),
    "layer_norm": lambda: F.layer_norm(_X, (6,)),
    "max_dim": lambda: torch.max(_X, dim=1),
    "var_mean": lambda: torch.var_mean(_X, dim=1),
    "factories": lambda: torch.zeros(4, 6) + torch.arange(6) + torch.full((4, 1), 3.0) + _X,
    "inplace_on_view": lambda: (lambda y: (y[:, 0].mul_(10), y)[1])(_X * 1),
    "transpose_contiguous": lambda: _X.t().contiguous() + 1,
    "sdpa": lambda: F.scaled_dot_product_attention(_Q, _K, _V),
    "where_softmax": lambda: torch.where(_MASK, _X, -1e9).softmax(-1),
    "cat_stack": lambda: torch.cat([_X, _X * 2], 0).sum(0) + torch.stack([_X[0], _X[1]]).mean(0),
    "to_dtype": lambda: _X.to(torch.float64).sum(1).to(torch.float32),
    "einsum": lambda: torch.einsum("ij,jk->ik", _X, _W),
}


def _flat(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


@pytest.mark.parametrize("mode", ["grad", "inference"])
@pytest.mark.parametrize("name", sorted(_ZOO))
def test_replay_matches_eager_after_inputs_change(name: str, mode: str) -> None:
    fn = _ZOO[name]
    ctx = torch.inference_mode if mode == "inference" else torch.enable_grad
    with ctx():
        g = Graph("cpu")
        with g.capture():
            outs = _flat(fn())
    saved = [t.clone() for t in (_X, _W, _Q, _K, _V)]
    try:
        with torch.inference_mode():
            for t in (_X, _W, _Q, _K, _V):
                t.add_(torch.randn_like(t))
        g.replay()
        with ctx():
            expected = _flat(fn())
        assert len(outs) == len(expected)
        for got, want in zip(outs, expected, strict=True):
            assert torch.allclose(got, want, atol=1e-5)
    finally:
        with torch.inference_mode():
            for t, s in zip((_X, _W, _Q, _K, _V), saved, strict=True):
                t.copy_(s)


def test_functional_ops_replay_without_copy_fallback() -> None:
    x, a, b = torch.randn(256), torch.randn(256), torch.randn(256)
    em = Emulator()
    with em.capture():
        ax = x * a  # every result is held: each is static and written through an out= / in-place shortcut
        pre = ax + b
        act = torch.sigmoid(pre)
        y = act.clamp(-1.0, 1.0)
        z = y.t().contiguous().masked_fill(y > 0.5, 0.0)
        # Dropped at once: transient, the op itself runs at replay (no shortcut, no copy either).
        w = torch.sigmoid(x * a + b).clamp(-1.0, 1.0)
    stats = em.stats
    assert stats.get("copy", 0) == 0, stats
    assert stats["out"] >= 4 and stats["transient"] == 4, stats  # x * a, + b, sigmoid, y > 0.5
    x.copy_(torch.randn(256))
    em.replay()
    want = torch.sigmoid(x * a + b).clamp(-1.0, 1.0)
    assert torch.equal(ax, x * a) and torch.equal(act, torch.sigmoid(x * a + b))
    assert torch.equal(y, want) and torch.equal(w, want)
    assert torch.equal(z, want.masked_fill(want > 0.5, 0.0))


# ---- transient intermediates ---------------------------------------------------------------------------


def test_intermediates_are_freed_after_capture_and_recomputed_at_replay() -> None:
    x = torch.randn(4, 8)
    refs: list[weakref.ref[torch.Tensor]] = []
    em = Emulator()
    with em.capture():
        h = x * 2
        refs.append(weakref.ref(h))
        y = h.t().exp().sum(0)  # t() views a transient tensor: re-run at replay, not skipped
        del h
    assert refs[0]() is None  # the recording holds no reference to an intermediate
    assert em.slots["static"] == 1 and em.slots["transient"] == 3 and em.slots["external"] == 1
    assert em.stats["view"] == 1 and em.stats["transient"] == 2, em.stats
    ptr = y.data_ptr()
    for _ in range(2):
        x.copy_(torch.randn(4, 8))
        em.replay()
        assert y.data_ptr() == ptr
        assert torch.allclose(y, (x * 2).t().exp().sum(0))


def test_escaped_view_keeps_its_base_static() -> None:
    x = torch.arange(8.0)

    def head() -> torch.Tensor:
        buf = x * 2  # created during capture, dropped when head() returns ...
        return buf[2:5]  # ... but this view of its storage escapes

    em = Emulator()
    with em.capture():
        view = head()
        storage = (x + 1).untyped_storage()  # only the storage of a result escapes: that is enough
    ptr = view.data_ptr()
    assert em.slots["static"] == 3 and em.slots["transient"] == 0  # buf, its view, x + 1
    x.copy_(torch.arange(8.0) + 10)
    em.replay()
    assert view.data_ptr() == ptr
    assert torch.equal(view, (x * 2)[2:5])
    assert torch.equal(torch.empty(0).set_(storage, 0, (8,), (1,)), x + 1)


def test_graphs_of_a_big_intermediate_hold_only_their_outputs() -> None:
    x = torch.randn(64, 256)
    big = 16 * 64 * 256 * 4  # bytes of each graph's intermediate
    graphs, outs = [], []
    for i in range(4):
        g = Graph("cpu")
        with g.capture():
            outs.append((x.expand(16, 64, 256) * (i + 1)).sum(0))
        graphs.append(g)
    slots = [g.emulator.slots for g in graphs if g.emulator is not None]
    assert sum(s["static_bytes"] for s in slots) == 4 * x.nbytes  # the outputs: not 4 * (big + output)
    assert all(s["transient_bytes"] == big for s in slots)
    x.copy_(torch.randn(64, 256))
    for i, (g, out) in enumerate(zip(graphs, outs, strict=True)):
        g.replay()
        assert torch.allclose(out, x * (16 * (i + 1)), rtol=1e-5, atol=1e-4)


def test_big_static_results_of_transient_inputs_replay_in_place() -> None:
    x = torch.randn(512, 1024)  # 2 MiB: above the size whose shortcut is checked while recording
    em = Emulator()
    with em.capture():
        y = (x * 2).exp()  # the input is transient: y is written by a checked shortcut or copied into
        h = x * 3
        z = h.exp()  # the input is held: the shortcut is checked when capture ends
    ptrs = (y.data_ptr(), z.data_ptr())
    assert em.stats.get("out", 0) >= 2, em.stats
    x.copy_(torch.randn(512, 1024))
    em.replay()
    assert (y.data_ptr(), z.data_ptr()) == ptrs
    assert torch.equal(y, (x * 2).exp()) and torch.equal(z, (x * 3).exp())


def test_reused_ids_are_not_mistaken_for_dead_tensors() -> None:
    x = torch.randn(32)
    em = Emulator()
    with em.capture():
        acc = torch.zeros(32)
        for i in range(50):  # each t dies at once: new tensors keep reusing its id
            t = x + i
            acc = acc + t * t
            del t
    x.copy_(torch.randn(32))
    em.replay()
    want = torch.zeros(32)
    for i in range(50):
        want = want + (x + i) * (x + i)
    assert torch.equal(acc, want)


def test_failed_capture_and_reset_leave_no_slots() -> None:
    x = torch.ones(3)
    em = Emulator()
    with pytest.raises(ValueError, match="boom"), em.capture():
        _ = x * 2
        raise ValueError("boom")
    assert em.slots == dict.fromkeys(
        ("static", "transient", "external", "static_bytes", "transient_bytes"), 0
    )
    with em.capture():
        y = x + 1
    assert em.slots["static"] == 1
    em.reset()
    assert em.slots["static"] == 0 and em.num_steps == 0
    assert torch.isnan(y).all()  # never replayed: poison, as on a device


def test_task_update_releases_the_old_recording() -> None:
    x = torch.arange(6.0)
    out = torch.zeros(6)

    def scaled(src: torch.Tensor, dst: torch.Tensor, *, factor: float) -> None:
        dst.copy_((src * factor).exp().log())  # intermediates: transient

    g = Graph("cpu")
    with g.capture():
        task = g.task("custom", scaled, x, out, factor=2.0)
    assert g.emulator is not None
    before = g.emulator.slots
    for factor in (3.0, 4.0, 5.0):
        task.update(factor=factor)
        assert g.emulator.slots == before  # the replaced group's slots are gone, nothing accumulates
        g.replay()
        assert torch.allclose(out, x * factor)


class _Ops(TorchDispatchMode):
    """Below the recorder: the ops it runs, with the device of their first tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.seen.append((func.overloadpacket.__name__, first.device.type if first is not None else "-"))
        return func(*args, **(kwargs or {}))


def _matmul_task() -> tuple[Graph, Any, torch.Tensor, torch.Tensor]:
    """A graph of one task, ``out = a @ a * factor``: (graph, its task, a, out)."""
    a = torch.randn(256, 256)
    out = torch.zeros(256, 256)

    def task(src: torch.Tensor, dst: torch.Tensor, *, factor: float) -> None:
        dst.copy_(torch.mm(src, src) * factor)

    g = Graph("cpu")
    with g.capture():
        handle = g.task("custom", task, a, out, factor=1.0)
    return g, handle, a, out


def test_a_task_update_is_recorded_without_computing_the_task() -> None:
    # As a device records a task update: the big matmul is shaped (on meta), not run; replay computes it.
    g, handle, a, out = _matmul_task()
    g.replay()
    before = out.clone()
    with _Ops() as ops:
        handle.update(factor=2.0)
    assert ("mm", "meta") in ops.seen and ("mm", "cpu") not in ops.seen, ops.seen
    assert torch.equal(out, before)  # the update wrote nothing
    g.replay()
    torch.testing.assert_close(out, torch.mm(a, a) * 2.0)


def test_a_step_s_task_updates_are_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.arange(4.0)
    outs = [torch.zeros(4), torch.zeros(4)]

    def scaled(src: torch.Tensor, dst: torch.Tensor, *, factor: float) -> None:
        dst.copy_(src * factor)

    g = Graph("cpu")
    with g.capture():
        for out in outs:
            g.task("custom", scaled, x, out, factor=1.0)
    compiled = []
    real = replay_module.generate
    monkeypatch.setattr(replay_module, "generate", lambda *a: compiled.append(1) or real(*a))
    assert g.reissue({"custom": {"factor": 3.0}}) == 2
    assert len(compiled) == 1  # two groups re-recorded, one compilation
    g.replay()
    assert all(torch.equal(out, x * 3.0) for out in outs)
    assert g.update_tasks("custom", factor=5.0) == 2 and len(compiled) == 2
    g.replay()
    assert all(torch.equal(out, x * 5.0) for out in outs)


def test_an_update_that_fails_uncomputed_is_recorded_again_computing(monkeypatch: pytest.MonkeyPatch) -> None:
    # An op that fails on the uninitialized values of an uncomputed recording (say, indices taken from a
    # big intermediate): the update is recorded again, computing, and replays what eager gives.
    def fails(*args: object, **kwargs: object) -> None:
        raise IndexError("index out of range in self")

    monkeypatch.setattr(recording, "shaped_like_result", fails)
    g, handle, a, out = _matmul_task()
    with _Ops() as ops:
        handle.update(factor=3.0)
    assert ("mm", "cpu") in ops.seen  # the second recording computed
    g.replay()
    torch.testing.assert_close(out, torch.mm(a, a) * 3.0)


# ---- facade --------------------------------------------------------------------------------------------


def test_device_parsing_and_pool_token() -> None:
    g = Graph()
    assert g.device == torch.device("cpu")
    assert Graph(torch.device("cpu")).device.type == "cpu"
    token = g.pool()
    assert token is g.pool()
    other = Graph("cpu")
    x = torch.ones(2)
    with other.capture(pool=token):
        y = x + 1
    other.replay()
    assert torch.equal(y, torch.full((2,), 2.0))
    assert "captured" in repr(other)


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:x", ""])
def test_unknown_device_names_allowed_values(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        Graph(bad)
    assert "cpu" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_raises_device_unavailable() -> None:
    with pytest.raises(DeviceUnavailableError, match="CUDA"):
        Graph("cuda")


def test_device_capture_guards_on_cpu_tensors() -> None:
    x = torch.tensor([1.0, -1.0])
    with capture_guards(strict_cpu=False):
        same = x.cpu()  # a cpu tensor during a device capture is host data already
        with pytest.raises(CaptureError, match="item"):
            x.sum().item()
        with pytest.raises(CaptureError, match="nonzero"):
            torch.nonzero(x)
        with pytest.raises(CaptureError, match="x\\[mask\\]"):
            x[x > 0]
    assert _no_modes_left()
    assert same is x and x.sum().item() == 0.0


def test_emulator_without_restore_applies_capture_writes_once() -> None:
    counter = torch.zeros(1)
    em = Emulator(restore_inputs=False)
    with em.capture():
        counter.add_(1)
    assert counter.item() == 1.0
    em.replay()
    assert counter.item() == 2.0


def test_without_restore_a_task_update_applies_its_writes_once() -> None:
    counter = torch.zeros(1)
    em = Emulator(restore_inputs=False)
    with em.capture():
        group = em.begin_group("custom")
        counter.add_(1)
        em.end_group(group)
    assert counter.item() == 1.0
    em.rerecord_group(group, lambda: counter.add_(10))
    assert counter.item() == 11.0  # computed, not recorded dry: without restore its writes are kept
    em.replay()
    assert counter.item() == 21.0


def test_a_dry_capture_computes_nothing_and_replays_what_eager_gives() -> None:
    a = torch.randn(256, 256)
    with _Ops() as ops:
        g = Graph("cpu")
        with g.capture(dry=True):
            y = torch.mm(a, a).relu()
    assert ("mm", "meta") in ops.seen and ("mm", "cpu") not in ops.seen, ops.seen
    g.replay()
    torch.testing.assert_close(y, torch.mm(a, a).relu())

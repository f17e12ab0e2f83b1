"""Dry capture is a device's capture or a clear error (issue 35 §3): a differential test over a corpus of ops,
each captured dry (nothing computed: functional ops shaped by their meta kernels, writes skipped), captured
computing, and run eagerly. Replays equal eager (twice, the second time on new input values); an op eager
refuses is refused at capture by both captures; a value a kernel refuses only at replay (an index out of
range written after capture) is a ReplayError naming the op, never a bare error or a wrong result.

The corpus covers every aten op the shipped drills record (:data:`DRILL_OPS`: the attention drill on
gemma4-31b-it-mtp and the model drill on gemma4-tiny-model, traced from their captures), plus linear algebra,
FFT, in-place view ops, index_select/embedding out of range and kernel-only checks (overlap, dtypes, scalars).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from paged_spec import PAGED_SPEC as SPEC
from torch.utils._python_dispatch import TorchDispatchMode

import graphbuf
import graphbuf.graphs.emulator.recording as recording
from graphbuf import CaptureError, Graph, ReplayError
from graphbuf.graphs.runner import GraphRunner, Step

Inputs = dict[str, torch.Tensor]

#: Aten ops recorded in the captures of ``graphbuf drill gemma4-31b-it-mtp`` and ``graphbuf drill
#: gemma4-tiny-model --model tiny`` (traced through the recorder, 2026-12-05).
DRILL_OPS = frozenset((
    "_softmax.default", "_to_copy.default", "_unsafe_view.default", "abs.default", "add.Tensor",
    "add_.Tensor", "amax.default", "arange.default", "arange.start", "bitwise_and.Tensor",
    "bitwise_not.default", "bmm.default", "cat.default", "clamp.default", "clamp_min.default",
    "clone.default", "copy_.default", "cos.default", "div.Tensor", "embedding.default", "eq.Tensor",
    "exp.default", "exp_.default", "expand.default", "floor_divide.default", "full.default",
    "full_like.default", "ge.Scalar", "gelu.default", "gt.Scalar", "gt.Tensor", "index.Tensor",
    "index_copy.default", "index_copy_.default", "index_select.default", "le.Tensor", "lt.Scalar",
    "lt.Tensor", "masked_fill.Scalar", "masked_fill_.Scalar", "maximum.default", "mean.dim",
    "mm.default", "mul.Tensor", "mul_.Tensor", "nan_to_num.default", "ne.Scalar", "neg.default",
    "permute.default", "pow.Tensor_Scalar", "select.int", "sin.default", "slice.Tensor",
    "stack.default", "sub.Tensor", "sub_.Tensor", "sum.dim_IntList", "t.default", "tanh.default",
    "transpose.int", "unsqueeze.default", "view.default", "where.self", "zeros.default",
    "zeros_like.default",
))  # fmt: skip


def make_inputs(seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(32, 64, generator=g),
        "y": torch.randn(32, 64, generator=g),
        "w": torch.randn(64, 48, generator=g),
        "table": torch.randn(16, 64, generator=g),
        "ids": torch.randint(0, 16, (32,), generator=g),
        "perm": torch.randperm(16, generator=g)[:8],
        "mask": torch.rand(32, 64, generator=g) > 0.5,
        "signal": torch.randn(4, 256, generator=g),
    }


# ---- the corpus ------------------------------------------------------------------------------------------


def pointwise(i: Inputs) -> torch.Tensor:
    x, y = i["x"], i["y"]
    return (x.abs() + y).cos().sin().tanh().exp().neg() + (x - y) * y / (y.abs() + 1) + F.gelu(x)


def compares(i: Inputs) -> torch.Tensor:
    x, y = i["x"], i["y"]
    both = (x > 0) & ~(x < -0.5) & (x >= -1) & (x.ne(0.25)) & (x > y) & (y < x) & (x <= y + 1) & (x == x)
    return torch.where(both, x, y) + both.float()


def reductions(i: Inputs) -> torch.Tensor:
    x = i["x"]
    return (
        torch.softmax(x, -1) + x.amax(-1, keepdim=True) + x.mean(-1, keepdim=True) + x.sum(-1, keepdim=True)
    )


def clamps(i: Inputs) -> torch.Tensor:
    x, y, ids = i["x"], i["y"], i["ids"]
    out = x.clamp(-0.5, 0.5) + x.clamp_min(0) + torch.maximum(x, y) + x**2
    return out + torch.nan_to_num(x / (y > 0).float()) + (ids // 3).float().unsqueeze(1)


def matmuls(i: Inputs) -> torch.Tensor:
    x, w = i["x"], i["w"]
    batched = torch.bmm(x.view(4, 8, 64), w.t().t().expand(4, 64, 48))
    return (
        (x @ w)
        + batched.permute(1, 0, 2).transpose(0, 1).reshape(32, 48)
        + (x.view(2, 16, 64) @ w).view(32, 48)
    )


def gathers(i: Inputs) -> torch.Tensor:
    table, ids = i["table"], i["ids"]
    rows = table[ids] + torch.index_select(table, 0, ids) + F.embedding(ids, table)
    return rows + table[0] + rows[:, 1:2] + table[ids[:1]]


def builds(i: Inputs) -> torch.Tensor:
    x, y = i["x"], i["y"]
    steps = torch.arange(32).float().unsqueeze(1) + torch.arange(2, 66).float()
    made = torch.zeros(32, 64) + torch.full((32, 64), 2.0) + torch.full_like(x, 3.0) + torch.zeros_like(y)
    return torch.cat([x, y])[:32] + torch.stack([x, y]).sum(0) + steps + made + x.clone()


def masks(i: Inputs) -> torch.Tensor:
    x, mask = i["x"], i["mask"]
    out = x.masked_fill(mask, -1e9).clone()
    out.masked_fill_(~mask, 0.5)
    return out


def writes(i: Inputs) -> torch.Tensor:
    x, y = i["x"], i["y"]
    out = x.clone()
    out.add_(y)
    out.mul_(y)
    out.sub_(x)
    out.clamp_(-5, 5).exp_()
    scratch = torch.empty_like(out)
    scratch.copy_(out)
    return scratch


def index_copies(i: Inputs) -> torch.Tensor:
    x, perm = i["x"], i["perm"]
    out = torch.zeros(16, 64)
    out.index_copy_(0, perm, x[:8])
    return out + torch.index_copy(torch.ones(16, 64), 0, perm, x[8:16])


def linear_algebra(i: Inputs) -> torch.Tensor:
    a = i["x"][:16, :16]
    spd = a @ a.T + 16 * torch.eye(16)
    q, r = torch.linalg.qr(spd)
    out = torch.linalg.inv(spd) + torch.linalg.solve(spd, a) + torch.linalg.cholesky(spd) + q @ r
    return out + torch.linalg.det(spd / 16) + torch.linalg.vector_norm(a, dim=1, keepdim=True)


def ffts(i: Inputs) -> torch.Tensor:
    s = i["signal"]
    spec = torch.fft.rfft(s)
    back = torch.fft.irfft(spec, n=256)
    full = torch.fft.fft2(s.to(torch.complex64)).abs()
    return back + full + torch.view_as_real(torch.fft.fft(s)).sum(-1)


def stft(i: Inputs) -> torch.Tensor:
    # torch.stft re-strides its result in place (transpose_) inside torch.
    return torch.stft(i["signal"], n_fft=32, window=torch.hann_window(32), return_complex=True).abs()


def inplace_views(i: Inputs) -> torch.Tensor:
    x = i["x"]
    a = (x[:16, :16] * 2).t_()
    b = (x[:16, :16] + 1).transpose_(0, 1)
    c = (x[:16, :16] - 1).as_strided_((16, 16), (1, 16))
    d = (x[:16, :16] * 3).unsqueeze_(0).squeeze_(0)
    e = (x[:16, :32] * 1).resize_(16, 16)
    return a + b + c + d + e + a.exp()


def inplace_view_then_write(i: Inputs) -> torch.Tensor:
    out = i["x"][:16, :16].clone()
    out.t_()
    out.add_(i["y"][:16, :16])  # written through its new strides
    return out


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[Inputs], torch.Tensor]


CORPUS = [
    Case(f.__name__, f)
    for f in (
        pointwise, compares, reductions, clamps, matmuls, gathers, builds, masks, writes, index_copies,
        linear_algebra, ffts, stft, inplace_views, inplace_view_then_write,
    )
]  # fmt: skip


def _pow_neg_int(i: Inputs) -> torch.Tensor:
    return i["ids"].clone().pow_(-1)


def _overlapping_copy(i: Inputs) -> torch.Tensor:
    out = i["x"].clone().view(-1)
    out[1:].copy_(out[:-1])
    return out


def _overlapping_write_to_an_input(i: Inputs) -> torch.Tensor:
    flat = i["x"].view(-1)
    flat[1:].copy_(flat[:-1])
    return i["x"] * 1


def _bitwise_float(i: Inputs) -> torch.Tensor:
    return torch.bitwise_and(i["x"] * 1, i["y"] * 1)


def _mm_mixed_dtypes(i: Inputs) -> torch.Tensor:
    return torch.mm(i["x"] * 1, (i["w"] * 1).double())


def _index_by_float(i: Inputs) -> torch.Tensor:
    return torch.index_select(i["table"] * 1, 0, i["ids"].float().clone())


def _floor_divide_by_zero(i: Inputs) -> torch.Tensor:
    return torch.div(i["ids"] * 1, 0, rounding_mode="floor")


def _sort_complex(i: Inputs) -> torch.Tensor:
    return torch.sort((i["x"] * 1).to(torch.complex64)).values.real


REFUSED = [
    Case(f.__name__.lstrip("_"), f)
    for f in (
        _pow_neg_int, _overlapping_copy, _overlapping_write_to_an_input, _bitwise_float, _mm_mixed_dtypes,
        _index_by_float, _floor_divide_by_zero, _sort_complex,
    )
]  # fmt: skip


# ---- the comparison --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def shape_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every functional op of a dry capture is shaped by its meta kernel (none is small enough to compute)."""
    monkeypatch.setattr(recording, "DRY_FROM_BYTES", 0)


def _renew(inputs: Inputs, seed: int) -> None:
    for name, t in make_inputs(seed).items():
        inputs[name].copy_(t)


#: Cases whose dry capture fails on its uncomputed values (linalg's info output, checked by
#: _linalg_check_errors), so that, as GraphRunner does, they capture again computing.
RECAPTURED = frozenset({"linear_algebra"})


def _replays(case: Case, dry: bool) -> list[torch.Tensor]:
    inputs = make_inputs(1)
    g = Graph("cpu")
    try:
        with g.capture(dry=dry):
            out = case.fn(inputs)
    except RuntimeError:
        if not dry or case.name not in RECAPTURED:
            raise
        with g.capture(dry=False):
            out = case.fn(inputs)
    got = []
    for seed in (2, 3):
        _renew(inputs, seed)
        g.replay()
        got.append(out.clone())
    return got


def _eager(case: Case) -> list[torch.Tensor]:
    return [case.fn(make_inputs(seed)) for seed in (2, 3)]


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_dry_and_computing_replays_equal_eager(case: Case) -> None:
    want = _eager(case)
    computing = _replays(case, dry=False)  # first: its ops' signatures are then known, so dry shapes them
    dry = _replays(case, dry=True)
    for got in (computing, dry):
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.stride() == w.stride()
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_an_op_eager_refuses_is_refused_at_capture_dry_or_computing(case: Case) -> None:
    with pytest.raises(Exception) as eager:
        case.fn(make_inputs(1))
    for dry in (False, True, True):  # dry twice: the second sees no signature it has not seen
        inputs = make_inputs(1)
        before = {name: t.clone() for name, t in inputs.items()}
        with pytest.raises(type(eager.value)) as captured, Graph("cpu").capture(dry=dry):
            case.fn(inputs)
        assert any("graphbuf: raised by aten." in n for n in getattr(captured.value, "__notes__", ()))
        assert all(torch.equal(inputs[n], before[n]) for n in inputs)  # the capture changed nothing


@pytest.mark.parametrize("dry", [False, True])
@pytest.mark.parametrize("op", ["index_select", "embedding", "index"])
def test_an_index_out_of_range_at_capture_or_replay_is_never_bare(op: str, dry: bool) -> None:
    def fn(i: Inputs) -> torch.Tensor:
        table, ids = i["table"], i["ids"]
        if op == "index_select":
            return torch.index_select(table, 0, ids) * 2
        return (F.embedding(ids, table) if op == "embedding" else table[ids]) * 2

    inputs = make_inputs(1)
    inputs["ids"][3] = 99  # out of range at capture: a computing capture refuses it, so must a dry one
    with pytest.raises(IndexError), Graph("cpu").capture(dry=dry):
        fn(inputs)
    inputs = make_inputs(1)
    g = Graph("cpu")
    with g.capture(dry=dry):
        out = fn(inputs)
    g.replay()
    torch.testing.assert_close(out, fn(make_inputs(1)))
    inputs["ids"][5] = 16  # out of range at replay: the error names the op, typed
    with pytest.raises(ReplayError, match=rf"replay: aten\.{op}\.\w+ failed: IndexError"):
        g.replay()


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


def test_the_corpus_covers_every_op_the_drills_record() -> None:
    seen = _Seen()
    with seen:
        for case in CORPUS:
            case.fn(make_inputs(0))
    assert DRILL_OPS - seen.ops == set()
    extra = {"linalg_inv_ex.default", "linalg_cholesky_ex.default", "_fft_r2c.default", "t_.default"}
    assert extra <= seen.ops


# ---- through the runner: errors at capture, never after the refresh wrote ----------------------------------


def _runner_fn(body: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Step], torch.Tensor]:
    def fn(step: Step) -> torch.Tensor:
        return body(step.views["block_table"].float()).sum(1) + step.views["seq_lens"].float()

    return fn


def _stft_rows(bt: torch.Tensor) -> torch.Tensor:
    sig = bt.repeat(1, 200)  # (rows, 1600): over the size a dry capture computes
    return torch.stft(sig, n_fft=64, window=torch.ones(64), return_complex=True).abs().flatten(1)


def _transposed(bt: torch.Tensor) -> torch.Tensor:
    sq = bt[:, :8].clone() if bt.shape[0] >= 8 else bt.repeat(8, 1)[:8, :8].clone()
    sq.t_()
    return sq[: bt.shape[0]]


def test_stft_in_a_cpu_runner_replays_as_eager() -> None:
    """torch.stft re-strides its result in place inside torch: every run() raised a bare RuntimeError after
    the refresh wrote; it now replays as eager."""
    buffers = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC))
    fn = _runner_fn(_stft_rows)
    runner = GraphRunner(buffers, fn, output_rows="requests")
    runner.capture()
    src = {
        "block_table": torch.randint(0, 16, (3, 8), dtype=torch.int32),
        "seq_lens": torch.ones(3, dtype=torch.int32),
    }
    got = runner.run(src)
    torch.testing.assert_close(got, fn(Step(4, buffers.view(4), None, {}, 3))[:3])


def test_a_captured_tensor_re_strided_in_place_replays_its_transpose() -> None:
    """t_() on a tensor made in the capture: replay returned the input where eager returns its transpose."""
    buffers = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC))
    fn = _runner_fn(_transposed)
    runner = GraphRunner(buffers, fn, output_rows="requests")
    runner.capture()
    src = {
        "block_table": torch.arange(64, dtype=torch.int32).remainder(16).view(8, 8),
        "seq_lens": torch.ones(8, dtype=torch.int32),
    }
    got = runner.run(src)
    torch.testing.assert_close(got, fn(Step(8, buffers.view(8), None, {}, 8)))


@pytest.mark.parametrize("body", ["pow_", "overlapping copy_"])
def test_an_in_place_op_a_computing_capture_refuses_is_a_capture_error_naming_op_and_size(body: str) -> None:
    """pow_(-1) on ints and an overlapping copy_ were skipped by the dry capture and raised a bare
    RuntimeError at every run(), after the refresh wrote."""

    def inner(bt: torch.Tensor) -> torch.Tensor:
        ints = bt.long().clone()
        if body == "pow_":
            ints.pow_(-1)
        else:
            flat = ints.view(-1)
            flat[1:].copy_(flat[:-1])
        return ints.float()

    buffers = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC))
    runner = GraphRunner(buffers, _runner_fn(inner), output_rows="requests")
    op = "pow_" if body == "pow_" else "copy_"
    with pytest.raises(CaptureError, match=rf"capture at size 8 .*raised by aten\.{op}\."):
        runner.capture()


def test_a_tensor_from_before_capture_re_strided_after_use_is_a_capture_error() -> None:
    x = torch.randn(4, 4)
    with (
        pytest.raises(
            CaptureError, match=r"aten\.t_\.default changed the shape or strides of a tensor from before"
        ),
        Graph("cpu").capture(dry=True),
    ):
        y = x * 2
        x.t_()
        y.add_(x)


def test_host_numbers_changing_per_update_add_no_signatures() -> None:
    """A task re-issued each step with new host numbers is recorded dry each time after the first: its
    signatures key numbers by sign, so the set of verified signatures stays bounded."""
    x, out = torch.randn(64, 64), torch.zeros(64, 64)

    def task(src: torch.Tensor, dst: torch.Tensor, *, scale: float, lens: list[int]) -> None:
        dst.copy_(src.clamp(max=scale) * src[:, : len(lens)].sum(1, keepdim=True))

    g = Graph("cpu")
    with g.capture():
        handle = g.task("custom", task, x, out, scale=1.0, lens=[1, 2])
    handle.update(scale=2.0, lens=[3, 4])
    before = len(recording.VERIFIED)
    for step in range(3, 20):
        handle.update(scale=float(step), lens=[step, step + 1])
        g.replay()
        torch.testing.assert_close(out, x.clamp(max=float(step)) * x[:, :2].sum(1, keepdim=True))
    assert len(recording.VERIFIED) == before

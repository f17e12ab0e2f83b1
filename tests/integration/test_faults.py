"""Faults: a capture that fails at one size, buffers rebound behind the runner's back, long runs of rapid
refreshes compared with eager (cpu here, cuda where present), and the vLLM plugin facing an unsupported
vllm-ascend.

Invariants checked:
- a failed capture leaves nothing behind: no graph for that size, no dispatch or function mode installed,
  no recorded op in the other sizes' graphs, every pre-existing tensor it wrote restored; that size runs
  eagerly with its reason recorded, and later captures (a fresh ``Graph("cpu")``) work;
- a captured view that was ``set_`` to other memory, resized or re-strided is caught before every replay;
- every replay of a long run equals an independent host computation of the same batch;
- an upstream surface miss gets one warning per process and no patch; a version string alone never refuses.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from paged_spec import PAGED_SPEC as SPEC
from paged_spec import SIZES, WIDTH
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import graphbuf
from graphbuf import AddressChangedError, CaptureError, Graph, GraphRunner, StaticBuffers, Step
from graphbuf.graphs.runner import EAGER_CAPTURE_FAILED, EAGER_TOO_LARGE

_WEIGHTS = np.arange(1, WIDTH + 1, dtype=np.float64)


def make_buffers(device: str = "cpu") -> StaticBuffers:
    return StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC), device)


def make_batch(n: int, rng: np.random.Generator, width: int | None = None) -> dict[str, np.ndarray]:
    """Fresh host arrays for ``n`` requests; block tables ``width`` columns wide (random if None)."""
    w = int(rng.integers(1, WIDTH + 1)) if width is None else width
    return {
        "block_table": rng.integers(0, 16, size=(n, w)).astype(np.int32),
        "seq_lens": rng.integers(0, 33, size=n).astype(np.int32),
    }


def expected(src: dict[str, np.ndarray]) -> torch.Tensor:
    """The step's result computed on the host from the sources alone (stale columns count as pad 0)."""
    bt = src["block_table"].astype(np.float64)
    weighted = (bt * _WEIGHTS[: bt.shape[1]]).sum(axis=1)
    return torch.from_numpy(src["seq_lens"] * 2.0 + weighted).float()


class WeightedSum:
    """The captured step: seq_lens * 2 + a column-weighted block-table row sum (column order matters).

    ``busy``: that many 1024 x 1024 matmuls whose result is discarded, so that on cuda the stream lags
    behind the host and refreshes overlap uploads still in flight.
    """

    def __init__(self, device: str = "cpu", busy: int = 0) -> None:
        self.weights = torch.from_numpy(_WEIGHTS).float().to(device)
        self.busy = busy
        self.square = torch.randn(1024, 1024, device=device) if busy else None

    def __call__(self, step: Step) -> torch.Tensor:
        bt, lens = step.views["block_table"], step.views["seq_lens"]
        out = lens.float() * 2 + (bt.float() * self.weights[: bt.shape[1]]).sum(1)
        for _ in range(self.busy):
            out = out + (self.square @ self.square)[0, : out.shape[0]] * 0
        return out


def modes_installed() -> tuple[int, int]:
    return len(_get_current_dispatch_mode_stack()), len(_get_current_function_mode_stack())


# ------------------------------------------------------------------------------------ capture failure


def _boom_task(side: torch.Tensor) -> None:
    side.mul_(3)
    raise RuntimeError("boom inside the task")


def _raise_after_ops(step: Step, side: torch.Tensor) -> None:
    side.add_(1)  # recorded, and a write to a tensor that existed before capture
    raise RuntimeError("boom after ops")


def _raise_in_task(step: Step, side: torch.Tensor) -> None:
    side.add_(1)
    step.task("custom", _boom_task, side)  # fails with the task group open


def _host_read(step: Step, side: torch.Tensor) -> None:
    side.add_(1)
    step.views["seq_lens"].sum().item()  # rejected by the capture guards


def _writes_buffer(step: Step, side: torch.Tensor) -> None:
    step.views["seq_lens"].fill_(-7)  # a write into a captured buffer, then a failure
    raise RuntimeError("boom after a buffer write")


FAILURES: dict[str, tuple[Callable[[Step, torch.Tensor], None], str]] = {
    "raise-after-ops": (_raise_after_ops, "RuntimeError: boom after ops"),
    "raise-in-task": (_raise_in_task, "RuntimeError: boom inside the task"),
    "host-read": (_host_read, "CaptureError: Tensor.item()"),
    "writes-buffer": (_writes_buffer, "RuntimeError: boom after a buffer write"),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("bad", SIZES)
def test_capture_failure_raises_naming_size_and_cause_with_buffers_restored(bad: int, failure: str) -> None:
    inject, message = FAILURES[failure]
    side = torch.zeros(4)
    compute = WeightedSum()

    def fn(step: Step) -> torch.Tensor:
        out = compute(step)
        if step.graph is not None and step.size == bad:
            inject(step, side)
        return out

    bufs = make_buffers()
    bufs.refresh(8, make_batch(8, np.random.default_rng(bad)))
    slab = bufs.slab.numpy().tobytes()
    runner = GraphRunner(bufs, fn, output_rows="requests")
    with pytest.raises(CaptureError, match=rf"capture at size {bad} .*failed: {message}"):
        runner.capture()
    assert modes_installed() == (0, 0)
    assert torch.equal(side, torch.zeros(4))
    assert bufs.slab.numpy().tobytes() == slab, "a failed capture left bytes in the buffers"
    assert runner.stats.capture_failures == {}


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("bad", SIZES)
def test_capture_failure_at_one_size_is_isolated_with_eager_fallback(
    bad: int, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    inject, message = FAILURES[failure]
    side = torch.zeros(4)
    compute = WeightedSum()

    def fn(step: Step) -> torch.Tensor:
        out = compute(step)
        if step.graph is not None and step.size == bad:
            inject(step, side)
        return out

    bufs = make_buffers()
    rng = np.random.default_rng(bad)
    bufs.refresh(8, make_batch(8, rng))
    slab = bufs.slab.numpy().tobytes()
    runner = GraphRunner(bufs, fn, output_rows="requests", on_capture_error="eager")
    with caplog.at_level("WARNING", logger="graphbuf.graphs.runner"):
        runner.capture()
    warned = [r for r in caplog.records if r.name == "graphbuf.graphs.runner"]
    assert len(warned) == 1 and f"capture at size {bad} failed" in warned[0].getMessage()

    assert runner.captured_sizes == tuple(s for s in SIZES if s != bad)
    assert list(runner.stats.capture_failures) == [bad]
    assert message in runner.stats.capture_failures[bad]
    assert modes_installed() == (0, 0)
    assert torch.equal(side, torch.zeros(4)), "the failed capture's write to a pre-existing tensor stayed"
    assert bufs.slab.numpy().tobytes() == slab

    for size in SIZES:  # one batch that lands on each size, then one above the largest
        src = make_batch(size, rng)
        torch.testing.assert_close(runner.run(src), expected(src), rtol=0, atol=0)
    src = make_batch(9, rng)
    torch.testing.assert_close(runner.run(src), expected(src), rtol=0, atol=0)
    assert runner.stats.replays == len(SIZES) - 1
    assert bad not in runner.stats.replays_by_size
    assert runner.stats.eager_reasons == {EAGER_CAPTURE_FAILED: 1, EAGER_TOO_LARGE: 1}
    # No op of the failed attempt leaked into another size's graph: replays never touched `side`.
    assert torch.equal(side, torch.zeros(4))

    # A later, unrelated capture on this thread works.
    x, y = torch.ones(3), torch.empty(3)
    g = Graph("cpu")
    with g.capture():
        y.copy_(x * 2)
    x.fill_(5)
    g.replay()
    assert y.tolist() == [10.0, 10.0, 10.0]
    assert modes_installed() == (0, 0)


@pytest.mark.parametrize("where", ["body", "task"])
def test_failed_graph_capture_leaves_the_graph_empty_and_recapturable(where: str) -> None:
    x = torch.arange(4.0)
    out = torch.zeros(4)
    g = Graph("cpu")
    with pytest.raises(RuntimeError, match="boom"), g.capture():
        out.copy_(x + 1)
        if where == "task":
            g.task("custom", _boom_task, x)
        raise RuntimeError("boom in the body")
    assert (g.captured, g.capturing, g.tasks) == (False, False, ())
    assert modes_installed() == (0, 0)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and out.tolist() == [0.0] * 4  # restored
    with pytest.raises(CaptureError, match="before a completed capture"):
        g.replay()

    with g.capture():  # the same graph captures again
        out.copy_(x * 10)
    x.add_(1)
    g.replay()
    assert out.tolist() == [10.0, 20.0, 30.0, 40.0]


# ------------------------------------------------------------------------------ rebound buffers


def _set_new_storage(bufs: StaticBuffers) -> tuple[str, int]:
    bufs.view(4)["seq_lens"].set_(torch.zeros(4, dtype=torch.int32))
    return "seq_lens", 4


def _set_shifted(bufs: StaticBuffers) -> tuple[str, int]:
    v = bufs.view(4)["seq_lens"]
    v.set_(v.untyped_storage(), v.storage_offset() + 1, v.shape, v.stride())
    return "seq_lens", 4


def _resize_rows(bufs: StaticBuffers) -> tuple[str, int]:
    bufs.view(8)["block_table"].resize_(4, WIDTH)
    return "block_table", 8


def _resize_1d(bufs: StaticBuffers) -> tuple[str, int]:
    bufs.view(4)["seq_lens"].resize_(2)
    return "seq_lens", 4


def _transpose_in_place(bufs: StaticBuffers) -> tuple[str, int]:
    # Same address and shape (the view is square), other strides: the emulator would read it transposed.
    bufs.view(8)["block_table"].t_()
    return "block_table", 8


@pytest.mark.parametrize(
    "rebind",
    [_set_new_storage, _set_shifted, _resize_rows, _resize_1d, _transpose_in_place],
    ids=["set_-new-storage", "set_-shifted-offset", "resize_-fewer-rows", "resize_-1d", "t_-same-shape"],
)
def test_rebound_buffer_is_caught_before_every_replay(
    rebind: Callable[[StaticBuffers], tuple[str, int]],
) -> None:
    bufs = make_buffers()
    runner = GraphRunner(bufs, WeightedSum(), output_rows="requests")
    runner.capture()
    rng = np.random.default_rng(1)
    src = make_batch(3, rng)
    torch.testing.assert_close(runner.run(src), expected(src), rtol=0, atol=0)
    name, size = rebind(bufs)
    replays = runner.stats.replays
    slab = bufs.slab.numpy().tobytes()
    for _ in range(3):
        with pytest.raises(AddressChangedError, match=rf"buffer '{name}' at size {size} moved: captured at"):
            runner.run(make_batch(size, rng))
    assert runner.stats.replays == replays  # caught before replay, every time
    assert bufs.slab.numpy().tobytes() == slab  # ... and before any refresh byte was written
    other = next(s for s in SIZES if s != size)
    src = make_batch(other, rng)
    torch.testing.assert_close(runner.run(src), expected(src), rtol=0, atol=0)


# ---------------------------------------------------------------------------- long runs vs eager


def _long_run(device: str, steps: int, busy: int = 0) -> None:
    """``steps`` runs with fresh host data each (sizes 1..10: replays and eager), no sync in between;
    every kept output must equal the host computation of its own batch."""
    bufs = make_buffers(device)
    rng = np.random.default_rng(2024)
    bufs.refresh(8, make_batch(8, rng))
    runner = GraphRunner(bufs, WeightedSum(device, busy), output_rows="requests")
    runner.capture()
    assert runner.captured_sizes == SIZES
    kept: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for _ in range(steps):
        src = make_batch(int(rng.integers(1, 11)), rng)
        kept.append(runner.run(src).clone())  # on cuda: stream-ordered, no host sync
        want.append(expected(src))
    assert runner.stats.replays > steps // 2 and runner.stats.eager > 0
    bad = [i for i, (g, w) in enumerate(zip(kept, want)) if not torch.equal(g.cpu(), w)]
    assert bad == [], f"{len(bad)} of {steps} steps differ from eager; first: {bad[:10]}"


def test_long_run_of_rapid_refreshes_matches_eager_on_cpu() -> None:
    _long_run("cpu", steps=500)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_long_run_of_rapid_refreshes_matches_eager_on_cuda() -> None:
    # Double-buffered pinned staging: the host races ahead of a busy stream; no upload may be overwritten.
    _long_run("cuda", steps=500, busy=4)
    torch.cuda.synchronize()


# ------------------------------------------------------------------- vLLM plugin, unsupported version

FAKE_ROOT = Path(__file__).resolve().parents[2] / "tests" / "helpers" / "fake_vllm_ascend"
PLUGIN_SCRIPT = r"""
import json, logging, sys
fake_root, version, import_first, miss = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
sys.path.insert(0, fake_root)
import importlib
for name in ("forward_context", "config", "kv_cache_interface"):  # vLLM's modules the surface reads
    sys.modules[{"kv_cache_interface": "vllm.v1.kv_cache_interface"}.get(name, "vllm." + name)] = (
        importlib.import_module("fake_vllm." + name)
    )
records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelno, record.getMessage()))

logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.DEBUG)
import vllm_ascend
vllm_ascend.__version__ = version
IMPL, BUILDER = "AscendAttentionBackendImpl", "AscendAttentionMetadataBuilder"
TARGETS = ((IMPL, "forward_impl"), (IMPL, "update_graph_params"), (BUILDER, "build"))
if miss:  # an upstream that renamed update_graph_params: a surface miss
    import vllm_ascend.attention.attention_v1 as av1
    delattr(getattr(av1, IMPL), "update_graph_params")
    TARGETS = TARGETS[::2]
before = None
if import_first:
    import vllm_ascend.attention.attention_v1 as av1
    before = {f"{c}.{m}": getattr(av1, c).__dict__[m] for c, m in TARGETS}
from graphbuf.adapters.vllm_ascend.glue import patch, plugin
plugin._probe_npu = lambda: (True, "an NPU, faked by the test")
plugin.register()
plugin.register()
register_warnings = [m for level, m in records if level >= logging.WARNING]
again = plugin.activate()
import vllm_ascend.attention.attention_v1 as av1
after = {f"{c}.{m}": getattr(av1, c).__dict__[m] for c, m in TARGETS}
def original(key, value):
    func = getattr(value, "__func__", value)
    if before is not None:
        return value is before[key]
    return func.__code__.co_filename == av1.__file__ and not hasattr(func, "__wrapped__")
print("RESULT " + json.dumps({
    "decision": plugin.decision(),
    "again": again,
    "warnings": register_warnings,
    "originals": {k: original(k, v) for k, v in after.items()},
    "marked": [c for c, _ in TARGETS if "_graphbuf_originals" in getattr(av1, c).__dict__],
    "patched": patch.is_patched(av1),
    "hook": any(isinstance(f, patch._PatchOnImport) for f in sys.meta_path),
    "torch_npu": "torch_npu" in sys.modules,
}))
"""


def _has_vllm_ascend_distribution() -> bool:
    try:
        importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _plugin_run(tmp_path: Path, version: str, import_first: bool, miss: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHBUF_VLLM_ASCEND_DISABLE", "PYTHONPATH")}
    argv = [str(FAKE_ROOT), version, "1" if import_first else "0", "1" if miss else "0"]
    proc = subprocess.run(
        [sys.executable, "-c", PLUGIN_SCRIPT, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.skipif(
    _has_vllm_ascend_distribution(), reason="an installed vllm-ascend reports its own version"
)
@pytest.mark.parametrize(("version", "import_first"), [("0.22.1", True), ("0.27.0rc1", False)])
def test_an_upstream_surface_miss_gets_one_warning_and_no_patch(
    tmp_path: Path, version: str, import_first: bool
) -> None:
    """Activation is decided by the upstream surface, not the version string: a renamed method leaves the
    plugin inactive (one warning per process naming the miss and the version), nothing patched."""
    result = _plugin_run(tmp_path, version, import_first, miss=True)
    assert result["decision"].startswith(f"inactive: vllm-ascend {version}: ")
    assert "update_graph_params" in result["decision"]
    assert result["again"] == result["decision"]
    [warning] = result["warnings"]
    assert f"inactive on vllm-ascend {version}" in warning and "update_graph_params" in warning
    assert all(result["originals"].values()), result["originals"]
    assert result["marked"] == [] and result["patched"] is False
    assert result["hook"] is False and result["torch_npu"] is False


@pytest.mark.skipif(
    _has_vllm_ascend_distribution(), reason="an installed vllm-ascend reports its own version"
)
@pytest.mark.parametrize(
    ("version", "import_first"), [("0.22.1", True), ("0.19.1rc2.dev1637+g182b75ea8", False)]
)
def test_a_version_string_alone_never_refuses(tmp_path: Path, version: str, import_first: bool) -> None:
    """Versions the old allow-list refused (an old release, a git checkout of main) activate when the
    surface holds; the version is only logged."""
    result = _plugin_run(tmp_path, version, import_first, miss=False)
    assert result["decision"].startswith(f"active: vllm-ascend {version}"), result["decision"]
    assert result["warnings"] == []

"""Staged writes against full refreshes (issue 22 §2): after any sequence of decode steps (joins, growth
across block boundaries, finishes, condensing row moves, swaps), staged commits mixed with full refreshes
of the same buffers, and rejected commits, the captured buffers hold byte for byte what a full refresh of
the same final host state writes. In place and staged, native kernels and Python/numpy; on CUDA (staged
writes on the device against full refreshes on the cpu) when a device is there."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from graphbuf import StaticBuffers
from graphbuf.buffers import native
from graphbuf.errors import RefreshError
from graphbuf.testing import DecodeBatch, next_step, stage_writes

pytestmark = pytest.mark.backends_compared  # compares the backends itself (conftest)

SPEC = "gemma4-31b-it-mtp"
OVERRIDES = {"num_blocks": 64, "block_size": 16}  # blocks of 16: a step crosses boundaries often
KERNEL = native.KERNEL
NAMES = {"slots": "slot_mapping", "offsets": "query_start_loc"}


class StagedVsFull(RuleBasedStateMachine):
    staging: int | None = None
    kernel: Any = None  # the native kernel, or None: the numpy backend
    device: str = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._saved = native.KERNEL
        native.KERNEL = self.kernel
        # staged writes (on self.device), full refreshes (on the cpu)
        self.a = StaticBuffers(SPEC, overrides=OVERRIDES, upload_copies=self.staging, device=self.device)
        cpu_staging = self.staging if self.device == "cpu" else None
        self.b = StaticBuffers(SPEC, overrides=OVERRIDES, upload_copies=cpu_staging)
        self.batch = DecodeBatch(self.a, **NAMES)
        self.stageable = [n for n in self.a.names if n != "query_start_loc"]
        self.steps = 0

    def teardown(self) -> None:
        native.KERNEL = self._saved

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        batch = self.batch
        writes = batch.advance(data.draw(next_step(batch, max_join=6), label="step"))
        whole = {
            n
            for n in self.stageable
            if not self.a.stage(n).pending and data.draw(st.booleans(), label=f"{n} whole")
        }
        stage_writes(self.a, [w for w in writes if w[0] not in whole])
        need = batch.size_for()
        size = data.draw(st.sampled_from([s for s in self.a.capture_sizes if s >= need]), label="size")
        full = batch.sources()
        given = {n: s for n, s in full.items() if n in whole or n not in self.stageable}
        assert self.a.refresh(size, given, num_reqs=batch.live) == batch.live
        self.b.refresh(size, full, num_reqs=batch.live)
        self.steps += 1

    @precondition(lambda self: self.batch.live > 0)
    @rule(data=st.data())
    def rejected(self, data: st.DataObject) -> None:
        batch = self.batch
        name = data.draw(st.sampled_from(["block_table.full", "seq_lens"]), label="bad buffer")
        h = self.a.stage(name)
        row = data.draw(st.integers(0, batch.live - 1), label="bad row")
        if h.host.ndim == 2:
            col = data.draw(st.integers(0, h.host.shape[1] - 1), label="bad col")
            old, bad = h.host[row, col].copy(), np.array([64], np.int32)
            h.set(row, bad, col=col)
        else:
            col, old, bad = None, h.host[row].copy(), np.array([5501], np.int32)
            h.set(row, bad)
        before = self.a.slab.clone()
        stats = self.a.stats
        size = self.batch.size_for()
        others = {n: s for n, s in batch.sources().items() if n not in self.stageable}
        with pytest.raises(RefreshError) as got:
            self.a.refresh(size, others, num_reqs=batch.live)
        assert self.a.slab.equal(before) and self.a.stats == stats
        assert h.pending
        # A full refresh of the same host state raises the same error with the same message.
        full = batch.sources()
        if col is None:
            full[name] = full[name].copy()
            full[name][row] = bad[0]
        else:
            full[name][row, col] = bad[0]
        with pytest.raises(RefreshError) as want:
            self.b.refresh(size, full, num_reqs=batch.live)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
        # Fix it: the writes stay staged; stage the old value back over the bad one.
        if col is None:
            h.set(row, old.reshape(1))
        else:
            h.set(row, old.reshape(1), col=col)

    @invariant()
    def same_bytes(self) -> None:
        if not self.steps:
            return
        for name in self.a.names:
            got, want = self.a.full[name].cpu(), self.b.full[name]
            assert got.numpy().tobytes() == want.numpy().tobytes(), (name, got, want)


def _machine(staging: int | None, path: str, device: str = "cpu") -> type[StagedVsFull]:
    """``path``: "native" or "numpy", the backend both buffers are built with."""
    if path != "numpy" and KERNEL is None:
        pytest.skip("the native kernels are not built here")
    kernel = KERNEL if path != "numpy" else None
    return type("M", (StagedVsFull,), {"staging": staging, "kernel": kernel, "device": device})


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
@pytest.mark.parametrize("path", ["native", "numpy"])
def test_staged_writes_match_full_refreshes(staging: int | None, path: str) -> None:
    machine = _machine(staging, path)
    machine.TestCase.settings = settings(max_examples=12, stateful_step_count=20, deadline=None)
    machine.TestCase().runTest()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["native", "numpy"])
def test_staged_writes_on_cuda_match_full_refreshes_on_the_cpu(path: str) -> None:
    machine = _machine(2, path, "cuda")
    machine.TestCase.settings = settings(max_examples=12, stateful_step_count=20, deadline=None)
    machine.TestCase().runTest()

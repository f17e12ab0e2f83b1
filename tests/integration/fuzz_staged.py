"""Differential fuzzer of staged writes (issue 35 §1), with a fixed seed.

Twin ``StaticBuffers`` of one spec, one with the native host state (``graphbuf.buffers._staged``, where
built) and one with the Python host state, take the same random staged writes and refreshes. Arguments come
as lists, numpy arrays of several dtypes, torch tensors, views of the handle's own host state (aliasing) and
arrays the caller changes right after the call (reuse); about a third are faulty (rows or columns outside
the allocation, floats, bools, values past the dtype or past ``max``). After every call:

* both twins raised the same error type and message, or neither did;
* host state, lengths, pending flag and changed cells are equal byte for byte, and equal to what the
  arguments said at the call (a reused array never reaches them);
* after a refresh every buffer is equal on both twins, and so are the byte counts.

A thread phase per twin runs staged writes in a second thread while the main thread refreshes: every call
either completes or raises ``ConcurrentUseError``; the host state then equals a serial replay of the writes
that completed, and after a final refresh so does the slab.

Run: ``python tests/integration/fuzz_staged.py [--steps N] [--seed S] [--deep]`` (``--deep``: ten times the
steps). Exit status 1 with the failing step printed on the first violation.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from graphbuf import GraphbufError, StaticBuffers
from graphbuf.buffers import native
from graphbuf.buffers.staged import changed_cells

STEPS = 400
SPEC = "gemma4-31b-it-mtp"
BT, LENS, SM = "block_table.full", "seq_lens", "slot_mapping.full"
STAGED = (BT, LENS, SM, "block_table.sliding", "slot_mapping.sliding")
QSL = "query_start_loc"
OPS = ("set", "append", "set_row", "clear_row", "move_row", "swap_rows", "scatter")


class Violation(AssertionError):
    pass


def twins(staging: int | None) -> tuple[StaticBuffers, StaticBuffers]:
    """(native, python) buffers with every staged-able buffer staged."""
    saved = native.KERNEL
    out = []
    try:
        for kernel in (saved, None):
            native.KERNEL = kernel
            b = StaticBuffers(SPEC, overrides={"num_blocks": 64}, upload_copies=staging)
            for name in STAGED:
                b.stage(name)
            out.append(b)
    finally:
        native.KERNEL = saved
    return out[0], out[1]


#: Faults of an index (refused at the call) and of a value (refused at the call, or past ``max``: refused by
#: the refresh that would commit it, until :func:`_repair` stages a valid value over it).
BAD_INDEX = (-1, "hi", 2**63, 2**64, 1.5, True, "1", float("nan"))
BAD_VALUE = (2**64, 1.5, True, "1", float("nan"), 10**6)


def _ints(rng: np.random.Generator, k: int, hi: int, bad: tuple[Any, ...] | None) -> list[Any]:
    vals: list[Any] = [int(x) for x in rng.integers(0, hi, k)]
    if bad and k:
        v = bad[int(rng.integers(len(bad)))]
        vals[int(rng.integers(k))] = hi if v == "hi" else v
    return vals


def _form(rng: np.random.Generator, vals: list[Any], dtype: Any) -> tuple[str, Any]:
    """One way of passing ``vals``: (form, a factory taking the handle, so aliasing views are per twin)."""
    form = str(rng.choice(["list", "array", "tensor", "reused", "alias"]))
    if form == "alias":
        return form, vals
    try:
        arr = np.array(vals, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        return "list", vals
    if form == "tensor" and arr.dtype.kind in "iuf":
        return form, arr
    return form if form in ("array", "reused") else "list", vals if form == "list" else arr


def _materialize(form: str, raw: Any, h: Any, k: int, flat: bool) -> Any:
    if form == "list":
        return list(raw)
    if form == "tensor":
        return torch.from_numpy(np.array(raw))
    if form in ("array", "reused"):
        return np.array(raw)
    host = h.host.reshape(-1) if flat else h.host[0]
    return host[:k]  # a read-only view of the host state itself


def one_write(
    rng: np.random.Generator, name: str, h: Any
) -> tuple[str, list[tuple[str, Any]], dict[str, Any]]:
    """A random write: (op, [(form, raw) per array argument or ("int", value)], kwargs)."""
    rows, wide = h.host.shape[0], h.host.ndim == 2
    width = h.host.shape[1] if wide else 1
    bad = rng.random() < 0.3

    def fault(kind: tuple[Any, ...], p: float) -> tuple[Any, ...] | None:
        return kind if bad and rng.random() < p else None

    op = str(rng.choice(OPS if wide else [o for o in OPS if o != "append"]))
    hi_val = _limit(name)
    if op in ("clear_row", "move_row", "swap_rows"):
        n = 1 if op == "clear_row" else 2
        return op, [("int", v) for v in _ints(rng, n, rows, fault(BAD_INDEX, 1))], {}
    if op == "scatter":
        k = int(rng.integers(0, 6))
        args = [_form(rng, _ints(rng, k, rows, fault(BAD_INDEX, 0.4)), np.int64),
                _form(rng, _ints(rng, k, hi_val, fault(BAD_VALUE, 0.3)), h.host.dtype)]  # fmt: skip
        kw = {}
        if wide:
            kw["cols"] = _form(rng, _ints(rng, k, width, fault(BAD_INDEX, 0.4)), np.int64)
        return op, args, kw
    k = int(rng.integers(0, 4 if wide else 3))
    vals = _ints(rng, k, hi_val, fault(BAD_VALUE, 0.5))
    row = _ints(rng, 1, rows - (0 if wide else k), fault(BAD_INDEX, 0.3))[0]
    if op == "set_row" and not wide:
        vals = vals[:1] or [0]
    args = [("int", row), _form(rng, vals, h.host.dtype)]
    kw = {}
    if op == "set" and wide:
        kw["col"] = (
            "int",
            int(rng.integers(0, width - k + 1)) if not bad else int(rng.integers(-1, width + 1)),
        )
    return op, args, kw


def _call(b: StaticBuffers, name: str, op: str, args: list[tuple[str, Any]], kw: dict[str, Any]) -> str:
    try:
        h = b.stage(name)  # guarded too: refused while another thread refreshes (the thread phase)
    except GraphbufError as exc:
        return f"{type(exc).__name__}: {exc}"
    wide = h.host.ndim == 2
    made: list[Any] = []
    pos = []
    for i, (form, raw) in enumerate(args + list(kw.values())):
        if form == "int":
            v = raw
        else:
            v = _materialize(form, raw, h, len(raw), flat=not wide or op == "scatter" or i > 0)
            made.append((form, v))
        pos.append(v)
    call_kw = dict(zip(kw, pos[len(args) :]))
    try:
        getattr(h, op)(*pos[: len(args)], **call_kw)
        out = "ok"
    except GraphbufError as exc:
        out = f"{type(exc).__name__}: {exc}"
    for form, v in made:  # the caller reuses its arrays at once: nothing must reach the host state
        if form == "reused" and isinstance(v, np.ndarray) and v.size:
            v[...] = -1 if v.dtype.kind == "i" else 0
    return out


def _state(b: StaticBuffers, name: str) -> tuple[Any, ...]:
    h = b.stage(name)
    lens = h.lengths.tobytes() if h.host.ndim == 2 else b""
    return h.host.tobytes(), lens, h.pending, sorted(changed_cells(h).tolist())


def _same_buffers(a: StaticBuffers, b: StaticBuffers) -> bool:
    """Every buffer's bytes equal (the slab's alignment gaps are never written)."""
    return all(a.full[n].numpy().tobytes() == b.full[n].numpy().tobytes() for n in a.names)


def _refresh(b: StaticBuffers, n: int, whole: str | None) -> str:
    src: dict[str, Any] = {QSL: np.arange(0, 4 * n + 1, 4, dtype=np.int32)}
    if whole is not None:
        shape = (n, 43) if whole.startswith("block") else (n * 4 if whole.startswith("slot") else n,)
        src[whole] = np.ones(shape, dtype=b.full[whole].numpy().dtype)
    size = next(s for s in b.capture_sizes if s >= 4 * n)
    try:
        b.refresh(size, src, num_reqs=n)
        return "ok"
    except GraphbufError as exc:
        return f"{type(exc).__name__}: {exc}"


def run(steps: int, seed: int, log: Callable[[str], None]) -> dict[str, int]:
    """The fuzz; returns counts of what it exercised (writes accepted and refused, refreshes)."""
    rng = np.random.default_rng(seed)
    counts = {"writes ok": 0, "writes refused": 0, "refreshes ok": 0, "refreshes refused": 0}
    for staging in (None, 2):
        a, b = twins(staging)
        for step in range(steps):
            if rng.random() < 0.2:
                n = int(rng.integers(0, 17))
                whole = str(rng.choice(STAGED)) if rng.random() < 0.2 else None
                ra, rb = _refresh(a, n, whole), _refresh(b, n, whole)
                if ra != rb:
                    raise Violation(
                        f"staging={staging} step {step}: refresh({n}) native {ra!r} python {rb!r}"
                    )
                if not _same_buffers(a, b) or a.stats != b.stats:
                    raise Violation(f"staging={staging} step {step}: refresh({n}): slabs differ")
                counts["refreshes ok" if ra == "ok" else "refreshes refused"] += 1
                if ra != "ok" and rng.random() < 0.5:
                    _repair(a)
                    _repair(b)
                continue
            name = str(rng.choice(STAGED))
            op, args, kw = one_write(rng, name, a.stage(name))
            ra, rb = _call(a, name, op, args, kw), _call(b, name, op, args, kw)
            counts["writes ok" if ra == "ok" else "writes refused"] += 1
            if ra != rb or _state(a, name) != _state(b, name):
                raise Violation(
                    f"staging={staging} step {step}: {name}.{op}{args} {kw}: native {ra!r} python {rb!r}"
                    + ("" if ra != rb else ": host states differ")
                )
        log(f"fuzz_staged: staging={staging}: {steps} steps, twins agree")
        for twin, label in ((a, "native"), (b, "python")):
            threaded(twin, rng, steps // 4, label)
        log(f"fuzz_staged: staging={staging}: thread phase holds on both host states")
    log(f"fuzz_staged: {counts}")
    return counts


def _limit(name: str) -> int:
    """Valid staged values of ``name`` lie in ``0..limit - 1`` (within its ``min``/``max``)."""
    return 4000 if name == SM else 60


def _repair(b: StaticBuffers) -> None:
    """Stage 0 over every host value past its buffer's limit, so the next refresh can commit."""
    for name in STAGED:
        h = b.stage(name)
        flat = np.flatnonzero((h.host.reshape(-1) >= _limit(name)) | (h.host.reshape(-1) < -1))
        if not flat.size:
            continue
        zeros = np.zeros(flat.size, h.host.dtype)
        if h.host.ndim == 2:
            h.scatter(flat // h.host.shape[1], zeros, flat % h.host.shape[1])
        else:
            h.scatter(flat, zeros)


def threaded(b: StaticBuffers, rng: np.random.Generator, count: int, label: str) -> None:
    """Staged writes in a second thread while this one refreshes; then a serial replay must agree."""
    _repair(b)
    if (out := _refresh(b, 16, None)) != "ok":
        raise Violation(f"{label}: thread phase: the commit before it failed: {out}")
    # Both start from one host state: every buffer given whole (lengths: the full width of live rows).
    src = {name: b.full[name][: 17 if name == QSL else 64 if name.startswith("slot") else 16].numpy().copy()
           for name in b.names}  # fmt: skip
    replay = StaticBuffers(SPEC, overrides={"num_blocks": 64}, upload_copies=b.upload_copies)
    for name in STAGED:
        replay.stage(name)
    for buf in (b, replay):
        buf.refresh(64, src, num_reqs=16)
    plan = []
    for _ in range(count):
        name = str(rng.choice(STAGED))
        op, args, kw = one_write(rng, name, b.stage(name))
        plan.append((name, op, args, kw))
    done: list[int] = []

    def writer() -> None:
        for i, (name, op, args, kw) in enumerate(plan):
            if not _call(b, name, op, args, kw).startswith("ConcurrentUseError"):
                done.append(i)

    t = threading.Thread(target=writer)
    t.start()
    while t.is_alive():
        _refresh(b, 16, None)  # refused while the writer holds the guard, or for a value past max
        time.sleep(0)
    t.join()
    for i in done:
        _call(replay, *plan[i])
    for name in STAGED:
        if _state(b, name)[:2] != _state(replay, name)[:2]:
            raise Violation(f"{label}: thread phase: {name}: host state differs from a serial replay")
    for buf in (b, replay):
        _repair(buf)
    ra, rb = _refresh(b, 16, None), _refresh(replay, 16, None)
    if ra != rb or ra != "ok":
        raise Violation(f"{label}: thread phase: final refresh {ra!r} vs replay {rb!r}")
    for name in b.names:
        if not torch.equal(b.full[name], replay.full[name]):
            raise Violation(f"{label}: thread phase: {name}: slab differs from a serial replay")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deep", action="store_true", help="ten times the steps")
    args = ap.parse_args(argv)
    if native.KERNEL is None:
        print("fuzz_staged: the staged-write kernel is not built here; nothing to compare", file=sys.stderr)
        return 0
    try:
        run(args.steps * (10 if args.deep else 1), args.seed, print)
    except Violation as exc:
        print(f"fuzz_staged: VIOLATION: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

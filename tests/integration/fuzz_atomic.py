"""Atomicity fuzzer of ``StaticBuffers.refresh`` (issue 21 §5), with a fixed seed.

Twin slabs of one spec take the same sequence of refreshes: one through the native kernel (when built), one
through the numpy path (``native.KERNEL = None``). Sources come as a mapping (numpy arrays, torch tensors,
lists) or bound once (numpy or torch, refreshed by request count and widths); slabs are written in place or
through upload copies (``upload_copies=2``); some slabs start poisoned. About a third of the refreshes carry
one fault that must be rejected (a value past ``min``/``max``, a NaN, a width past a ``reject`` allocation, a
float into an integer buffer, an unknown name, a live count past the size). After every call, over the WHOLE
slab:

* a rejected refresh changed no byte, on either twin, and both twins raised the same error;
* an accepted one left every buffer equal to the oracle (:func:`slab_oracle.expected_buffer`: live cells,
  pad, ``repeat_last`` rows) and every byte outside the buffers unchanged, and both twins agree on the bytes
  and the byte count.

Run: ``python tests/integration/fuzz_atomic.py [--steps N] [--seed S] [--deep]`` (``--deep``: ten times the
steps).
Exit status 1 with the failing step printed on the first violation.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: conftest's shared spec
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # the oracle, the paged spec

from conftest import SMALL_SPEC
from paged_spec import PAGED_SPEC
from pins import numpy_path, twins
from slab_oracle import expected_buffer

from graphbuf import GraphbufError, GraphSpec, StaticBuffers
from graphbuf.buffers import native
from graphbuf.planning.planner import BufferPlan, Plan

STEPS = 300  # per (spec, mode) at the default profile; --deep: 10x

#: A spec with every dtype family, both overflow rules, fixed rows, ``repeat_last`` 1-D and 2-D, NaN pads.
DTYPES_SPEC: dict[str, Any] = {
    "version": 1,
    "name": "fuzz-dtypes",
    "constants": {"max_num_seqs": 6, "width": 5},
    "capture": {"tokens_per_request": 1, "sizes": [1, 3, 6]},
    "buffers": {
        "u8": {"dtype": "uint8", "rows": "requests", "max": 200, "pad": 200},
        "i8": {"dtype": "int8", "rows": "requests", "cols": 2, "min": -100, "max": 100, "pad": -100},
        "i16": {"dtype": "int16", "rows": "tokens + 1", "pad": "repeat_last", "min": 0},
        "fixed": {"dtype": "int32", "rows": 3, "pad": 7},
        "i64": {"dtype": "int64", "rows": "requests", "cols": "width", "pad": "repeat_last",
                "overflow": "truncate", "min": -5},
        "bt": {"dtype": "int32", "rows": "requests", "cols": "width", "min": 0, "max": 99, "pad": 0},
        "bf": {"dtype": "bfloat16", "rows": "requests", "cols": 3, "pad": 0.5},
        "f16": {"dtype": "float16", "rows": "requests", "pad": float("nan")},
        "f32": {"dtype": "float32", "rows": "tokens", "cols": 2, "pad": -1.5, "overflow": "truncate"},
        "b": {"dtype": "bool", "rows": "requests", "pad": True},
        "scratch": {"dtype": "float64", "rows": 2, "keep": True, "pad": 0.0},
    },
}  # fmt: skip

SPECS = {"small": SMALL_SPEC, "paged": PAGED_SPEC, "dtypes": DTYPES_SPEC}


@dataclass
class Mode:
    bound: bool
    staging: int | None
    poison: bool

    def __str__(self) -> str:
        return (
            f"{'bound' if self.bound else 'mapping'}/{'staged' if self.staging else 'in-place'}"
            f"{'/poison' if self.poison else ''}"
        )


def _np_dtype(b: BufferPlan) -> np.dtype:
    if b.dtype == torch.bfloat16:
        return np.dtype(np.int8)  # what a numpy source of a bfloat16 buffer may be: exact, safe
    return torch.empty(0, dtype=b.dtype).numpy().dtype


def _value_range(b: BufferPlan) -> tuple[int, int] | None:
    """The integer values a valid source may hold (None: a float buffer)."""
    dt = _np_dtype(b)
    if dt.kind == "f":
        return None
    if dt.kind == "b":
        return (0, 1)
    info = np.iinfo(dt)
    lo, hi = max(int(info.min), -1000), min(int(info.max), 1000)
    if b.min is not None:
        lo = max(lo, b.min)
    if b.max is not None:
        hi = min(hi, b.max)
    return lo, hi


def _values(rng: np.random.Generator, b: BufferPlan, shape: tuple[int, ...]) -> np.ndarray:
    dt = _np_dtype(b)
    r = _value_range(b)
    if r is None:
        return (rng.standard_normal(shape) * 100).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(r[0], r[1] + 1, shape).astype(dt)


def _spoilable(b: BufferPlan, dt: np.dtype) -> bool:
    """A bound inside the dtype's range: a value past it is a fault the dtype can hold."""
    info = np.iinfo(dt)
    return (b.min is not None and b.min > int(info.min)) or (b.max is not None and b.max < int(info.max))


class Twins:
    """One spec's kernel and numpy slabs, and what each call must leave."""

    def __init__(self, spec: dict[str, Any], mode: Mode, rng: np.random.Generator) -> None:
        self.spec = GraphSpec.model_validate(copy.deepcopy(spec))
        self.mode = mode
        self.rng = rng
        self.kern, self.nump = twins(self.spec, poison=mode.poison, upload_copies=mode.staging)
        self.plan: Plan = self.kern.plan
        self.tpr = self.plan.tokens_per_request
        self.sizes = self.plan.capture_sizes
        self.in_buffers = np.zeros(self.plan.total_bytes, dtype=bool)
        for b in self.plan.buffers:
            self.in_buffers[b.offset : b.offset + b.nbytes] = True
        self.persist: dict[str, np.ndarray] = {}
        self.bound_k = self.bound_n = None
        if mode.bound:
            for b in self.plan.buffers:
                if b.keep:
                    continue
                rows = b.shape[0] + 2  # longer than any capture reads
                shape = (rows, b.shape[1] + 2) if b.ndim == 2 else (rows,)
                self.persist[b.name] = _values(rng, b, shape)
            srcs: dict[str, Any] = {
                k: (torch.from_numpy(v) if rng.random() < 0.5 else v) for k, v in self.persist.items()
            }
            self.bound_k = self.kern.bind(srcs)
            with numpy_path():
                self.bound_n = self.nump.bind(srcs)

    # ------------------------------------------------------------------------------------------------

    def rows(self, b: BufferPlan, n: int) -> int:
        return b.rows.eval({**self.plan.constants, "requests": n, "tokens": n * self.tpr})

    def step(self, fault: str | None) -> tuple[Any, dict[str, Any], str]:
        """Draw one call: (sources or bound, refresh kwargs, description); the live cells it implies are
        kept in ``self.live`` (name -> array) for the oracle."""
        rng = self.rng
        size = int(rng.choice(self.sizes))
        n = int(rng.integers(0, size // self.tpr + 1))
        self.live: dict[str, np.ndarray] = {}
        self.size = size
        kwargs: dict[str, Any] = {}
        if self.mode.bound:
            widths: dict[str, int] = {}
            for b in self.plan.buffers:
                if b.keep:
                    continue
                arr = self.persist[b.name]
                arr[...] = _values(rng, b, arr.shape)  # the persistent buffer's new contents, in place
                rows = self.rows(b, n)
                if b.ndim == 2:
                    cap = self.plan.shape_at(b, size)[1]
                    w = int(rng.integers(0, cap + 1)) if rng.random() < 0.7 else arr.shape[1]
                    if w != arr.shape[1] or rng.random() < 0.5:
                        widths[b.name] = w
                    live_w = min(w, cap)
                    self.live[b.name] = arr[:rows, :live_w].copy()
                    if w > cap and b.overflow == "reject" and fault is None:
                        widths[b.name] = cap
                        self.live[b.name] = arr[:rows, :cap].copy()
                else:
                    self.live[b.name] = arr[:rows].copy()
            kwargs = {"num_reqs": n, "widths": widths or None}
            desc = f"bound size={size} n={n} widths={widths}"
            if fault is not None:
                desc += " " + self._bound_fault(fault, size, n, kwargs)
            return "bound", kwargs, desc
        sources: dict[str, Any] = {}
        for b in self.plan.buffers:
            if b.keep and rng.random() < 0.5:
                continue
            rows = self.rows(b, n) if not b.keep else int(rng.integers(0, b.shape[0] + 1))
            if b.keep and b.rows.names & {"requests", "tokens"}:
                rows = self.rows(b, n)
            if b.ndim == 2:
                cap = self.plan.shape_at(b, size)[1]
                hi = cap + (2 if b.overflow == "truncate" else 0)
                w = int(rng.integers(0, hi + 1))
                arr = _values(rng, b, (rows, w))
                self.live[b.name] = arr[:, : min(w, cap)]
            else:
                arr = _values(rng, b, (rows,))
                self.live[b.name] = arr
            form = rng.random()
            if form < 0.4:
                src: Any = arr
            elif form < 0.8 or b.dtype == torch.bfloat16:
                src = torch.from_numpy(arr.copy())
            else:
                src = arr.tolist()
            sources[b.name] = src
        kwargs = {"num_reqs": n} if rng.random() < 0.5 else {}
        desc = f"mapping size={size} n={n} num_reqs={'num_reqs' in kwargs}"
        if fault is not None:
            desc += " " + self._mapping_fault(fault, size, sources)
        return sources, kwargs, desc

    def _fault_buffer(self, want: str) -> BufferPlan | None:
        """A non-keep buffer a fault of kind ``want`` applies to, or None."""
        cands = []
        for b in self.plan.buffers:
            if b.keep:
                continue
            dt = _np_dtype(b)
            fits = {
                "bounds": dt.kind in "iu" and _spoilable(b, dt),
                "nan": b.dtype.is_floating_point and b.dtype != torch.bfloat16,
                "width": b.ndim == 2 and b.overflow == "reject",
                "float": dt.kind in "iu",
            }
            if fits[want]:
                cands.append(b)
        return cands[int(self.rng.integers(len(cands)))] if cands else None

    def _bad_value(self, b: BufferPlan) -> int:
        dt = _np_dtype(b)
        info = np.iinfo(dt)
        if b.max is not None and b.max < int(info.max) and (b.min is None or self.rng.random() < 0.5):
            return b.max + 1
        assert b.min is not None
        return b.min - 1

    def _mapping_fault(self, fault: str, size: int, sources: dict[str, Any]) -> str:
        rng = self.rng
        if fault == "unknown":
            sources["no_such_buffer"] = [1]
            return "fault: unknown name"
        if fault == "count":
            b = next(b for b in self.plan.buffers if b.rows.names & {"requests", "tokens"} and not b.keep)
            n = size // self.tpr + 1
            rows = self.rows(b, n)
            shape = (rows, self.plan.shape_at(b, size)[1]) if b.ndim == 2 else (rows,)
            sources[b.name] = _values(rng, b, shape)
            return f"fault: {b.name} with {rows} rows (a count past size {size})"
        b = self._fault_buffer({"bounds": "bounds", "nan": "nan", "width": "width", "float": "float"}[fault])
        if b is None:
            return self._mapping_fault("unknown", size, sources)
        src = sources[b.name]
        arr = np.array(src.numpy() if isinstance(src, torch.Tensor) else src, dtype=_np_dtype(b))
        if arr.ndim == 2 and arr.shape[1] == 0 and fault != "width":
            arr = _values(rng, b, (arr.shape[0], 1))
        if fault == "width":
            cap = self.plan.shape_at(b, size)[1]
            arr = _values(rng, b, (max(arr.shape[0], 0), cap + 1))
            sources[b.name] = arr
            return f"fault: {b.name} {cap + 1} wide (captured {cap}, reject)"
        live = arr.shape
        if arr.ndim == 2:
            live = (arr.shape[0], min(arr.shape[1], self.plan.shape_at(b, size)[1]))
        if 0 in live:  # no live cell to spoil (a truncated column is not read): spoil the count instead
            return self._mapping_fault("count", size, sources)
        at = tuple(int(rng.integers(d)) for d in live)
        if fault == "bounds":
            arr = arr.astype(np.int64)
            arr[at] = self._bad_value(b)
            sources[b.name] = arr.tolist() if rng.random() < 0.5 else torch.from_numpy(arr)
        elif fault == "nan":
            arr[at] = np.nan
            sources[b.name] = arr if rng.random() < 0.5 else torch.from_numpy(arr)
        else:  # float
            sources[b.name] = arr.astype(np.float64)
        return f"fault: {fault} in {b.name} at {at}"

    def _bound_fault(self, fault: str, size: int, n: int, kwargs: dict[str, Any]) -> str:
        rng = self.rng
        if fault in ("unknown", "count", "float"):
            if fault == "unknown":
                kwargs["widths"] = {**(kwargs["widths"] or {}), "no_such_buffer": 1}
                return "fault: widths names an unknown buffer"
            kwargs["num_reqs"] = size // self.tpr + 1
            return f"fault: num_reqs={kwargs['num_reqs']} past size {size}"
        b = self._fault_buffer({"bounds": "bounds", "nan": "nan", "width": "width"}[fault])
        if b is None:
            kwargs["num_reqs"] = size // self.tpr + 1
            return f"fault: num_reqs={kwargs['num_reqs']} past size {size}"
        arr = self.persist[b.name]
        if fault == "width":
            cap = self.plan.shape_at(b, size)[1]
            kwargs["widths"] = {**(kwargs["widths"] or {}), b.name: cap + 1}
            return f"fault: width {cap + 1} of {b.name} (captured {cap}, reject)"
        rows = self.rows(b, n)
        w = (kwargs["widths"] or {}).get(b.name, arr.shape[1]) if b.ndim == 2 else 1
        w = min(w, self.plan.shape_at(b, size)[1]) if b.ndim == 2 else 1
        if rows == 0 or w == 0:
            kwargs["num_reqs"] = size // self.tpr + 1
            return f"fault: num_reqs={kwargs['num_reqs']} past size {size}"
        at = (int(rng.integers(rows)),) + ((int(rng.integers(w)),) if b.ndim == 2 else ())
        arr[at] = np.nan if fault == "nan" else self._bad_value(b)
        return f"fault: {fault} in bound {b.name} at {at}"

    # ------------------------------------------------------------------------------------------------

    def call(self, sb: StaticBuffers, sources: Any, kwargs: dict[str, Any], kernel: bool) -> str | None:
        src = (self.bound_k if kernel else self.bound_n) if sources == "bound" else sources
        ctx = contextlib.nullcontext() if kernel else numpy_path()
        try:
            with ctx:
                sb.refresh(self.size, src, **kwargs)
        except GraphbufError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def oracle_ok(self, sb: StaticBuffers, before: np.ndarray) -> str | None:
        now = sb.slab.numpy()
        if not np.array_equal(now[~self.in_buffers], before[~self.in_buffers]):
            return "a byte outside every buffer changed"
        for b in self.plan.buffers:
            got = sb.full[b.name]
            if b.name not in self.live:
                old = before[b.offset : b.offset + b.nbytes].tobytes()
                if got.view(torch.uint8).numpy().tobytes() != old:
                    return f"{b.name} (not refreshed) changed"
                continue
            end = self.plan.shape_at(b, self.size)[0]
            src = torch.from_numpy(np.ascontiguousarray(self.live[b.name]))
            if b.dtype == torch.bfloat16:
                src = src.to(torch.bfloat16)
            pad = b.pad if b.pad != "repeat_last" else 0
            want = expected_buffer(
                b.shape, src, end=end, pad=pad, repeat_last=b.pad == "repeat_last", dtype=b.dtype
            )
            if want.view(torch.uint8).numpy().tobytes() != got.view(torch.uint8).numpy().tobytes():
                return f"{b.name} differs from the oracle:\n  got  {got.tolist()}\n  want {want.tolist()}"
        return None


def run(steps: int, seed: int, *, verbose: bool = False) -> dict[str, int]:
    """Fuzz every spec in every mode for ``steps`` calls each; raise AssertionError on a violation."""
    counts = {"accepted": 0, "rejected": 0, "calls": 0}
    rng = np.random.default_rng(seed)
    modes = [Mode(bound, staging, poison) for bound in (False, True) for staging in (None, 2)
             for poison in (False, True)]  # fmt: skip
    faults = ("bounds", "nan", "width", "float", "unknown", "count")
    for name, spec in SPECS.items():
        for mode in modes:
            twins = Twins(spec, mode, np.random.default_rng(rng.integers(2**63)))
            for i in range(steps):
                fault = faults[int(twins.rng.integers(len(faults)))] if twins.rng.random() < 0.35 else None
                sources, kwargs, desc = twins.step(fault)
                where = f"seed {seed}, spec {name}, {mode}, step {i}: {desc}"
                before_k = twins.kern.slab.numpy().copy()
                before_n = twins.nump.slab.numpy().copy()
                err_k = twins.call(twins.kern, sources, kwargs, kernel=True)
                err_n = twins.call(twins.nump, sources, kwargs, kernel=False)
                counts["calls"] += 1
                pairs = ((twins.kern, before_k, "kernel"), (twins.nump, before_n, "numpy"))
                if err_k != err_n:
                    raise AssertionError(f"{where}\n  kernel: {err_k}\n  numpy:  {err_n}")
                if err_k is not None:
                    counts["rejected"] += 1
                    for sb, before, which in pairs:
                        if not np.array_equal(sb.slab.numpy(), before):
                            raise AssertionError(f"{where}\n  {which}: rejected ({err_k}) but bytes changed")
                    if verbose:
                        print(f"{where}\n  rejected: {err_k}")
                    continue
                if fault is not None:
                    raise AssertionError(f"{where}\n  the fault was accepted")
                counts["accepted"] += 1
                for sb, before, which in pairs:
                    problem = twins.oracle_ok(sb, before)
                    if problem is not None:
                        raise AssertionError(f"{where}\n  {which}: {problem}")
                mask = twins.in_buffers  # alignment gaps hold what each allocator left
                if not np.array_equal(twins.kern.slab.numpy()[mask], twins.nump.slab.numpy()[mask]):
                    raise AssertionError(f"{where}\n  the twins' buffers differ")
                if twins.kern.stats != twins.nump.stats:
                    raise AssertionError(f"{where}\n  stats differ: {twins.kern.stats} vs {twins.nump.stats}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS, help=f"calls per spec and mode (default {STEPS})")
    ap.add_argument("--seed", type=int, default=20260, help="the fixed seed (default 20260)")
    ap.add_argument("--deep", action="store_true", help="ten times the steps")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    steps = args.steps * (10 if args.deep else 1)
    t0 = time.perf_counter()
    try:
        counts = run(steps, args.seed, verbose=args.verbose)
    except AssertionError as exc:
        print(f"fuzz_atomic: FAILED\n{exc}", file=sys.stderr)
        return 1
    kernel = "kernel" if native.KERNEL is not None else "NO kernel (numpy twins only)"
    print(
        f"fuzz_atomic: {counts['calls']} twin refreshes ({counts['accepted']} accepted, {counts['rejected']} "
        f"rejected), {len(SPECS)} specs x 8 modes, seed {args.seed}, {kernel}: "
        f"no violation ({time.perf_counter() - t0:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

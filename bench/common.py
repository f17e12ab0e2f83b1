"""Helpers shared by graphbuf's benchmarks: timing, realistic decode-step sources, tables and JSON.

Timing: every figure is a median of per-call wall-clock samples (``time.perf_counter_ns``) taken after a
warm-up, with the garbage collector paused. :func:`compare` interleaves the contenders round by round so
that drift (clock frequency, other load) hits all of them alike. Nothing here asserts a timing.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphbuf import GraphSpec
from graphbuf.planning.planner import Plan

__all__ = [
    "SPEC",
    "StepBuffers",
    "compare",
    "environment",
    "median_us",
    "render_table",
    "step_buffers",
    "write_json",
]

#: The spec every benchmark measures.
SPEC = "gemma4-31b-it-mtp"


def _samples_ns(call: Callable[[], object], iters: int, inner: int) -> list[float]:
    clock = time.perf_counter_ns
    out: list[float] = []
    if inner == 1:
        for _ in range(iters):
            t0 = clock()
            call()
            out.append(clock() - t0)
        return out
    loop = range(inner)
    for _ in range(iters):
        t0 = clock()
        for _ in loop:
            call()
        out.append((clock() - t0) / inner)
    return out


def median_us(call: Callable[[], object], *, iters: int, warmup: int = 10, inner: int = 1) -> float:
    """Median µs per call of ``call`` over ``iters`` samples after ``warmup`` calls.

    ``inner`` > 1 times that many back-to-back calls per sample and divides, for sub-µs calls whose cost
    is near the clock's own overhead.
    """
    for _ in range(warmup):
        call()
    enabled = gc.isenabled()
    gc.disable()
    try:
        samples = _samples_ns(call, iters, inner)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(samples) / 1e3


def timed_ms(call: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """Median wall milliseconds of ``runs`` single calls of a slow ``call``, and its last result."""
    samples, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3, out


def compare(
    calls: Mapping[str, Callable[[], object]],
    *,
    iters: int | Mapping[str, int],
    rounds: int = 5,
    warmup: int = 10,
    inner: int | Mapping[str, int] = 1,
) -> dict[str, float]:
    """Median µs per call of each named call, measured in ``rounds`` interleaved rounds.

    ``iters`` (per name, or one for all) is the total number of samples per call, split evenly over the
    rounds; the result is the median of all of a call's samples.
    """
    names = list(calls)
    per_iters = {n: iters[n] if isinstance(iters, Mapping) else iters for n in names}
    per_inner = {n: inner[n] if isinstance(inner, Mapping) else inner for n in names}
    for n in names:
        for _ in range(warmup):
            calls[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for n in names:
                samples[n] += _samples_ns(calls[n], max(1, per_iters[n] // rounds), per_inner[n])
    finally:
        if enabled:
            gc.enable()
    return {n: statistics.median(s) / 1e3 for n, s in samples.items()}


# ----------------------------------------------------------------------------------------------------------
# Sources


@dataclass
class StepBuffers:
    """One decode step's host data: ``sources`` (live slices, what :meth:`StaticBuffers.refresh` takes),
    the ``persistent`` buffers they are sliced from and the live block-table ``widths`` (what
    :meth:`StaticBuffers.bind` and :meth:`BoundSources.refresh` take), and the ``live`` request count."""

    sources: dict[str, torch.Tensor]
    persistent: dict[str, torch.Tensor]
    widths: dict[str, int]
    live: int


#: The KV groups of the vLLM-style decode specs the benchmarks build.
DECODE_GROUPS = ("full", "sliding")


def decode_spec(
    name: str,
    *,
    max_num_seqs: int,
    tokens_per_request: int,
    block_size: int,
    max_model_len: int,
    sizes: list[int],
    slots_per_group: bool,
) -> GraphSpec:
    """vLLM's decode metadata as a spec: a block table per KV group, ``seq_lens``, ``query_start_loc`` and
    ``slot_mapping`` (one per group when ``slots_per_group``), at up to ``max_num_seqs`` requests."""
    slot_mapping: dict[str, Any] = {"dtype": "int64", "rows": "tokens", "pad": -1, "min": -1}
    if slots_per_group:
        slot_mapping = {"dtype": "int64", "rows": "tokens", "per_group": True, "pad": -1, "min": -1}
    return GraphSpec.model_validate(
        {
            "version": 1,
            "name": name,
            "constants": {
                "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_seqs * tokens_per_request,
                "block_size": block_size, "max_model_len": max_model_len,
                "max_blocks": "cdiv(max_model_len, block_size)", "num_blocks": 1 << 24,
            },
            "capture": {"tokens_per_request": tokens_per_request, "sizes": sizes},
            "groups": list(DECODE_GROUPS),
            "limits": {"max_bytes": 1 << 30},
            "buffers": {
                "block_table": {
                    "dtype": "int32", "rows": "requests", "cols": "max_blocks", "per_group": True,
                    "pad": 0, "min": 0, "max": "num_blocks - 1",
                },
                "seq_lens": {
                    "dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": "max_model_len",
                },
                "query_start_loc": {
                    "dtype": "int32", "rows": "requests + 1", "pad": "repeat_last", "min": 0,
                    "max": "max_num_batched_tokens",
                },
                "slot_mapping": slot_mapping,
            },
        }
    )  # fmt: skip


# The decode trace bench_steps times and bench_cuda's cpu proxy replays: 128K context x 256 requests, k = 3.
STEPS_CONTEXT = 131072
STEPS_REQUESTS = 256
STEPS_TPR = 4  # tokens per request (k = 3)
STEPS_LIVE = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def steps_spec(block_size: int) -> GraphSpec:
    """The decode spec of the steps trace at ``block_size``, captured at every live count of STEPS_LIVE."""
    return decode_spec(
        f"steps-128K-x256-b{block_size}", max_num_seqs=STEPS_REQUESTS, tokens_per_request=STEPS_TPR,
        block_size=block_size, max_model_len=STEPS_CONTEXT, sizes=[STEPS_TPR * r for r in STEPS_LIVE],
        slots_per_group=True,
    )  # fmt: skip


def steps_trace(sb: Any, live: int, steps: int, rng: np.random.Generator) -> list[tuple[int, list[Any]]]:
    """(live requests, staged writes) of a fill step and ``steps`` decode steps at about ``live`` requests:
    each request grows by 1..k+1 tokens, about one in 64 finishes and as many join."""
    from graphbuf.testing_steps import DecodeBatch, Step

    tpr = STEPS_TPR
    batch = DecodeBatch(sb, slots="slot_mapping", offsets="query_start_loc")
    hi = STEPS_CONTEXT - tpr * (steps + 2)
    first = Step(join=tuple(int(x) for x in rng.integers(tpr, hi, live)), grow=(1,) * live)
    out = [(live, batch.advance(first))]
    for _ in range(steps):
        n = batch.live
        must = [r for r, ln in enumerate(batch.lens) if ln + tpr > batch.max_len]
        finish = sorted(set(must) | {int(r) for r in np.flatnonzero(rng.random(n) < 1 / 64)})
        joins = tuple(int(x) for x in rng.integers(tpr, hi, len(finish)))
        grow = tuple(int(g) for g in rng.integers(1, tpr + 1, n))
        out.append((n, batch.advance(Step(tuple(finish), joins, grow))))
    return out


def step_buffers(
    p: Plan,
    live: int,
    rng: np.random.Generator,
    *,
    max_len: int | None = None,
    pin_memory: bool = False,
) -> StepBuffers:
    """Host data of one decode step of ``live`` requests, as vLLM's CPU-side input buffers hold it.

    Each source is a torch CPU tensor sliced from a persistent buffer the size of the serving envelope
    (``max_num_seqs`` rows, the allocation's columns), so block tables are row-strided views exactly like
    ``block_table_cpu[:n, :w]``. Sequence lengths are uniform in ``[tokens_per_request, max_len]`` (default
    3/4 of ``max_model_len``); block tables are ``w`` = blocks needed by the longest sequence wide, narrower
    than the allocation, with leftover ids past each row's own blocks (as a reused CPU table has). The
    sliding group's table holds the null block 0 for blocks wholly outside the window. Query offsets and
    both slot mappings are consistent with lengths and tables. ``pin_memory`` pins the persistent buffers
    (needs CUDA).
    """
    c = p.constants
    tpr = p.tokens_per_request
    bs = int(c["block_size"])  # type: ignore[arg-type]
    num_blocks = int(c["num_blocks"])  # type: ignore[arg-type]
    window = int(c.get("sliding_window") or 0)
    alloc_w = p["block_table.full"].shape[1]
    max_rows = int(c.get("max_num_seqs") or p["block_table.full"].shape[0])
    if max_len is None:
        max_len = int(c["max_model_len"]) * 3 // 4  # type: ignore[operator]
    max_len = min(max_len, alloc_w * bs)

    lens = rng.integers(tpr, max_len + 1, size=live).astype(np.int32)
    need = -(-lens.astype(np.int64) // bs)
    width = int(need.max(initial=1))

    def persistent(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        return t.pin_memory() if pin_memory else t

    out: dict[str, torch.Tensor] = {}
    whole: dict[str, torch.Tensor] = {}
    tables: dict[str, np.ndarray] = {}
    for group in ("full", "sliding"):
        table = rng.integers(0, num_blocks, size=(live, width)).astype(np.int32)  # leftovers past need
        for r in range(live):
            n = int(need[r])
            table[r, :n] = rng.choice(num_blocks, size=n, replace=False)
            if group == "sliding" and window:
                first_pos = max(0, int(lens[r]) - tpr - window + 1)  # oldest position any new token sees
                table[r, : first_pos // bs] = 0
        tables[group] = table
        buf = persistent((max_rows, alloc_w), torch.int32)
        buf[:live, :width] = torch.from_numpy(table)
        whole[f"block_table.{group}"] = buf
        out[f"block_table.{group}"] = buf[:live, :width]
    seq = whole["seq_lens"] = persistent((max_rows,), torch.int32)
    seq[:live] = torch.from_numpy(lens)
    out["seq_lens"] = seq[:live]
    qsl = whole["query_start_loc"] = persistent((max_rows + 1,), torch.int32)
    qsl[: live + 1] = torch.arange(live + 1, dtype=torch.int32) * tpr
    out["query_start_loc"] = qsl[: live + 1]
    rows = np.repeat(np.arange(live), tpr)
    pos = np.repeat(lens.astype(np.int64) - tpr, tpr) + np.tile(np.arange(tpr), live)
    for group, table in tables.items():
        slots = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        buf = whole[f"slot_mapping.{group}"] = persistent((max_rows * tpr,), torch.int64)
        buf[: live * tpr] = torch.from_numpy(slots)
        out[f"slot_mapping.{group}"] = buf[: live * tpr]
    widths = {f"block_table.{group}": width for group in tables}
    return StepBuffers(sources=out, persistent=whole, widths=widths, live=live)


# ----------------------------------------------------------------------------------------------------------
# Output


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: ``title``, a header line, a rule, one line per row (floats to 3 significant
    figures at least, 1 decimal for values ≥ 100)."""

    def cell(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return {True: "yes", False: "no", None: "-"}[v]
        if isinstance(v, float):
            if math.isnan(v) or math.isinf(v):
                return str(v)
            if abs(v) >= 100:
                return f"{v:.1f}"
            return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
        return str(v)

    text = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("-" * len(lines[1]))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in text]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where and when the figures were taken."""
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def write_json(
    path: Path,
    benchmark: str,
    results: Mapping[str, Any] | Sequence[Any],
    *,
    skipped: bool = False,
    **meta: Any,
) -> Path:
    """Write ``{"benchmark", "skipped", "meta" (environment + meta), "results"}`` to ``path``; return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": benchmark, "skipped": skipped, "meta": {**environment(), **meta}, "results": results}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path

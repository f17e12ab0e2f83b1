"""``graphbuf drill``: capture every size, replay randomized batches, compare each replay with eager.

A drill task is any object with ``name``, ``bind(buffers, generator)``, ``randomize(live_requests,
generator)`` and ``__call__(step) -> Tensor``, plus optionally ``host_args(size, live, sources)``. Specs
name their tasks under ``tasks:`` as ``module:function`` factories; without any, the drill runs the built-in
:class:`PagedDecodeAttention` on the first KV group.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from graphbuf.buffers import StaticBuffers
from graphbuf.errors import SpecError
from graphbuf.expr import parse_expr
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.runner import OVERSIZE, GraphRunner, Step
from graphbuf.planner import Plan, plan
from graphbuf.spec import GraphSpec, TaskSpec, load_spec

__all__ = ["OVERSIZE", "DrillReport", "DrillTask", "PagedDecodeAttention", "make_batch", "run_drill"]


class DrillTask(Protocol):
    name: str

    def bind(self, buffers: StaticBuffers, generator: torch.Generator) -> None: ...

    def randomize(self, live_requests: int, generator: torch.Generator) -> None: ...

    def __call__(self, step: Step) -> torch.Tensor: ...


def _buffer(views: Mapping[str, torch.Tensor], name: str, group: str | None) -> torch.Tensor:
    return views[f"{name}.{group}"] if group is not None and f"{name}.{group}" in views else views[name]


class PagedDecodeAttention:
    """Built-in drill task: paged-KV attention in plain torch, graph-safe.

    Reads ``block_table`` (of its KV group) and ``seq_lens`` from the buffers and a static query; gathers
    the paged KV over the block table's full captured width (no data-dependent shapes), masks each query to
    its visible prefix (query i of a request sees keys ``0 .. seq_len - q_len + i``) and applies softmax.
    Rows with seq_len 0 return zeros. Block ids are clamped into range; ids past a row's needed blocks
    are masked.
    """

    def __init__(
        self,
        name: str = "paged_decode",
        *,
        group: str | None = None,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 64,
        dtype: str = "float32",
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.name, self.group = name, group
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = getattr(torch, dtype)

    def bind(self, buffers: StaticBuffers, generator: torch.Generator) -> None:
        p = buffers.plan
        self.block_size = int(p.constants.get("block_size") or 16)
        self.num_blocks = int(p.constants["num_blocks"])  # type: ignore[arg-type]
        self.q_len = p.tokens_per_request
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        dev = buffers.device
        self.key_cache = torch.empty(shape, dtype=self.dtype, device=dev)
        self.value_cache = torch.empty(shape, dtype=self.dtype, device=dev)
        rows = OVERSIZE * p.capture_sizes[-1]  # room for the eager batches above the largest capture size
        self.query = torch.empty((rows, self.num_heads, self.head_dim), dtype=self.dtype, device=dev)
        self.randomize(p.capture_sizes[-1] // self.q_len, generator, kv=True)

    def randomize(self, live_requests: int, generator: torch.Generator, kv: bool = False) -> None:
        """New query values in place (and new KV values when ``kv``); addresses never change."""
        for t in (self.query, self.key_cache, self.value_cache) if kv else (self.query,):
            t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype))

    def __call__(self, step: Step) -> torch.Tensor:
        bt = _buffer(step.views, "block_table", self.group)
        lens = step.views["seq_lens"]
        b, width = bt.shape
        q = self.query[: b * self.q_len].view(b, self.q_len, self.num_heads, self.head_dim)
        ids = bt.long().clamp(0, self.num_blocks - 1)
        k = self.key_cache[ids].reshape(b, width * self.block_size, self.num_kv_heads, self.head_dim)
        v = self.value_cache[ids].reshape(b, width * self.block_size, self.num_kv_heads, self.head_dim)
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=2).float()
        v = v.repeat_interleave(rep, dim=2).float()
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) / math.sqrt(self.head_dim)
        pos = torch.arange(width * self.block_size, device=bt.device)
        last = lens.long()[:, None] - self.q_len + torch.arange(self.q_len, device=bt.device)[None, :]
        visible = pos[None, None, :] <= last[:, :, None]  # [b, q, k]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        return out.reshape(b * self.q_len, self.num_heads, self.head_dim).to(self.dtype)


# ----------------------------------------------------------------------------------------------------------
# Randomized batches


def make_batch(p: Plan, live: int, rng: np.random.Generator, num_blocks: int) -> dict[str, np.ndarray]:
    """Random sources for ``live`` requests: seq lens, shuffled block tables narrower than the allocation,
    query offsets and slot mappings consistent with them; other buffers random within their bounds."""
    tpr = p.tokens_per_request
    bs = int(p.constants.get("block_size") or 16)
    widths = [b.shape[1] for b in p.buffers if b.spec_name == "block_table"]
    alloc_w = min(widths) if widths else 1
    max_len = min(int(p.constants.get("max_model_len") or alloc_w * bs), alloc_w * bs)
    seq_lens = rng.integers(tpr, max_len + 1, size=live).astype(np.int32)
    need = -(-int(seq_lens.max(initial=tpr)) // bs)
    width = int(rng.integers(need, alloc_w + 1))
    env = {**p.constants, "requests": live, "tokens": live * tpr}
    out: dict[str, np.ndarray] = {}
    tables: dict[str | None, np.ndarray] = {}
    for b in p.buffers:
        if b.keep:
            continue
        if b.spec_name == "block_table":
            table = rng.integers(0, num_blocks, size=(live, width)).astype(np.int32)  # garbage past need
            for r in range(live):
                n = -(-int(seq_lens[r]) // bs)
                table[r, :n] = rng.permutation(num_blocks)[:n]
            tables[b.group] = table
            out[b.name] = table
        elif b.name == "seq_lens":
            out[b.name] = seq_lens
        elif b.name == "query_start_loc":
            out[b.name] = (np.arange(live + 1) * tpr).astype(np.int32)
    for b in p.buffers:
        if b.keep or b.name in out:
            continue
        rows = b.rows.eval(env)
        if b.spec_name == "slot_mapping" and tables:
            table = tables.get(b.group, next(iter(tables.values())))
            r = np.repeat(np.arange(live), tpr)
            pos = np.repeat(seq_lens.astype(np.int64) - tpr, tpr) + np.tile(np.arange(tpr), live)
            out[b.name] = table[r, pos // bs].astype(np.int64) * bs + pos % bs
            continue
        lo = b.min if b.min is not None else 0
        hi = b.max if b.max is not None else lo + 100
        shape = (rows,) if b.cols is None else (rows, b.cols.eval(env))
        out[b.name] = rng.integers(lo, hi + 1, size=shape).astype(str(b.dtype).removeprefix("torch."))
    return out


# ----------------------------------------------------------------------------------------------------------


@dataclass
class SizeRow:
    size: int
    replays: int = 0
    max_abs_error: float = 0.0
    refresh_us: list[float] = field(default_factory=list)
    addresses_stable: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "replays": self.replays,
            "max_abs_error": self.max_abs_error,
            "refresh_us_median": statistics.median(self.refresh_us) if self.refresh_us else None,
            "addresses_stable": self.addresses_stable,
        }


@dataclass
class DrillReport:
    spec: str
    device: str
    tasks: list[str]
    tolerance: float
    rows: dict[int, SizeRow]
    eager_runs: int = 0
    eager_max_abs_error: float = 0.0
    capture_failures: dict[int, str] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        errors = [r.max_abs_error for r in self.rows.values()] + [self.eager_max_abs_error]
        return (
            all(e <= self.tolerance for e in errors)
            and all(r.addresses_stable for r in self.rows.values())
            and not self.capture_failures
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "device": self.device,
            "tasks": self.tasks,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "sizes": [r.as_dict() for r in self.rows.values()],
            "eager": {"runs": self.eager_runs, "max_abs_error": self.eager_max_abs_error},
            "capture_failures": {str(k): v for k, v in self.capture_failures.items()},
            "runner": self.stats,
            "seconds": round(self.seconds, 2),
        }

    def render(self) -> str:
        lines = [
            f"graphbuf drill: {self.spec} on {self.device}; tasks: {', '.join(self.tasks)}; "
            f"tolerance {self.tolerance:g}",
            f"{'size':>5} {'replays':>8} {'max abs err':>12} {'refresh µs':>11} {'addresses stable':>17}",
        ]
        for r in self.rows.values():
            med = f"{statistics.median(r.refresh_us):.1f}" if r.refresh_us else "-"
            lines.append(
                f"{r.size:>5} {r.replays:>8} {r.max_abs_error:>12.3g} {med:>11} "
                f"{'yes' if r.addresses_stable else 'NO':>17}"
            )
        lines.append(
            f"eager fallbacks (batches above the largest capture size): {self.eager_runs}, "
            f"max abs err {self.eager_max_abs_error:.3g}"
        )
        for size, why in self.capture_failures.items():
            lines.append(f"capture FAILED at size {size}: {why}")
        lines.append(f"{'PASS' if self.ok else 'FAIL'} in {self.seconds:.1f} s")
        return "\n".join(lines)


def _build_tasks(spec: GraphSpec, p: Plan) -> list[Any]:
    if not spec.tasks:
        return [PagedDecodeAttention(group=spec.groups[0])]
    tasks = []
    for i, t in enumerate(spec.tasks):
        tasks.append(_build_task(t, p, i))
    return tasks


def _build_task(t: TaskSpec, p: Plan, i: int) -> Any:
    module, _, attr = t.factory.partition(":")
    try:
        factory: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise SpecError(f"tasks[{i}].factory: cannot import {t.factory!r}: {exc}") from None
    options = {}
    for key, value in t.options.items():
        if isinstance(value, str):  # an expression over constants, else a plain string (e.g. "dense")
            try:
                expr = parse_expr(value)
            except ValueError:
                expr = None
            if expr is not None and expr.names <= set(p.constants):
                try:
                    value = expr.eval(p.constants)
                except ValueError as exc:
                    raise SpecError(f"tasks[{i}].options.{key}: {exc}") from None
        options[key] = value
    return factory(t.name, group=t.group, **options)


def _reference_views(buffers: StaticBuffers, sources: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The drill's reference inputs: the batch's own rows as tensors, without graphbuf's padding, so a replay
    is compared with what the callable computes on the raw live batch (``keep`` buffers: the largest
    capture size's views). The runner validated these sources before this is called."""
    largest = buffers.view(buffers.capture_sizes[-1])
    full = buffers.full
    return {
        name: torch.as_tensor(sources[name], dtype=full[name].dtype, device=buffers.device)
        if name in sources
        else largest[name]
        for name in buffers.names
    }


def run_drill(
    spec: str | GraphSpec,
    *,
    device: str = "cpu",
    replays: int = 200,
    seed: int = 0,
    overrides: Mapping[str, int] | None = None,
    tolerance: float = 1e-4,
    progress: Callable[[int, int], None] | None = None,
    allow_factories: Iterable[str] = (),
) -> DrillReport:
    """Run the drill and return its report (see the module docstring). ``allow_factories``: modules whose
    unregistered task factories may be imported (see :mod:`graphbuf.factories`)."""
    started = time.perf_counter()
    Graph(device)  # DeviceUnavailableError, before any work, if the device or its runtime is missing
    spec_obj = (
        spec
        if isinstance(spec, GraphSpec)
        else load_spec(spec, overrides=overrides, allow_factories=allow_factories)
    )
    overrides = dict(overrides or {})
    if "num_blocks" not in spec_obj.constants:
        spec_obj = spec_obj.model_copy(update={"constants": {**spec_obj.constants, "num_blocks": None}})
    base = plan(spec_obj, overrides=overrides, allow_factories=allow_factories)
    if base.constants["num_blocks"] is None:
        # Enough distinct blocks for a full-width row; requests may share blocks, which changes no numerics.
        widths = [b.shape[1] for b in base.buffers if b.cols is not None]
        overrides["num_blocks"] = max(64, min(256, max(widths, default=16)))
    p = plan(spec_obj, overrides=overrides, allow_factories=allow_factories)
    num_blocks = int(p.constants["num_blocks"])  # type: ignore[arg-type]
    buffers = StaticBuffers(p, device)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tasks = _build_tasks(spec_obj, p)
    for task in tasks:
        task.bind(buffers, gen)

    def step_fn(step: Step) -> tuple[torch.Tensor, ...]:
        return tuple(task(step) for task in tasks)

    def host_args(size: int, live: int, sources: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for task in tasks:
            if hasattr(task, "host_args"):
                out.update(task.host_args(size, live, sources))
        return out

    max_req = p.capture_sizes[-1] // p.tokens_per_request
    warm = make_batch(p, max_req, rng, num_blocks)
    buffers.refresh(p.capture_sizes[-1], warm)
    rows = [getattr(t, "output_rows", "tokens") for t in tasks]
    # A failed capture is reported (FAIL), not raised.
    runner = GraphRunner(buffers, step_fn, output_rows=rows, on_capture_error="eager")
    runner.capture()
    start_addresses = {s: buffers.addresses(s) for s in p.capture_sizes}
    report = DrillReport(
        spec=spec_obj.name,
        device=device,
        tasks=[t.name for t in tasks],
        tolerance=tolerance,
        rows={s: SizeRow(s) for s in p.capture_sizes},
        capture_failures=dict(runner.stats.capture_failures),
    )
    for i in range(replays):
        # Every capture size in turn, then random sizes; about one batch in eight above the largest.
        if i < len(p.capture_sizes):
            lo = p.capture_sizes[i - 1] // p.tokens_per_request + 1 if i else 1
            live = int(rng.integers(lo, p.capture_sizes[i] // p.tokens_per_request + 1))
        elif rng.random() < 0.125:
            live = int(rng.integers(max_req + 1, min(OVERSIZE * max_req, max_req + max(2, max_req // 4)) + 1))
        else:
            live = int(rng.integers(1, max_req + 1))
        for task in tasks:
            task.randomize(live, gen)
        sources = make_batch(p, live, rng, num_blocks)
        size = runner.size_for(live)
        args = host_args(size or live * p.tokens_per_request, live, sources)
        got = runner.run(sources, num_reqs=live, host_args=args)
        got = tuple(t.clone() for t in got)
        want = step_fn(
            Step(live * p.tokens_per_request, _reference_views(runner.buffers, sources), None, args, live)
        )
        err = max(
            ((g.float() - w.float()).abs().max().item() if g.numel() else 0.0) for g, w in zip(got, want)
        )
        if any(g.shape != w.shape for g, w in zip(got, want)):
            err = math.inf
        if size is None or size in runner.stats.capture_failures:
            report.eager_runs += 1
            report.eager_max_abs_error = max(report.eager_max_abs_error, err)
        else:
            row = report.rows[size]
            row.replays += 1
            row.max_abs_error = max(row.max_abs_error, err)
            row.refresh_us.append(runner.stats.refresh_s.last * 1e6)
        if progress is not None:
            progress(i + 1, replays)
    for s, addrs in start_addresses.items():
        report.rows[s].addresses_stable = buffers.addresses(s) == addrs
    report.stats = runner.stats.as_dict()
    report.seconds = time.perf_counter() - started
    return report


def run_drill_cli(args: argparse.Namespace) -> int:
    """The ``graphbuf drill`` command (see :mod:`graphbuf.cli`)."""
    from graphbuf.cli import _overrides

    if args.replays < 0:
        raise SpecError(f"--replays {args.replays}: must be ≥ 0")
    tty = sys.stderr.isatty()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if done == total or now - last[0] > (0.2 if tty else 5.0):
            last[0] = now
            end = "\n" if done == total or not tty else ""
            print(f"\rdrill: {done}/{total} replays", end=end, file=sys.stderr, flush=True)

    report = run_drill(
        args.spec,
        device=args.device,
        replays=args.replays,
        seed=args.seed,
        overrides=_overrides(args.set),
        progress=progress,
        allow_factories=args.allow_factory,
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1

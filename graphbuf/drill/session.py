"""``graphbuf drill``: capture every size, replay batches drawn through Hypothesis, compare each with eager.

A drill task is any object with ``name``, ``bind(buffers, generator)``, ``randomize(live_requests,
generator)`` and ``__call__(step) -> Tensor``, plus optionally ``host_args(size, live, sources)``. Specs
name their tasks under ``tasks:`` as ``module:function`` factories; without any, the drill runs the built-in
:class:`PagedDecodeAttention` on the first KV group.

Batches come from :mod:`graphbuf.testing`: the spec's rules plus the relations the tasks' factories declare
(core graphbuf names no engine's buffers). A replay that differs from eager is shrunk to the smallest failing
batch, saved as JSON and replayable with ``graphbuf drill SPEC --replay FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import random
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.strategies import SearchStrategy

from graphbuf.buffers.slab import StaticBuffers
from graphbuf.drill.options import PAGED_DECODE
from graphbuf.drill.progress import REPLAYS_ENV, Progress, default_replays  # noqa: F401 (re-exported)
from graphbuf.errors import BatchFileError, PlanTooLargeError, SpecError, UsageError
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.runner import OVERSIZE, GraphRunner, Step
from graphbuf.planning.planner import Plan, plan
from graphbuf.spec.expr import parse_expr
from graphbuf.spec.factories import task_strategy
from graphbuf.spec.models import GraphSpec, TaskSpec, load_spec
from graphbuf.testing import Relation, as_source, sample, sources, stage_sources, task_relations

__all__ = [
    "OVERSIZE",
    "PHASES",
    "DrillBatch",
    "DrillReport",
    "DrillSession",
    "DrillTask",
    "PagedDecodeAttention",
    "drill_batches",
    "load_batch",
    "output_error",
    "run_drill",
    "save_batch",
]


class DrillTask(Protocol):
    """A task the drill binds once and replays. ``randomize`` draws new inputs in place; they must depend
    only on the bind and on the generator it is given (not on earlier batches), so that ``--replay FILE``
    reproduces a saved failure exactly."""

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

    def bind_bytes(self, p: Plan) -> int:
        """Bytes :meth:`bind` allocates for plan ``p`` (KV caches and the query), before it allocates them."""
        block_size = int(p.constants.get("block_size") or 16)
        cache = int(p.constants["num_blocks"]) * block_size * self.num_kv_heads * self.head_dim  # type: ignore[arg-type]
        query = OVERSIZE * p.capture_sizes[-1] * self.num_heads * self.head_dim
        return (2 * cache + query) * self.dtype.itemsize

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


PHASES = ("import", "capture", "draw", "refresh", "replay", "eager_reference", "compare")
"""The drill's phases, in :attr:`DrillReport.phases`: ``import`` (torch, Hypothesis and the drill; measured by
the CLI), ``capture`` (spec, plan, buffers, task binding, every size captured), ``draw`` (batches and task
inputs drawn, Hypothesis' search and shrinking), ``refresh`` (the buffers refreshed before each replay),
``replay`` (graph replays and eager fallbacks, refresh excluded), ``eager_reference`` (the tasks run eagerly
on each raw batch), ``compare`` (replay against eager)."""


def _finite(x: float) -> float | None:
    """``x``, or None for inf/NaN (strict JSON has neither)."""
    return x if math.isfinite(x) else None


@dataclass
class SizeRow:
    size: int
    replays: int = 0
    max_abs_error: float = 0.0
    refresh_us: list[float] = field(default_factory=list)
    addresses_stable: bool = True

    def as_dict(self) -> dict[str, Any]:
        """JSON; a size never replayed has ``max_abs_error`` and ``addresses_stable`` null (not measured)."""
        replayed = self.replays > 0
        return {
            "size": self.size,
            "replays": self.replays,
            "max_abs_error": _finite(self.max_abs_error) if replayed else None,
            "refresh_us_median": statistics.median(self.refresh_us) if self.refresh_us else None,
            "addresses_stable": self.addresses_stable if replayed else None,
        }


@dataclass
class DrillReport:
    spec: str
    device: str
    tasks: list[str]
    tolerance: float
    rows: dict[int, SizeRow]
    #: Errors are measured past one rounding step of the output dtype (accelerators; see DrillSession).
    rounding: bool = False
    eager_runs: int = 0
    eager_max_abs_error: float = 0.0
    capture_failures: dict[int, str] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: The smallest failing batch found: num_reqs, size, max_abs_error, error, saved (file), replay_command.
    failure: dict[str, Any] | None = None
    shrink_replays: int = 0
    #: Seconds per phase (:data:`PHASES`); they add up to the run's wall time (import included).
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    #: Replays committed staged writes (``--staged``), not whole sources.
    staged: bool = False

    @property
    def compared(self) -> int:
        """Batches replayed or run eagerly and compared with the reference (shrinking excluded)."""
        return sum(r.replays for r in self.rows.values()) + self.eager_runs

    @property
    def ok(self) -> bool:
        errors = [r.max_abs_error for r in self.rows.values()] + [self.eager_max_abs_error]
        return (
            all(e <= self.tolerance for e in errors)
            and all(r.addresses_stable for r in self.rows.values())
            and not self.capture_failures
            and self.failure is None
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "device": self.device,
            "tasks": self.tasks,
            "tolerance": self.tolerance,
            "rounding": self.rounding,
            "writes": "staged" if self.staged else "sources",
            "ok": self.ok,
            "compared": self.compared,
            "sizes": [r.as_dict() for r in self.rows.values()],
            "eager": {"runs": self.eager_runs, "max_abs_error": _finite(self.eager_max_abs_error)},
            "failure": self.failure,
            "shrink_replays": self.shrink_replays,
            "capture_failures": {str(k): v for k, v in self.capture_failures.items()},
            "runner": self.stats,
            "seconds": round(self.seconds, 2),
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
        }

    def render(self) -> str:
        lines = [
            f"graphbuf drill: {self.spec} on {self.device}; tasks: {', '.join(self.tasks)}; "
            f"tolerance {self.tolerance:g}"
            + (" past one rounding step of the output dtype" if self.rounding else "")
            + "; writes: "
            + ("staged (changed cells, StaticBuffers.stage)" if self.staged else "whole sources (refresh)"),
            f"{'size':>5} {'replays':>8} {'max abs err':>12} {'refresh µs':>11} {'addresses stable':>17}",
        ]
        for r in self.rows.values():
            med = f"{statistics.median(r.refresh_us):.1f}" if r.refresh_us else "-"
            err = f"{r.max_abs_error:.3g}" if r.replays else "-"
            stable = ("yes" if r.addresses_stable else "NO") if r.replays else "-"
            lines.append(f"{r.size:>5} {r.replays:>8} {err:>12} {med:>11} {stable:>17}")
        lines.append(
            f"eager fallbacks (batches above the largest capture size): {self.eager_runs}, "
            f"max abs err {self.eager_max_abs_error:.3g}"
        )
        for size, why in self.capture_failures.items():
            lines.append(f"capture FAILED at size {size}: {why}")
        if self.failure is not None:
            f = self.failure
            where = f"capture size {f['size']}" if f["size"] is not None else "eager"
            what = f["error"] or f"max abs err {f['max_abs_error']:.3g}"
            lines.append(
                f"smallest failing batch: {f['num_reqs']} requests ({where}): {what}"
                + (f" (shrunk in {self.shrink_replays} replays)" if self.shrink_replays else "")
            )
            if f.get("saved"):
                lines.append(f"saved to {f['saved']}")
            if f.get("replay_command"):
                lines.append(f"replay it: {f['replay_command']}")
        lines.append(
            "seconds per phase: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in self.phases.items())
        )
        if not self.ok:
            verdict = "FAIL"
        elif self.compared == 0:
            verdict = "NOTHING REPLAYED (every size captured; no batch compared)"
        else:
            verdict = "PASS"
        lines.append(f"{verdict} in {self.seconds:.1f} s")
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
        name: torch.as_tensor(sources[name], device=buffers.device).to(full[name].dtype)
        if name in sources
        else largest[name]
        for name in buffers.names
    }


# ----------------------------------------------------------------------------------------------------------
# One drill session: buffers, tasks, captured graphs; one replay compared with eager


@dataclass
class Outcome:
    """One replay compared with eager: the capture size it ran at (None: eager) and the largest error
    (``inf`` for a shape mismatch or an exception, whose text is ``error``)."""

    size: int | None
    err: float
    error: str | None = None


def output_error(got: torch.Tensor, want: torch.Tensor, rounding: bool) -> float:
    """The largest ``|got - want|``; with ``rounding``, what is left of it past one rounding step of the
    output dtype at ``want`` (``eps * |want|``: at least one unit in the last place)."""
    diff = (got.float() - want.float()).abs()
    if rounding and want.is_floating_point():
        diff = (diff - torch.finfo(want.dtype).eps * want.float().abs()).clamp_min(0)
    return float(diff.max().item())


def _spec_of(
    spec: str | GraphSpec, overrides: Mapping[str, int] | None, allow_factories: Iterable[str]
) -> GraphSpec:
    if isinstance(spec, GraphSpec):
        return spec
    return load_spec(spec, overrides=overrides, allow_factories=allow_factories)


@dataclass(frozen=True)
class DrillPlan:
    """What a drill session is built from, checked before anything is allocated: the spec (with a
    ``num_blocks`` constant), its plan (``num_blocks`` defaulted when unset) and the unbound tasks."""

    spec: GraphSpec
    plan: Plan
    tasks: list[Any]


def drill_plan(
    spec: str | GraphSpec, overrides: Mapping[str, int] | None = None, allow_factories: Iterable[str] = ()
) -> DrillPlan:
    """The spec, plan and tasks of a drill; :class:`PlanTooLargeError` when the slab and what the tasks'
    ``bind`` would allocate (``task.bind_bytes(plan)``: KV caches, queries) exceed ``limits.max_bytes``."""
    spec_obj = _spec_of(spec, overrides, allow_factories)
    overrides = dict(overrides or {})
    if "num_blocks" not in spec_obj.constants:
        spec_obj = spec_obj.model_copy(update={"constants": {**spec_obj.constants, "num_blocks": None}})
    base = plan(spec_obj, overrides=overrides, allow_factories=allow_factories)
    if base.constants["num_blocks"] is None:
        # Enough distinct blocks for a full-width row; requests may share blocks: no numerics change.
        widths = [b.shape[1] for b in base.buffers if b.cols is not None]
        overrides["num_blocks"] = max(64, min(256, max(widths, default=16)))
    p = plan(spec_obj, overrides=overrides, allow_factories=allow_factories)
    tasks = _build_tasks(spec_obj, p)
    need = sum(int(t.bind_bytes(p)) for t in tasks if hasattr(t, "bind_bytes"))
    if p.total_bytes + need > p.max_bytes:
        where = spec if isinstance(spec, str) else spec_obj.name
        raise PlanTooLargeError(
            f"{where}: limits.max_bytes: the drill's tasks would allocate {need} bytes (KV caches, queries, "
            f"outputs at num_blocks={p.constants['num_blocks']}) beside the slab's {p.total_bytes}, above "
            "the "
            f"limit of {p.max_bytes} bytes; lower num_blocks or raise limits.max_bytes"
        )
    keys, step = _step_bytes(p)
    if step > p.max_bytes:
        where = spec if isinstance(spec, str) else spec_obj.name
        raise PlanTooLargeError(
            f"{where}: limits.max_bytes: a drill step of {p.capture_sizes[-1]} tokens reads up to {keys} "
            f"keys per token (block-table columns x block_size): at least {step} bytes of working memory "
            f"(one byte per token and key), above the limit of {p.max_bytes} bytes; lower max_model_len or "
            "raise limits.max_bytes"
        )
    return DrillPlan(spec_obj, p, tasks)


def _step_bytes(p: Plan) -> tuple[int, int]:
    """(keys, bytes): the keys one token of a drill step can address (a block-id buffer's columns times
    ``block_size``) and a lower bound on the step's working memory: one byte per token of the largest
    capture size and key (the attention tasks build at least a mask that size)."""
    num_blocks = p.constants.get("num_blocks")
    block = int(p.constants.get("block_size") or 1)
    blocks = [b for b in p.buffers if b.cols is not None and num_blocks is not None]
    widths = [b.shape[1] for b in blocks if b.max == num_blocks - 1]  # block ids: a block table
    keys = max(widths, default=0) * block
    return keys, p.capture_sizes[-1] * keys


class DrillSession:
    """The drill's buffers, tasks and runner for one spec, captured at every size (unless ``capture`` is
    False); :meth:`check` replays one batch and compares it with the tasks run eagerly on the raw batch.

    ``progress(phase, done, total)`` is called as capture proceeds (phase ``"capture"``, sizes).
    ``phases`` accumulates the seconds :meth:`check` spends per phase (``refresh``, ``replay``,
    ``eager_reference``, ``compare``; see :data:`PHASES`)."""

    def __init__(
        self,
        spec: str | GraphSpec,
        *,
        device: str = "cpu",
        seed: int = 0,
        overrides: Mapping[str, int] | None = None,
        allow_factories: Iterable[str] = (),
        capture: bool = True,
        progress: Callable[[str, int, int], None] | None = None,
        staged: bool = False,
    ) -> None:
        self.staged = staged  # replays commit staged writes (graphbuf.testing.stage_sources), not sources
        Graph(device)  # DeviceUnavailableError, before any work, if the device or its runtime is missing
        _check_seed("seed", seed)
        self.overrides = dict(overrides or {})  # as given (saved with a failing batch)
        built = drill_plan(spec, self.overrides, allow_factories)
        self.spec, self.seed, self.plan, self.tasks = built.spec, seed, built.plan, built.tasks
        p = self.plan
        self.phases = dict.fromkeys(PHASES[3:], 0.0)
        self.buffers = StaticBuffers(p, device)
        # An accelerator's kernels pick their reduction order by shape (the padded replay and the live-rows
        # reference differ), so one rounding step of the output dtype is not an error there.
        self.rounding = self.buffers.device.type != "cpu"
        self.generator = torch.Generator().manual_seed(seed)
        self.relations = _relations(built.spec, allow_factories)
        for task in self.tasks:
            task.bind(self.buffers, self.generator)
        self.max_requests = p.capture_sizes[-1] // p.tokens_per_request
        warm = sample(sources(p, self.max_requests, relations=self.relations), seed=seed)[0]
        self.buffers.refresh(p.capture_sizes[-1], warm, num_reqs=self.max_requests)
        rows = [getattr(t, "output_rows", "tokens") for t in self.tasks]
        # A failed capture is reported (FAIL), not raised.
        self.runner = GraphRunner(self.buffers, self.step, output_rows=rows, on_capture_error="eager")
        self._capturing: set[int] | None = None
        self._progress = progress
        if capture:
            self.capture()

    def capture(self) -> None:
        """Capture every size (a size that fails is reported in ``runner.stats``, and runs eagerly)."""
        progress, n = self._progress, len(self.plan.capture_sizes)
        self._capturing = set()
        if progress is not None:
            progress("capture", 0, n)
        try:
            self.runner.capture()
        finally:
            self._capturing = None
        if progress is not None:
            progress("capture", n, n)

    def step(self, step: Step) -> tuple[torch.Tensor, ...]:
        """Every task on one step (the runner's callable)."""
        if self._capturing is not None and step.size not in self._capturing:
            self._capturing.add(step.size)
            if self._progress is not None:  # the size now being captured; the ones before it are done
                self._progress("capture", len(self._capturing) - 1, len(self.plan.capture_sizes))
        return tuple(task(step) for task in self.tasks)

    def host_args(self, size: int, live: int, srcs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for task in self.tasks:
            if hasattr(task, "host_args"):
                out.update(task.host_args(size, live, srcs))
        return out

    def randomize(self, live: int, task_seed: int) -> None:
        """New task inputs (queries, KV) for a batch of ``live`` requests, drawn from ``task_seed``."""
        self.generator.manual_seed(task_seed)
        for task in self.tasks:
            task.randomize(live, self.generator)

    def check(self, live: int, srcs: Mapping[str, Any], task_seed: int) -> Outcome:
        """Replay one batch (eager above the largest size) and compare with the tasks on the raw batch."""
        tpr = self.plan.tokens_per_request
        self.randomize(live, task_seed)
        size = self.runner.size_for(live)
        phases, clock, refresh_s = self.phases, time.perf_counter, self.runner.stats.refresh_s
        try:
            args = self.host_args(size or live * tpr, live, srcs)
            run = stage_sources(self.buffers, srcs) if self.staged and size is not None else srcs
            refreshed, t0 = refresh_s.total, clock()
            got = tuple(t.clone() for t in self.runner.run(run, num_reqs=live, host_args=args))
            t1 = clock()
            phases["refresh"] += refresh_s.total - refreshed
            phases["replay"] += t1 - t0 - (refresh_s.total - refreshed)
            ref = _reference_views(self.buffers, srcs)
            want = self.step(Step(live * tpr, ref, None, args, live))
            t0 = clock()
            phases["eager_reference"] += t0 - t1
        except Exception as exc:  # a kernel fault or a rejected batch is a failure the drill reports
            return Outcome(size, math.inf, f"{type(exc).__name__}: {exc}")
        if any(g.shape != w.shape for g, w in zip(got, want)):
            shapes = ", ".join(f"{list(g.shape)} vs {list(w.shape)}" for g, w in zip(got, want))
            return Outcome(size, math.inf, f"output shapes differ (replay vs eager): {shapes}")
        err = max((output_error(g, w, self.rounding) if g.numel() else 0.0) for g, w in zip(got, want))
        phases["compare"] += clock() - t0
        return Outcome(size, math.inf if math.isnan(err) else err)


def _relations(spec: GraphSpec, allow_factories: Iterable[str]) -> tuple[Relation, ...]:
    if spec.tasks:
        return task_relations(spec, allow_factories)
    builtin = task_strategy(PAGED_DECODE.factory)
    return (builtin,) if builtin is not None else ()


# ----------------------------------------------------------------------------------------------------------
# Batches the drill draws, and the file a failing one is saved to


@dataclass(frozen=True)
class DrillBatch:
    """One drawn batch: ``live`` requests, their sources, and the seed of the tasks' random inputs."""

    live: int
    sources: dict[str, Any]
    task_seed: int


def drill_batches(session: DrillSession, lo: int = 1, hi: int | None = None) -> SearchStrategy[DrillBatch]:
    """Batches of ``lo..hi`` requests (default: up to a few above the largest capture size, which run
    eagerly) drawn through :func:`graphbuf.testing.sources` and the tasks' relations."""
    top = session.max_requests
    if hi is None:
        hi = min(OVERSIZE * top, top + max(2, top // 4))
    p, rels = session.plan, session.relations
    return st.builds(
        lambda pair, task_seed: DrillBatch(pair[0], pair[1], task_seed),
        st.integers(lo, hi).flatmap(lambda live: sources(p, live, relations=rels).map(lambda s: (live, s))),
        st.integers(0, 2**31 - 1),
    )


BATCH_FORMAT = "graphbuf-drill-batch/1"


def save_batch(path: str | Path, session: DrillSession, batch: DrillBatch, outcome: Outcome) -> None:
    """Write ``batch`` as JSON with what replays it: spec name, seed, constants, device."""
    srcs = {}
    for name, src in batch.sources.items():
        arr = src.float().numpy() if isinstance(src, torch.Tensor) else np.asarray(src)
        srcs[name] = {"dtype": session.plan[name].dtype_name, "shape": list(arr.shape),
                      "data": arr.reshape(-1).tolist()}  # fmt: skip
    doc = {
        "format": BATCH_FORMAT,
        "spec": session.spec.name,
        "seed": session.seed,
        "overrides": session.overrides,
        "device": str(session.buffers.device),
        "num_reqs": batch.live,
        "size": outcome.size,
        "task_seed": batch.task_seed,
        "max_abs_error": outcome.err if math.isfinite(outcome.err) else None,
        "error": outcome.error,
        "sources": srcs,
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


SEED_MAX = 2**63 - 1
"""The largest seed (``--seed``, and the seeds a saved batch holds): what a torch generator takes."""


def _check_seed(what: str, seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise UsageError(f"{what} {seed!r}: must be an integer in [0, 2**63 - 1]")
    return seed


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a saved batch may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of the float64 range")
    return value


def load_batch(path: str | Path, max_bytes: int | None = None) -> dict[str, Any]:
    """A saved batch file (see :func:`save_batch`), its top-level fields checked. :class:`BatchFileError`
    (naming the file and the field) if it is missing, larger than ``max_bytes`` (the spec's
    ``limits.max_bytes``), nested too deep, holds a non-finite number, or is not a batch."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise BatchFileError(f"{path}: {size} bytes, above limits.max_bytes ({max_bytes}): not read")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BatchFileError(f"--replay {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"{path}: cannot read a saved drill batch: {exc}") from None
    try:
        doc = json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant)
    except RecursionError:
        raise BatchFileError(f"{path}: not a saved drill batch: JSON nested too deep") from None
    except ValueError as exc:
        raise BatchFileError(f"{path}: cannot read a saved drill batch: {str(exc)[:200]}") from None
    if not isinstance(doc, dict) or doc.get("format") != BATCH_FORMAT:
        raise BatchFileError(f'{path}: not a saved drill batch (expected "format": {BATCH_FORMAT!r})')
    for key, kind in (("seed", int), ("device", str), ("overrides", dict), ("sources", dict)):
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise BatchFileError(f"{path}: malformed saved drill batch: {key!r} must be a {kind.__name__}")
    try:
        _check_seed("seed", doc["seed"])
    except UsageError as exc:
        raise BatchFileError(f"{path}: {exc}") from None
    for name, value in doc["overrides"].items():
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > SEED_MAX:
            raise BatchFileError(
                f"{path}: overrides.{name}: {str(value)[:40]} is not an integer within ±(2**63 - 1)"
            )
    return doc


def _malformed(path: str | Path, where: str, what: str) -> BatchFileError:
    return BatchFileError(f"{path}: malformed saved drill batch: {where}: {what}")


def _int_in(path: str | Path, what: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _malformed(path, what, f"{str(value)[:40]} is not an integer in [{lo}, {hi}]")
    return value


def _values(path: str | Path, where: str, entry: Any, dtype: str) -> np.ndarray:
    """One saved source's values, checked: shape of non-negative ints matching the data, every value a
    number that fits ``dtype`` (an integer dtype takes integers only)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("data"), list):
        raise _malformed(path, where, 'expected {"dtype": ..., "shape": [...], "data": [...]}')
    data, shape = entry["data"], entry.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 2:
        raise _malformed(path, f"{where}.shape", "expected a list of 1 or 2 sizes")
    for i, n in enumerate(shape):
        _int_in(path, f"{where}.shape[{i}]", n, 0, 2**31 - 1)
    if math.prod(shape) != len(data):
        raise _malformed(path, where, f"shape {shape} does not hold the {len(data)} values of data")
    if dtype in ("bfloat16", "float16", "float32", "float64"):
        hi_f = float(torch.finfo(getattr(torch, dtype)).max)
        lo_f = -hi_f
        for i, v in enumerate(data):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo_f <= v <= hi_f:
                raise _malformed(path, f"{where}.data[{i}]", f"{str(v)[:40]} is not a {dtype} value")
        return np.asarray(data, dtype=np.float64).reshape(shape)
    if dtype == "bool":
        info_lo, info_hi = 0, 1
    else:
        info = np.iinfo(dtype)
        info_lo, info_hi = int(info.min), int(info.max)
    for i, v in enumerate(data):
        _int_in(path, f"{where}.data[{i}]", v, info_lo, info_hi)
    return np.asarray(data, dtype=np.int64).reshape(shape)


def _batch_of(doc: Mapping[str, Any], session: DrillSession, path: str | Path) -> DrillBatch:
    if doc.get("spec") != session.spec.name:
        saved = str(doc.get("spec"))[:80]
        raise BatchFileError(f"{path}: saved from spec {saved!r}, not {session.spec.name!r}")
    most = OVERSIZE * session.max_requests
    live = _int_in(path, "num_reqs", doc.get("num_reqs"), 1, most)
    task_seed = _int_in(path, "task_seed", doc.get("task_seed"), 0, SEED_MAX)
    srcs = {}
    for name, entry in doc["sources"].items():
        if name not in session.plan.names:
            raise BatchFileError(f"{path}: sources.{str(name)[:80]}: no such buffer in {session.spec.name!r}")
        b = session.plan[name]
        values = _values(path, f"sources.{name}", entry, b.dtype_name)
        srcs[name] = as_source(b, values)
    return DrillBatch(live, srcs, task_seed)


def _blame_replay_file(
    spec: str | GraphSpec,
    doc: Mapping[str, Any],
    overrides: Mapping[str, int] | None,
    allow_factories: Iterable[str],
    path: str | Path,
) -> dict[str, int]:
    """The file's overrides under the command line's; one the spec refuses is the file's error (the spec
    without them is checked first, so the spec's own errors stay its own)."""
    merged = {**doc["overrides"], **(overrides or {})}
    if not doc["overrides"]:
        return merged
    try:
        drill_plan(spec, merged, allow_factories)
    except SpecError as exc:
        drill_plan(spec, overrides, allow_factories)  # raises if the spec (or --set) is at fault
        shown = json.dumps(doc["overrides"])[:200]
        raise BatchFileError(f"{path}: overrides {shown}: {exc}") from None
    return merged


# ----------------------------------------------------------------------------------------------------------


def run_drill(
    spec: str | GraphSpec,
    *,
    device: str = "cpu",
    replays: int = 200,
    seed: int = 0,
    overrides: Mapping[str, int] | None = None,
    tolerance: float = 1e-4,
    progress: Callable[[str, int, int], None] | None = None,
    allow_factories: Iterable[str] = (),
    save: str | Path | None = None,
    replay: str | Path | None = None,
    import_seconds: float = 0.0,
    staged: bool = False,
) -> DrillReport:
    """Run the drill and return its report (see the module docstring).

    ``replays`` bounds the batches drawn: first one per capture size (a request count only that size
    holds), then random ones through Hypothesis from ``seed``. A failing batch is shrunk (Hypothesis'
    shrinker; its calls are counted in ``report.shrink_replays``) and, with ``save``, written there as JSON.
    ``replay``: run only the batch saved in that file, with its seed, constants and device.
    ``allow_factories``: modules whose unregistered task factories may be imported (see
    :mod:`graphbuf.spec.factories`). ``progress(phase, done, total)``: called as sizes are captured (phase
    ``"capture"``) and batches replayed (``"replay"``). ``import_seconds``: what the caller spent importing
    the drill, counted as the ``import`` phase of ``report.phases``."""
    started = time.perf_counter()
    if isinstance(replays, bool) or not isinstance(replays, int) or replays < 0:
        raise UsageError(f"--replays {replays!r}: must be an integer ≥ 0")
    _check_seed("--seed", seed)
    doc = None
    if replay is not None:
        doc = load_batch(replay, _spec_of(spec, overrides, allow_factories).limits.max_bytes)
        seed, device = int(doc["seed"]), str(doc["device"])
        overrides = _blame_replay_file(spec, doc, overrides, allow_factories, replay)
    session = DrillSession(
        spec, device=device, seed=seed, overrides=overrides, allow_factories=allow_factories,
        progress=progress, capture=False, staged=staged,
    )  # fmt: skip
    saved = _batch_of(doc, session, replay) if doc is not None else None  # checked before capture
    session.capture()
    captured = time.perf_counter() - started
    p, runner = session.plan, session.runner
    start_addresses = {s: session.buffers.addresses(s) for s in p.capture_sizes}
    report = DrillReport(
        spec=session.spec.name,
        device=device,
        tasks=[getattr(t, "name", type(t).__name__) for t in session.tasks],
        tolerance=tolerance,
        rows={s: SizeRow(s) for s in p.capture_sizes},
        rounding=session.rounding,
        capture_failures=dict(runner.stats.capture_failures),
        staged=staged,
    )

    def record(batch: DrillBatch, out: Outcome) -> None:
        if out.size is None or out.size in runner.stats.capture_failures:
            report.eager_runs += 1
            report.eager_max_abs_error = max(report.eager_max_abs_error, out.err)
            return
        row = report.rows[out.size]
        row.replays += 1
        row.max_abs_error = max(row.max_abs_error, out.err)
        if out.error is None:
            row.refresh_us.append(runner.stats.refresh_s.last * 1e6)

    def failed(out: Outcome) -> bool:
        return out.err > tolerance

    first: tuple[DrillBatch, Outcome] | None = None
    if saved is not None:
        batch = saved
        if progress is not None:
            progress("replay", 0, 1)
        out = session.check(batch.live, batch.sources, batch.task_seed)
        record(batch, out)
        if progress is not None:
            progress("replay", 1, 1)
        if failed(out):
            first = (batch, out)
        minimal = first
    else:
        done = 0
        # One batch per capture size (a request count only that size holds), drawn through the strategies.
        bands, lo = [], 1
        for s in p.capture_sizes:
            hi = s // p.tokens_per_request
            bands.append(drill_batches(session, min(lo, hi), hi))
            lo = hi + 1
        sweep = list(sample(st.tuples(*bands[:replays]), seed=seed)[0]) if replays and bands else []
        if progress is not None:
            progress("replay", 0, replays)
        for batch in sweep:
            out = session.check(batch.live, batch.sources, batch.task_seed)
            record(batch, out)
            done += 1
            if progress is not None:
                progress("replay", done, replays)
            if first is None and failed(out):
                first = (batch, out)
        budget = replays - done if first is None else max(replays - done, 2 * len(p.capture_sizes))
        minimal = _search(session, budget, seed, first, failed, record, progress, done, replays, report)
    for s, addrs in start_addresses.items():
        report.rows[s].addresses_stable = session.buffers.addresses(s) == addrs
    if minimal is not None:
        batch, out = minimal
        report.failure = {
            "num_reqs": batch.live,
            "size": out.size,
            "max_abs_error": out.err if math.isfinite(out.err) else None,
            "error": out.error,
            "saved": str(save) if save is not None else None,
        }
        if save is not None:
            save_batch(save, session, batch, out)
    report.stats = runner.stats.as_dict()
    report.seconds = time.perf_counter() - started + import_seconds
    phases = {"import": import_seconds, "capture": captured, **session.phases}
    # The rest: batches drawn, Hypothesis' search and shrinking.
    phases["draw"] = max(0.0, report.seconds - sum(phases.values()))
    report.phases = {k: phases[k] for k in PHASES}
    return report


def _search(
    session: DrillSession,
    budget: int,
    seed: int,
    first: tuple[DrillBatch, Outcome] | None,
    failed: Callable[[Outcome], bool],
    record: Callable[[DrillBatch, Outcome], None],
    progress: Callable[[str, int, int], None] | None,
    done: int,
    replays: int,
    report: DrillReport,
) -> tuple[DrillBatch, Outcome] | None:
    """Draw up to ``budget`` batches through Hypothesis; shrink the first failure with at most
    ``max(replays, 50)`` more replays; return the smallest failing batch seen (None if none failed)."""
    found: list[tuple[DrillBatch, Outcome]] = [first] if first is not None else []
    shrinking = [first is not None]
    count = [done]
    seen: dict[tuple[Any, ...], bool] = {}  # a batch seen again answers the same, without a replay
    shrink_budget = max(replays, 50)

    def fails(batch: DrillBatch) -> bool:
        key = _key(batch)
        if key in seen:
            return seen[key]
        if shrinking[0] and report.shrink_replays >= shrink_budget:
            return False  # shrink budget spent: report the smallest failure so far
        out = session.check(batch.live, batch.sources, batch.task_seed)
        if shrinking[0]:
            report.shrink_replays += 1
        else:
            record(batch, out)
            count[0] += 1
            if progress is not None:
                progress("replay", count[0], replays)
        seen[key] = failed(out)
        if seen[key]:
            shrinking[0] = True
            found.append((batch, out))
        return seen[key]

    if budget > 0:
        config = settings(
            max_examples=budget, database=None, deadline=None, derandomize=False,
            phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        # NoSuchExample: nothing failed; any other Hypothesis error: report what was seen.
        with contextlib.suppress(HypothesisException):
            find(drill_batches(session), fails, settings=config, random=random.Random(seed))
    return min(found, key=lambda f: (f[0].live, _cells(f[0]))) if found else None


def _cells(batch: DrillBatch) -> int:
    return sum(int(np.prod(np.shape(s))) for s in batch.sources.values())


def _key(batch: DrillBatch) -> tuple[Any, ...]:
    arrays = (
        (name, src.float().numpy() if isinstance(src, torch.Tensor) else np.asarray(src))
        for name, src in batch.sources.items()
    )
    return (batch.live, batch.task_seed, *((n, a.shape, a.tobytes()) for n, a in arrays))


def run_drill_cli(args: argparse.Namespace, overrides: Mapping[str, int], import_seconds: float = 0.0) -> int:
    """The ``graphbuf drill`` command (see :mod:`graphbuf.cli`, which checked its arguments before torch was
    imported); ``overrides`` are its parsed ``--set``, ``import_seconds`` what importing this module cost (the
    ``import`` phase)."""
    replays = default_replays() if args.replays is None else args.replays
    progress = Progress()
    save = args.save
    if save is None and args.replay is None:
        fd, save = tempfile.mkstemp(prefix="graphbuf-drill-", suffix=".json")
        os.close(fd)
    try:
        report = run_drill(
            args.spec,
            device=args.device,
            replays=replays,
            seed=args.seed,
            overrides=overrides,
            progress=progress,
            allow_factories=args.allow_factory,
            save=save if args.replay is None else None,
            replay=args.replay,
            import_seconds=import_seconds,
            staged=args.staged,
        )
    except BaseException:
        if args.save is None and args.replay is None:
            os.unlink(save)
        raise
    finally:
        progress.close()
    if args.save is None and args.replay is None and report.failure is None:
        os.unlink(save)  # nothing failed: no file to keep
    if report.failure is not None and args.replay is None:
        allow = "".join(f" --allow-factory {shlex.quote(m)}" for m in args.allow_factory)
        report.failure["replay_command"] = (
            f"{getattr(args, 'program', 'graphbuf')} drill {shlex.quote(args.spec)} --replay "
            f"{shlex.quote(str(save))}{allow}"
        )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1

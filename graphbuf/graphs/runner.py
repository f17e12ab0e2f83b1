"""GraphRunner: capture a callable at every capture size, then refresh → check → update → replay.

The callable reads its inputs from :class:`graphbuf.StaticBuffers` views and receives a :class:`Step`::

    def attention(step: Step) -> torch.Tensor:
        bt, lens = step.views["block_table.full"], step.views["seq_lens"]
        return step.task("attention", kernel, query, bt, lens, out, seq_lens_kv=...)  # see Step.task

Per :meth:`GraphRunner.run`: pick the smallest capture size that fits the live batch; check, in one pass,
that every tensor the graph uses (its buffers, task tensor arguments, and every other tensor from before
capture it reads or writes) is alive and at its captured address, shape and stride, before any byte is
refreshed (every replay, not a debug mode); refresh the buffers; re-issue captured tasks whose host
arguments changed; replay; return the live output rows. Batches above the largest capture size and sizes
refused by first-use verification run eagerly; :class:`RunnerStats` counts every replay, fallback and
reason. A capture that fails raises :class:`~graphbuf.errors.CaptureError` unless the runner was built with
``on_capture_error="eager"``.

The returned tensors are views of the graph's static outputs: the next replay of that size overwrites
them. Clone what you keep. A runner serves one caller at a time: a call while another thread is inside
:meth:`GraphRunner.run` or :meth:`GraphRunner.capture` raises :class:`~graphbuf.errors.ConcurrentUseError`
(use one runner per thread, or serialize the calls).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbuf.buffers import StaticBuffers
from graphbuf.errors import CaptureError, ConcurrentUseError, RefreshError, SpecError
from graphbuf.expr import Expr, ExprError, parse_expr
from graphbuf.graphs.graph import Graph
from graphbuf.refresh import BoundSources, check_num_reqs

__all__ = [
    "EAGER_CAPTURE_FAILED",
    "EAGER_REFUSED",
    "EAGER_TOO_LARGE",
    "OVERSIZE",
    "Durations",
    "GraphRunner",
    "RunnerStats",
    "Step",
]

#: Reasons a step runs eagerly (keys of ``RunnerStats.eager_reasons``); details live in
#: ``RunnerStats.capture_failures`` and ``RunnerStats.refused``.
EAGER_TOO_LARGE = "batch above the largest capture size"
EAGER_CAPTURE_FAILED = "capture failed at this size"
EAGER_REFUSED = "graph refused by first-use verification"

#: Eager batches a task sizes its static inputs for: up to this many times the largest capture size (the
#: drill's largest batch; the adapter's task inputs).
OVERSIZE = 2

Output = torch.Tensor | tuple[torch.Tensor, ...]

ON_CAPTURE_ERROR = ("raise", "eager")

_log = logging.getLogger(__name__)


@dataclass
class Step:
    """What the captured callable receives.

    ``size`` is the token count the step runs at (a capture size, or the live token count when eager);
    ``views`` the buffers for that size; ``graph`` the Graph being captured (None when eager);
    ``host_args`` the host task arguments of this step, by task kind.
    """

    size: int
    views: Mapping[str, torch.Tensor]
    graph: Graph | None
    host_args: Mapping[str, Mapping[str, Any]]
    requests: int

    def task(self, kind: str, fn: Callable[..., Any], *tensors: Any, **host_args: Any) -> Any:
        """Run ``fn(*tensors, **host_args)`` as a captured task of ``kind`` (plain call when eager).

        The host arguments given for ``kind`` in this step (``run(host_args=...)``) override the defaults
        passed here; a captured task is re-issued before replay whenever they change.
        """
        args = {**host_args, **self.host_args.get(str(kind), {})}
        if self.graph is None:
            return fn(*tensors, **args)
        return self.graph.task(kind, fn, *tensors, **args)


class Durations:
    """A fixed-size summary of timed calls: count, total, last, min, max, and the ``RECENT`` latest samples.

    Its memory never grows with the number of calls (the recent samples are a ring).
    """

    RECENT = 1024

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=self.RECENT)
        self.clear()

    def clear(self) -> None:
        """Forget every sample."""
        self.count = 0
        self.total = 0.0
        self.last = 0.0
        self.min = float("inf")
        self.max = 0.0
        self._recent.clear()

    def add(self, seconds: float) -> None:
        """Record one call of ``seconds``."""
        self.count += 1
        self.total += seconds
        self.last = seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds
        self._recent.append(seconds)

    @property
    def recent(self) -> tuple[float, ...]:
        """The latest samples, oldest first (at most ``RECENT``)."""
        return tuple(self._recent)

    def __repr__(self) -> str:
        return f"Durations(count={self.count}, total={self.total:.6g}, last={self.last:.6g})"


@dataclass
class RunnerStats:
    """Counters a user can read: replays and eager runs per capture size, fallback reasons, refusals, and
    the seconds spent in each replay's refresh (``refresh_s``, a fixed-size :class:`Durations`). Every
    field is bounded: keyed by capture size or reason, never by call."""

    replays: int = 0
    eager: int = 0
    task_updates: int = 0
    replays_by_size: Counter = field(default_factory=Counter)
    eager_reasons: Counter = field(default_factory=Counter)
    capture_failures: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    refresh_s: Durations = field(default_factory=Durations)

    def as_dict(self) -> dict[str, Any]:
        return {
            "replays": self.replays,
            "eager": self.eager,
            "task_updates": self.task_updates,
            "replays_by_size": dict(self.replays_by_size),
            "eager_reasons": dict(self.eager_reasons),
            "capture_failures": {str(k): v for k, v in self.capture_failures.items()},
            "refused": {str(k): v for k, v in self.refused.items()},
        }


@dataclass
class _Captured:
    graph: Graph
    output: Output
    verified: bool = False


class GraphRunner:
    """Captures ``fn`` at every capture size of ``buffers`` and replays it for live batches.

    Args:
        buffers: the StaticBuffers the callable reads (their device is the graph device).
        fn: ``fn(step: Step) -> Tensor | tuple[Tensor, ...]``; outputs' first dimension follows
            ``output_rows``. It must be graph-safe: no host reads of device values, no data-dependent shapes.
        output_rows: rule for the live output rows, an expression over ``tokens``/``requests``/constants;
            a sequence gives one rule per output of a tuple.
        verify: compare the first replay of each size with an eager run on the same inputs; on mismatch
            refuse that graph (eager from then on, reason recorded in ``stats.refused``).
        rtol, atol: the verification tolerance.
        warmup: eager runs before capturing each size on devices that need it (cuda, npu).
        on_capture_error: ``"raise"`` (default): a capture that fails raises :class:`CaptureError` naming
            the size and the cause, after every buffer is restored; ``"eager"``: that size runs eagerly
            from then on, with one logged warning per size and the reason in ``stats.capture_failures``.

    Raises :class:`~graphbuf.errors.SpecError` (a GraphbufError) for an ``output_rows`` rule that does not
    parse or uses a name other than ``tokens``, ``requests`` and the spec's constants; ValueError for an
    unknown ``on_capture_error``.
    """

    def __init__(
        self,
        buffers: StaticBuffers,
        fn: Callable[[Step], Output],
        *,
        output_rows: str | Sequence[str] = "tokens",
        verify: bool = False,
        rtol: float = 1e-5,
        atol: float = 1e-5,
        warmup: int = 2,
        on_capture_error: str = "raise",
    ) -> None:
        if on_capture_error not in ON_CAPTURE_ERROR:
            raise ValueError(
                f"on_capture_error={on_capture_error!r}; allowed: "
                + ", ".join(repr(v) for v in ON_CAPTURE_ERROR)
            )
        self.on_capture_error = on_capture_error
        self.buffers = buffers
        self.fn = fn
        self.device = buffers.device
        self.verify = verify
        self.rtol, self.atol = rtol, atol
        self.warmup = warmup if self.device.type != "cpu" else 0
        self.stats = RunnerStats()
        self._output_rows = _parse_rows(output_rows, buffers.plan.constants)
        self._rows_memo: dict[int, list[int]] = {}
        self._graphs: dict[int, _Captured] = {}
        self._tpr = buffers.plan.tokens_per_request
        self._max_requests = buffers.capture_sizes[-1] // self._tpr
        self._capture_called = False
        self._busy = threading.Lock()  # taken without blocking: a second caller is an error, not a waiter

    # ------------------------------------------------------------------------------------------------------

    def capture(self, host_args: Callable[[int], Mapping[str, Mapping[str, Any]]] | None = None) -> None:
        """Capture ``fn`` at every capture size, largest first, sharing one memory pool.

        ``host_args(size)`` gives the host task arguments to capture with at ``size`` (default: the
        defaults the callable passes to :meth:`Step.task`); :meth:`run` re-issues tasks with fresh ones.

        A size whose capture raises (warm-up runs included) restores every buffer to its bytes from before
        :meth:`capture` and raises :class:`CaptureError` naming the size and the cause; with
        ``on_capture_error="eager"`` it is left uncaptured instead (it runs eagerly; one warning is logged
        and ``stats.capture_failures`` holds the reason) and the other sizes still capture. Buffers should
        hold valid data (e.g. after a refresh) or their pads: capture runs the callable once per size.
        """
        with self._exclusive("capture()"):
            self._capture(host_args)

    def _capture(self, host_args: Callable[[int], Mapping[str, Mapping[str, Any]]] | None) -> None:
        self._capture_called = True
        saved = {name: t.clone() for name, t in self.buffers.full.items()}
        pool = None
        for size in sorted(self.buffers.capture_sizes, reverse=True):
            views = self.buffers.view(size)
            args = host_args(size) if host_args is not None else {}
            step = Step(size, views, None, args, size // self._tpr)
            try:
                for _ in range(self.warmup):
                    self._warm(step)
                graph = Graph(self.device)
                with graph.capture(pool=pool):
                    output = self.fn(Step(size, views, graph, args, size // self._tpr))
            except Exception as exc:
                with torch.no_grad():
                    for name, t in self.buffers.full.items():
                        t.copy_(saved[name])
                cause = f"{type(exc).__name__}: {exc}"
                if self.on_capture_error == "raise":
                    raise CaptureError(
                        f"capture at size {size} (tokens; {size // self._tpr} requests) failed: {cause}. "
                        "Every buffer was restored. Fix the callable, or build the runner with "
                        "on_capture_error='eager' to run that size eagerly."
                    ) from exc
                self.stats.capture_failures[size] = cause
                _log.warning(
                    "graphbuf: capture at size %d failed, that size runs eagerly (several times slower): %s",
                    size,
                    cause,
                )
                continue
            if pool is None:
                pool = graph.pool()
            graph.name_inputs({f"buffer {name!r} at size {size}": t for name, t in views.items()})
            self._graphs[size] = _Captured(graph, output)

    def _warm(self, step: Step) -> None:
        stream = getattr(torch, self.device.type).Stream()
        stream.wait_stream(getattr(torch, self.device.type).current_stream())
        with getattr(torch, self.device.type).stream(stream):
            self.fn(step)
        getattr(torch, self.device.type).current_stream().wait_stream(stream)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest capture size holding ``num_reqs`` requests (None if none does)."""
        tokens = num_reqs * self._tpr
        for s in self.buffers.capture_sizes:
            if s >= tokens:
                return s
        return None

    def check_addresses(self, size: int) -> None:
        """Check, in one pass, that every tensor the graph captured at ``size`` uses (buffers, task tensor
        arguments, other tensors from before capture) is alive and unmoved; raise
        :class:`~graphbuf.errors.LivenessError` or :class:`~graphbuf.errors.AddressChangedError` naming it."""
        self._graphs[size].graph.check_inputs()

    def watched(self, size: int) -> tuple[str, ...]:
        """Labels of the tensors checked before each replay of the graph captured at ``size``."""
        return self._graphs[size].graph.watched

    @contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError(
                f"GraphRunner.{call} while another call is running on this runner (from another thread, or "
                "from inside the captured callable); a runner's graphs, buffers and outputs serve one caller "
                "at a time. Use one runner per thread, or serialize the calls."
            )
        try:
            yield
        finally:
            self._busy.release()

    def _live_requests(self, sources: Mapping[str, Any] | BoundSources, num_reqs: int | None) -> int:
        if num_reqs is not None:
            return check_num_reqs(num_reqs, None, "run()")
        if isinstance(sources, BoundSources):
            raise RefreshError("run(): bound sources carry no row counts; pass num_reqs=")
        if not isinstance(sources, Mapping):
            raise RefreshError(
                f"run(): sources must be a mapping or BoundSources, got {type(sources).__name__}"
            )
        p = self.buffers.plan
        for name, src in sources.items():
            if name in p.names and p[name].rows.names & {"tokens", "requests"}:
                try:
                    rows = len(src)
                except TypeError:
                    continue  # not a sequence of rows: the refresh names what is wrong with it
                n = p.requests_for_rows(name, rows)
                if n is not None:
                    return n
        raise RefreshError("run(): no source determines the live request count; pass num_reqs=")

    def run(
        self,
        sources: Mapping[str, Any] | BoundSources,
        *,
        num_reqs: int | None = None,
        widths: Mapping[str, int] | None = None,
        host_args: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Output:
        """Run one step for the live batch described by ``sources``; return the live output rows.

        ``sources``: a mapping as :meth:`StaticBuffers.refresh` takes, or :class:`BoundSources` bound to
        this runner's buffers; then ``num_reqs`` is required and ``widths`` gives 2-D live widths.

        Raises :class:`CaptureError` before :meth:`capture`, :class:`ConcurrentUseError` while another
        thread is inside this runner, :class:`~graphbuf.errors.LivenessError` /
        :class:`~graphbuf.errors.AddressChangedError` (before any buffer byte is written) if a tensor the
        graph uses was freed or moved, and :class:`RefreshError` for rejected sources.
        """
        with self._exclusive("run()"):
            return self._run(sources, num_reqs, widths, host_args)

    def _run(
        self,
        sources: Mapping[str, Any] | BoundSources,
        num_reqs: int | None,
        widths: Mapping[str, int] | None,
        host_args: Mapping[str, Mapping[str, Any]] | None,
    ) -> Output:
        if not self._capture_called:
            raise CaptureError("run() before capture(): call runner.capture() once before the first run()")
        bound = isinstance(sources, BoundSources)
        if bound and sources.buffers is not self.buffers:
            raise RefreshError("run(): these bound sources belong to other StaticBuffers than the runner's")
        if widths is not None and not bound:
            raise RefreshError(
                "run(): widths= applies to BoundSources; a mapping's sources carry their widths"
            )
        live = self._live_requests(sources, num_reqs)
        host_args = {str(kind): args for kind, args in (host_args or {}).items()}
        size = self.size_for(live)
        reason = None
        if size is None:
            reason = EAGER_TOO_LARGE
        elif size in self.stats.refused:
            reason = EAGER_REFUSED
        elif size not in self._graphs:
            reason = EAGER_CAPTURE_FAILED
        if reason is not None:
            return self._eager(sources, live, host_args, reason, widths)

        captured = self._graphs[size]
        checked = captured.graph.check_inputs()  # before any refresh byte is written
        t0 = time.perf_counter()
        if bound:
            sources.refresh(size, live, widths=widths)  # type: ignore[union-attr]
        else:
            self.buffers.refresh(size, sources, num_reqs=live)  # type: ignore[arg-type]
        self.stats.refresh_s.add(time.perf_counter() - t0)
        self.stats.task_updates += captured.graph.reissue(host_args)
        captured.graph.replay(checked=checked)  # refresh and task updates move nothing: no second pass
        self.stats.replays += 1
        self.stats.replays_by_size[size] += 1
        out = self.live_rows(captured.output, live)
        if self.verify and not captured.verified:
            captured.verified = True
            # An eager run may write the same preallocated outputs (NPU-style out= tasks): compare a copy.
            out = _clone(out)
            step = Step(size, self.buffers.view(size), None, host_args, live)
            expected = self.live_rows(self.fn(step), live)
            problem = _mismatch(out, expected, self.rtol, self.atol)
            if problem is not None:
                self.stats.refused[size] = f"first replay differs from eager: {problem}"
                return expected
        return out

    def live_rows(self, output: Output, live: int) -> Output:
        """The first rows of each of the step function's outputs that ``live`` requests fill, by the
        ``output_rows`` rules (views, no copy)."""
        rows = self._rows_memo.get(live)
        if rows is None:  # evaluated once per captured live count; eager counts (any size) each time
            env = {**self.buffers.plan.constants, "requests": live, "tokens": live * self._tpr}
            rows = [rule.eval(env) for rule in self._output_rows]
            if live * self._tpr <= self.buffers.capture_sizes[-1]:  # bounded by the capture range
                self._rows_memo[live] = rows
        if isinstance(output, torch.Tensor):
            return output[: rows[0]]
        if len(rows) == 1:
            rows = rows * len(output)
        if len(rows) != len(output):
            raise ValueError(f"output_rows has {len(rows)} rules for {len(output)} outputs")
        return tuple(o[:n] for o, n in zip(output, rows))

    def _eager(
        self,
        sources: Mapping[str, Any] | BoundSources,
        live: int,
        host_args: Mapping[str, Mapping[str, Any]],
        reason: str,
        widths: Mapping[str, int] | None = None,
    ) -> Output:
        # Validated and padded exactly as a refresh (same errors); the captured buffers are not touched.
        views = self.buffers.eager_inputs(live * self._tpr, sources, num_reqs=live, widths=widths)
        self.stats.eager += 1
        self.stats.eager_reasons[reason] += 1
        return self.live_rows(self.fn(Step(live * self._tpr, views, None, host_args, live)), live)


def _parse_rows(output_rows: str | Sequence[str], constants: Mapping[str, Any]) -> tuple[Expr, ...]:
    if not isinstance(output_rows, (str, list, tuple)):
        raise SpecError(
            f"GraphRunner output_rows: {output_rows!r} is {type(output_rows).__name__}; allowed: an "
            "expression string, or a list of them (one per output)"
        )
    rules = (output_rows,) if isinstance(output_rows, str) else tuple(output_rows)
    if not rules:
        raise SpecError("GraphRunner output_rows: no rule given; allowed: an expression or one per output")
    allowed = {"tokens", "requests", *constants}
    parsed = []
    for i, rule in enumerate(rules):
        where = "output_rows" if isinstance(output_rows, str) else f"output_rows[{i}]"
        if not isinstance(rule, (str, int)) or isinstance(rule, bool):
            raise SpecError(
                f"GraphRunner {where}: {rule!r} is {type(rule).__name__}; allowed: an expression string"
            )
        try:
            expr = parse_expr(rule)
        except ExprError as exc:
            raise SpecError(f"GraphRunner {where} {rule!r}: {exc}") from None
        unknown = sorted(expr.names - allowed)
        if unknown:
            raise SpecError(
                f"GraphRunner {where} {rule!r}: unknown name(s) {unknown}; allowed: tokens, requests"
                + (f" and the spec's constants ({', '.join(sorted(constants))})" if constants else "")
            )
        parsed.append(expr)
    return tuple(parsed)


def _clone(output: Output) -> Output:
    return output.clone() if isinstance(output, torch.Tensor) else tuple(o.clone() for o in output)


def _mismatch(got: Output, want: Output, rtol: float, atol: float) -> str | None:
    got_t = (got,) if isinstance(got, torch.Tensor) else got
    want_t = (want,) if isinstance(want, torch.Tensor) else want
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        if g.shape != w.shape:
            return f"output {i} shape {list(g.shape)} vs eager {list(w.shape)}"
        if not torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol, equal_nan=True):
            err = (g.float() - w.float()).abs().nan_to_num(float("inf")).max().item()
            return f"output {i} max abs error {err:.3g} (rtol={rtol}, atol={atol})"
    return None

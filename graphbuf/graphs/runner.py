"""GraphRunner: capture a callable at every capture size, then check → refresh → update → replay per step.

The callable reads its inputs from :class:`graphbuf.StaticBuffers` views and receives a :class:`Step`::

    def attention(step: Step) -> torch.Tensor:
        bt, lens = step.views["block_table.full"], step.views["seq_lens"]
        return step.task("attention", kernel, query, bt, lens, out, seq_lens_kv=...)  # see Step.task

Per :meth:`GraphRunner.run`, in this order: check the call's arguments (sources read once, the live request
count, host task arguments: known kinds, names and forms the captured tasks take) and work out the live
output rows by the ``output_rows`` rules; pick the smallest capture size that fits the live batch; check, in
one pass, that every tensor the graph uses (its buffers, task tensor arguments, and every other tensor from
before capture it reads or writes) is alive and at its captured address, shape, stride and dtype (every
replay, not a debug mode); check the output rows against the captured outputs; re-issue captured tasks
whose host arguments changed (all or nothing; a task's own function refusing them is a
:class:`~graphbuf.errors.TaskError`); only then refresh the buffers (:meth:`StaticBuffers.refresh`, which
validates every source before its first write; a refused refresh puts the previous host arguments back);
check the watched tensors again, immediately before the replay (code that ran during the refresh cannot
move one unseen); replay, and return the live output rows. Anything rejected before the refresh is
rejected before the first byte is written. Batches above the largest capture size and sizes
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
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbuf.buffers import BoundSources, check_num_reqs, read_call, requests_hint
from graphbuf.buffers.slab import StaticBuffers
from graphbuf.errors import ArgumentError, CaptureError, ReplayError, SpecError, TaskError, UsageError
from graphbuf.exclusive import Exclusive
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.tasks import TaskKind
from graphbuf.spec.expr import Expr, ExprError, parse_expr

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
    parse or uses a name other than ``tokens``, ``requests`` and the spec's constants;
    :class:`~graphbuf.errors.UsageError` (a ValueError) for an unknown ``on_capture_error``.

    ``buffers`` is fixed for the runner's life (its graphs read that slab): assigning ``runner.buffers``
    raises :class:`~graphbuf.errors.UsageError`.
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
        if not isinstance(buffers, StaticBuffers):
            raise ArgumentError(f"GraphRunner(buffers={type(buffers).__name__}): allowed: a StaticBuffers")
        if not callable(fn):
            raise ArgumentError(f"GraphRunner(fn={type(fn).__name__}): allowed: a callable taking a Step")
        if not isinstance(on_capture_error, str) or on_capture_error not in ON_CAPTURE_ERROR:
            raise UsageError(
                f"GraphRunner(on_capture_error={on_capture_error!r}): allowed: "
                + ", ".join(repr(v) for v in ON_CAPTURE_ERROR)
            )
        self.on_capture_error = on_capture_error
        self._buffers = buffers
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
        self._capture_called = False
        self._guard = Exclusive(
            "GraphRunner.{call} while another call is running on this runner (from another thread, or from "
            "inside the captured callable); a runner's graphs, buffers and outputs serve one caller at a "
            "time. Use one runner per thread, or serialize the calls."
        )

    @property
    def buffers(self) -> StaticBuffers:
        """The StaticBuffers this runner refreshes and its graphs read (fixed at construction)."""
        return self._buffers

    @buffers.setter
    def buffers(self, value: object) -> None:
        raise UsageError(
            "GraphRunner.buffers cannot be reassigned: the captured graphs read the slab of the buffers the "
            "runner was built with, so run() would refresh one slab and replay graphs that read another. "
            "Build a new GraphRunner for other buffers."
        )

    # ------------------------------------------------------------------------------------------------------

    def capture(self, host_args: Callable[[int], Mapping[str, Mapping[str, Any]]] | None = None) -> None:
        """Capture ``fn`` at every capture size, largest first, sharing one memory pool.

        ``host_args(size)`` gives the host task arguments to capture with at ``size`` (default: the
        defaults the callable passes to :meth:`Step.task`); :meth:`run` re-issues tasks with fresh ones.

        The buffers' guard (:meth:`StaticBuffers.hold`) is held for the whole capture: a refresh or staged
        write from another thread meanwhile raises :class:`~graphbuf.errors.ConcurrentUseError`, so a
        restore never reverts anyone's write. A size whose capture raises (warm-up runs included) restores
        every buffer to its bytes from before :meth:`capture` and raises :class:`CaptureError` naming the
        size and the cause; with ``on_capture_error="eager"`` it is left uncaptured instead (it runs
        eagerly; one warning is logged and ``stats.capture_failures`` holds the reason) and the other sizes
        still capture. Buffers should hold valid data (e.g. after a refresh) or their pads: capture runs the
        callable once per size.
        """
        with self._guard.hold("capture()"), self._buffers.hold("GraphRunner.capture()"):
            self._capture(host_args)

    def _capture(self, host_args: Callable[[int], Mapping[str, Mapping[str, Any]]] | None) -> None:
        self._capture_called = True
        saved = {name: t.clone() for name, t in self._buffers.full.items()}
        pool = None
        for size in sorted(self._buffers.capture_sizes, reverse=True):
            views = self._buffers.view(size)
            args = host_args(size) if host_args is not None else {}
            step = Step(size, views, None, args, size // self._tpr)
            try:
                for _ in range(self.warmup):
                    self._warm(step)
                dry = self.device.type == "cpu"  # the emulator records without computing, as a device does
                try:
                    graph, output = self._capture_size(size, views, args, pool, dry=dry)
                except Exception:
                    if not dry:
                        raise
                    self._restore(saved)  # an op failed on uncomputed values: capture computing
                    graph, output = self._capture_size(size, views, args, pool, dry=False)
            except Exception as exc:
                self._restore(saved)
                cause = _cause(exc)
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

    def _restore(self, saved: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in self._buffers.full.items():
                t.copy_(saved[name])

    def _capture_size(
        self, size: int, views: Mapping[str, torch.Tensor], args: Mapping[str, Any], pool: object, dry: bool
    ) -> tuple[Graph, Output]:
        graph = Graph(self.device)
        with graph.capture(pool=pool, dry=dry):
            output = self.fn(Step(size, views, graph, args, size // self._tpr))
        self._check_output(output)
        return graph, output

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
        for s in self._buffers.capture_sizes:
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

        Raises, before any buffer byte is written: :class:`CaptureError` before :meth:`capture`,
        :class:`~graphbuf.errors.ConcurrentUseError` while another thread is inside this runner,
        :class:`~graphbuf.errors.LivenessError` / :class:`~graphbuf.errors.AddressChangedError` if a tensor
        the graph uses (or a bound source) was freed or moved, :class:`~graphbuf.errors.TaskError` for
        ``host_args`` the captured tasks do not take, :class:`SpecError` for an ``output_rows`` rule that
        fails, goes negative or exceeds its output's rows at this count, and
        :class:`~graphbuf.errors.RefreshError` for rejected sources or counts. After the refresh (on the
        cpu emulator, which runs each op for real): :class:`~graphbuf.errors.ReplayError` naming the op and
        the size when an op fails on the values it reads (where a device would fault or assert).
        """
        with self._guard.hold("run()"):
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
        sources = read_call(self.buffers, sources, num_reqs, widths, "run()")  # read once, here
        if num_reqs is not None:
            live = check_num_reqs(num_reqs, None, "run()")
        else:  # a mapping (bound sources need num_reqs): its rows give the count
            live = requests_hint(self._buffers.layout, sources, "run()")  # type: ignore[arg-type]
        kinds = _host_args(host_args)
        size = self.size_for(live)
        reason = None
        if size is None:
            reason = EAGER_TOO_LARGE
        elif size in self.stats.refused:
            reason = EAGER_REFUSED
        elif size not in self._graphs:
            reason = EAGER_CAPTURE_FAILED
        if reason is not None:
            return self._eager(sources, live, kinds, reason, widths)

        rows = self._rows(live)
        captured = self._graphs[size]
        graph = captured.graph
        graph.check_inputs()  # before any refresh byte is written
        graph.check_reissue(kinds)
        out = self._slice(captured.output, rows, live)
        # Tasks re-issued before the refresh: a task's own function that rejects its host arguments fails
        # before any buffer byte is written; a refresh that fails then puts the previous arguments back.
        held = graph.held_args() if kinds else None
        updates = graph.reissue(kinds) if kinds else 0
        t0 = time.perf_counter()
        try:
            self._buffers.refresh(size, sources, num_reqs=live, widths=widths)
        except BaseException:
            if updates:
                graph.restore_args(held)  # type: ignore[arg-type]
            raise
        self.stats.refresh_s.add(time.perf_counter() - t0)
        self.stats.task_updates += updates
        # The watch runs again here, after the refresh and immediately before the replay: code that ran
        # during the refresh (a source's __array__) cannot move or re-type a watched tensor unseen.
        try:
            graph.replay()
        except ReplayError as exc:
            raise ReplayError(f"GraphRunner.run() at size {size} ({live} requests): {exc}") from exc.__cause__
        self.stats.replays += 1
        self.stats.replays_by_size[size] += 1
        if self.verify and not captured.verified:
            captured.verified = True
            # An eager run may write the same preallocated outputs (NPU-style out= tasks): compare a copy.
            out = _clone(out)
            step = Step(size, self._buffers.view(size), None, kinds, live)
            expected = self._eager_output(step, rows, live)
            problem = _mismatch(out, expected, self.rtol, self.atol)
            if problem is not None:
                self.stats.refused[size] = f"first replay differs from eager: {problem}"
                return expected
        return out

    def _rows(self, live: int) -> list[int]:
        """The live rows of each output at ``live`` requests, by the ``output_rows`` rules; a rule that
        fails to evaluate or yields a negative count is a :class:`SpecError` naming it."""
        rows = self._rows_memo.get(live)
        if rows is not None:
            return rows
        env = {**self._buffers.plan.constants, "requests": live, "tokens": live * self._tpr}
        rows = []
        for i, rule in enumerate(self._output_rows):
            try:
                n = rule.eval(env)
            except ExprError as exc:
                raise SpecError(f"GraphRunner {self._rule_name(i)} at {live} requests: {exc}") from None
            if n < 0:
                raise SpecError(
                    f"GraphRunner {self._rule_name(i)} gives {n} rows at {live} requests; allowed: >= 0"
                )
            rows.append(n)
        if live * self._tpr <= self._buffers.capture_sizes[-1]:  # memo bounded by the capture range
            self._rows_memo[live] = rows
        return rows

    def _rule_name(self, i: int) -> str:
        name = "output_rows" if len(self._output_rows) == 1 else f"output_rows[{i}]"
        return f"{name} {self._output_rows[i].text!r}"

    def _check_output(self, output: Any) -> None:
        """What the callable returned is a tensor (>= 1-D) or a non-empty tuple of them, one rule each (or
        one rule for all); :class:`CaptureError` otherwise. Checked at capture, once per size."""
        outs = (output,) if isinstance(output, torch.Tensor) else output
        if not isinstance(outs, tuple) or not outs:
            raise CaptureError(
                f"the callable returned {type(output).__name__}; allowed: a tensor, or a tuple of tensors "
                "(one per output_rows rule)"
            )
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor) or o.dim() == 0:
                what = "a 0-d tensor" if isinstance(o, torch.Tensor) else type(o).__name__
                raise CaptureError(
                    f"output {i} of the callable is {what}; allowed: a tensor with rows (>= 1-D)"
                )
        rules = len(self._output_rows)
        if rules != 1 and rules != len(outs):
            raise CaptureError(
                f"the callable returned {len(outs)} outputs, but output_rows has {rules} rules; allowed: one "
                "rule, or one per output"
            )

    def _slice(self, output: Output, rows: list[int], live: int) -> Output:
        """The first ``rows`` rows of each output; a rule above an output's rows is a :class:`SpecError`."""
        outs = (output,) if isinstance(output, torch.Tensor) else output
        per = rows * len(outs) if len(rows) == 1 else rows
        for i, (o, n) in enumerate(zip(outs, per)):
            if n > o.shape[0]:
                rule = self._rule_name(0 if len(rows) == 1 else i)
                raise SpecError(
                    f"GraphRunner {rule} gives {n} rows at {live} requests, but output {i} has "
                    f"{o.shape[0]} rows"
                )
        if isinstance(output, torch.Tensor):
            return output[: per[0]]
        return tuple(o[:n] for o, n in zip(outs, per))

    def live_rows(self, output: Output, live: int) -> Output:
        """The first rows of each of the step function's outputs that ``live`` requests fill, by the
        ``output_rows`` rules (views, no copy). Raises :class:`SpecError` for a rule that fails, goes
        negative or exceeds its output's rows; :class:`CaptureError` for an output that is not a tensor
        (or tuple of them) matching the rules."""
        self._check_output(output)
        return self._slice(output, self._rows(live), live)

    def _eager_output(self, step: Step, rows: list[int], live: int) -> Output:
        output = self.fn(step)
        self._check_output(output)
        return self._slice(output, rows, live)

    def _eager(
        self,
        sources: dict[str, Any] | BoundSources,
        live: int,
        host_args: Mapping[str, Mapping[str, Any]],
        reason: str,
        widths: Mapping[str, int] | None,
    ) -> Output:
        # Validated and padded exactly as a refresh (same errors; the step bounded by limits.max_bytes);
        # the captured buffers are not touched.
        views = self._buffers.eager_inputs(live * self._tpr, sources, num_reqs=live, widths=widths)
        rows = self._rows(live)
        self.stats.eager += 1
        self.stats.eager_reasons[reason] += 1
        return self._eager_output(Step(live * self._tpr, views, None, host_args, live), rows, live)


def _cause(exc: BaseException) -> str:
    """``Type: message``, and the op that raised it where the capture noted it."""
    notes = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n.startswith("graphbuf:")]
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} ({'; '.join(n.removeprefix('graphbuf: ') for n in notes)})" if notes else text


def _host_args(host_args: Any) -> dict[str, dict[str, Any]]:
    """``run(host_args=...)`` read once and checked: a mapping of known task kind to a mapping of names."""
    if host_args is None:
        return {}
    if not isinstance(host_args, Mapping):
        raise TaskError(
            f"run(): host_args is {type(host_args).__name__}; allowed: a mapping of task kind to "
            "{host argument name: value}"
        )
    out: dict[str, dict[str, Any]] = {}
    for kind, args in list(host_args.items()):
        k = TaskKind.parse(kind)
        if not isinstance(args, Mapping):
            raise TaskError(
                f"run(): host_args[{kind!r}] is {type(args).__name__}; allowed: a mapping of host argument "
                "name to value"
            )
        out[k.value] = dict(args.items())
    return out


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

"""``graphbuf drill --padding-contract``: which pads do the spec's tasks actually depend on?

The tasks are captured once at the largest capture size. For each buffer, batches that leave padded rows
(fewer live requests than that size holds) are refreshed and replayed twice: as refreshed (pads in the padded
rows and stale columns), and with junk there instead (values within the buffer's bounds that differ from the
pad). If the live outputs change, or a kernel faults, the tasks depend on that pad: ``required``. If they
never change: ``free``, and the pad is habit, not contract. Tasks that cannot be captured run eagerly on the
same captured views (the report says so).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from graphbuf.drill.progress import Progress
from graphbuf.drill.session import DrillSession
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.runner import Step
from graphbuf.planning.planner import BufferPlan, json_number
from graphbuf.spec.models import DTYPES, GraphSpec
from graphbuf.testing import bounds, sample, sources

__all__ = ["PadVerdict", "PaddingContract", "run_padding_contract", "run_padding_contract_cli"]


@dataclass
class PadVerdict:
    """One buffer's contract: ``required``, ``free``, or ``untested`` (no trial batch left a padded cell)."""

    buffer: str
    pad: int | float | str  #: the spec's pad, as its type: a number, or "repeat_last"
    verdict: str = "untested"
    max_abs_change: float = 0.0
    trials: int = 0
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        change = self.max_abs_change if math.isfinite(self.max_abs_change) else None
        return {
            "buffer": self.buffer,
            "pad": json_number(self.pad),
            "verdict": self.verdict,
            "max_abs_change": change,
            "trials": self.trials,
            "reason": self.reason,
        }


@dataclass
class PaddingContract:
    """The padding contract of a spec's tasks, one :class:`PadVerdict` per buffer."""

    spec: str
    tasks: list[str]
    tolerance: float
    size: int
    mode: str = "replay"
    verdicts: list[PadVerdict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "tasks": self.tasks,
            "tolerance": self.tolerance,
            "size": self.size,
            "mode": self.mode,
            "buffers": [v.as_dict() for v in self.verdicts],
            "required": [v.buffer for v in self.verdicts if v.verdict == "required"],
            "free": [v.buffer for v in self.verdicts if v.verdict == "free"],
        }

    def render(self) -> str:
        head = ("buffer", "pad", "contract", "max live change", "trials", "why")
        rows = [
            (v.buffer, str(v.pad), v.verdict, f"{v.max_abs_change:.3g}", str(v.trials), v.reason)
            for v in self.verdicts
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"graphbuf drill --padding-contract: {self.spec}; tasks: {', '.join(self.tasks)}; "
            f"capture size {self.size}, {self.mode}; tolerance {self.tolerance:g}"
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
        lines.append(
            "required: the live outputs change (or a kernel faults) when its padded rows/stale columns hold "
            "junk; free: they never did"
        )
        return "\n".join(lines)


def _junk(b: BufferPlan, current: torch.Tensor, rng: np.random.Generator) -> torch.Tensor | None:
    """Values within ``b``'s bounds, each different from ``current`` (None if the bounds allow no other)."""
    kind = DTYPES[b.dtype_name][0]
    shape = tuple(current.shape)
    if kind == "b":
        return ~current.bool()
    if kind == "f":
        lo = float(b.min) if b.min is not None else -100.0
        hi = float(b.max) if b.max is not None else 100.0
        values = torch.as_tensor(rng.uniform(lo, hi, size=shape), dtype=current.dtype)
        same = values == current
        return torch.where(same, torch.full_like(values, hi if hi != lo else lo), values)
    lo, hi = bounds(b)
    if hi <= lo:
        return None
    values = torch.as_tensor(rng.integers(lo, hi, size=shape, endpoint=True)).to(current.dtype)
    bumped = torch.where(values < hi, values + 1, torch.full_like(values, lo))
    return torch.where(values == current, bumped, values)


class _Replayer:
    """The session's tasks captured once at ``size`` (buffers must hold valid data); :meth:`run` re-issues
    the tasks' host arguments and replays, or runs the tasks eagerly on the views if capture failed."""

    def __init__(self, session: DrillSession, size: int) -> None:
        self.session, self.size = session, size
        self.views = session.buffers.view(size)
        requests = size // session.plan.tokens_per_request
        self.graph: Graph | None = Graph(session.buffers.device)
        self.mode = "replay"
        try:
            if session.buffers.device.type != "cpu":
                session.step(Step(size, self.views, None, {}, requests))  # warm-up, as the runner does
            with self.graph.capture():
                self.outputs = session.step(Step(size, self.views, self.graph, {}, requests))
        except Exception as exc:
            self.graph = None
            self.mode = f"eager on the captured views (capture failed: {type(exc).__name__})"

    def run(self, host_args: Mapping[str, Mapping[str, Any]], live: int) -> tuple[torch.Tensor, ...]:
        """The live rows of every task's output for a batch of ``live`` requests (copies)."""
        s = self.session
        if self.graph is None:
            outs = s.step(Step(self.size, self.views, None, host_args, live))
        else:
            self.graph.reissue(host_args)
            self.graph.replay()
            outs = self.outputs
        return tuple(o.clone() for o in s.runner.live_rows(outs, live))


def _change(base: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> float:
    worst = 0.0
    for a, b in zip(base, got):
        if a.shape != b.shape:
            return math.inf
        if not a.numel():
            continue
        diff = (a.double() - b.double()).abs()
        nan_moved = torch.isnan(a) != torch.isnan(b)
        if bool(nan_moved.any()):
            return math.inf
        worst = max(worst, float(diff.nan_to_num(0.0).max()))
    return worst


def run_padding_contract(
    spec: str | GraphSpec,
    *,
    device: str = "cpu",
    seed: int = 0,
    overrides: Mapping[str, int] | None = None,
    tolerance: float = 1e-4,
    trials: int = 4,
    allow_factories: Iterable[str] = (),
    progress: Callable[[str, int, int], None] | None = None,
) -> PaddingContract:
    """The padding contract of the spec's tasks (see the module docstring), from ``trials`` batches drawn
    through :mod:`graphbuf.testing` at capture sizes with room for padded rows. ``progress(phase, done,
    total)``: called as the graph is captured (``"capture"``) and as trials end (``"contract"``)."""
    session = DrillSession(
        spec, device=device, seed=seed, overrides=overrides, allow_factories=allow_factories, capture=False,
        progress=progress,
    )  # fmt: skip
    p, bufs = session.plan, session.buffers
    size = p.capture_sizes[-1]
    top = max(1, size // p.tokens_per_request - 1)  # leave padded rows
    drawn = sample(
        st.integers(1, top).flatmap(
            lambda live: sources(p, live, size=size, relations=session.relations).map(lambda s: (live, s))
        ),
        seed=seed,
        count=trials,
    )
    bufs.refresh(size, drawn[0][1], num_reqs=drawn[0][0])
    replayer = _Replayer(session, size)
    report = PaddingContract(
        session.spec.name, [getattr(t, "name", "?") for t in session.tasks], tolerance, size, replayer.mode
    )
    verdicts = {b.name: PadVerdict(b.name, b.pad) for b in p.buffers}
    rng = np.random.default_rng(seed)
    for trial, (live, srcs) in enumerate(drawn):
        if progress is not None:
            progress("contract", trial, len(drawn))
        bufs.refresh(size, srcs, num_reqs=live)
        views = replayer.views
        args = session.host_args(size, live, srcs)
        session.randomize(live, seed + trial)
        base = replayer.run(args, live)
        for b in p.buffers:
            v = verdicts[b.name]
            if b.keep or b.name not in srcs:
                v.reason = "keep: never padded by a refresh"
                continue
            view = views[b.name]
            src_shape = (
                np.shape(srcs[b.name])
                if not isinstance(srcs[b.name], torch.Tensor)
                else tuple(srcs[b.name].shape)
            )
            mask = torch.ones(view.shape, dtype=torch.bool, device=view.device)
            mask[: src_shape[0], ...] = False
            if view.dim() == 2:
                mask[: src_shape[0], src_shape[1] :] = True
            if not bool(mask.any()):
                continue
            junk = _junk(b, view, rng)
            if junk is None:
                v.reason = "its bounds allow no value but the pad"
                continue
            saved = view.clone()
            v.trials += 1
            try:
                view.copy_(torch.where(mask, junk.to(view.device), view))
                change = _change(base, replayer.run(args, live))
                why = f"live outputs changed by {change:.3g}" if change > tolerance else ""
            except Exception as exc:  # a kernel that faults on junk depends on the pad
                change, why = math.inf, f"a task raised {type(exc).__name__}: {str(exc)[:80]}"
            finally:
                view.copy_(saved)
            v.max_abs_change = max(v.max_abs_change, change)
            if change > tolerance:
                v.verdict, v.reason = "required", why
            elif v.verdict != "required":
                v.verdict, v.reason = "free", "live outputs unchanged with junk in its padded cells"
    if progress is not None:
        progress("contract", len(drawn), len(drawn))
    report.verdicts = list(verdicts.values())
    return report


def run_padding_contract_cli(args: argparse.Namespace, overrides: Mapping[str, int]) -> int:
    """``graphbuf drill SPEC --padding-contract [--json]`` (see :mod:`graphbuf.cli`)."""
    progress = Progress()
    try:
        contract = run_padding_contract(
            args.spec, device=args.device, seed=args.seed, overrides=overrides,
            allow_factories=args.allow_factory, progress=progress,
        )  # fmt: skip
    finally:
        progress.close()
    print(json.dumps(contract.as_dict(), indent=2) if args.json else contract.render())
    return 0

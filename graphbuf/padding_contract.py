"""``graphbuf drill --padding-contract``: which pads do the spec's tasks actually depend on?

For each buffer, batches that leave padded rows (fewer live requests than the capture size holds) are
refreshed, then the tasks run on the size's captured views (the tensors a replay reads) twice: as refreshed
(pads in the padded rows and stale columns), and with junk there instead (values within the buffer's bounds
that differ from the pad). If the live outputs change, or a kernel faults, the tasks depend on that pad:
``required``. If they never change: ``free``, and the pad is habit, not contract.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from graphbuf.drill import DrillSession
from graphbuf.expr import parse_expr
from graphbuf.graphs.runner import Step
from graphbuf.planner import BufferPlan
from graphbuf.spec import DTYPES, GraphSpec
from graphbuf.testing import bounds, sample, sources

__all__ = ["PadVerdict", "PaddingContract", "run_padding_contract"]


@dataclass
class PadVerdict:
    """One buffer's contract: ``required``, ``free``, or ``untested`` (no trial batch left a padded cell)."""

    buffer: str
    pad: str
    verdict: str = "untested"
    max_abs_change: float = 0.0
    trials: int = 0
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        change = self.max_abs_change if math.isfinite(self.max_abs_change) else None
        return {
            "buffer": self.buffer,
            "pad": self.pad,
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
    verdicts: list[PadVerdict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "tasks": self.tasks,
            "tolerance": self.tolerance,
            "buffers": [v.as_dict() for v in self.verdicts],
            "required": [v.buffer for v in self.verdicts if v.verdict == "required"],
            "free": [v.buffer for v in self.verdicts if v.verdict == "free"],
        }

    def render(self) -> str:
        head = ("buffer", "pad", "contract", "max live change", "trials", "why")
        rows = [
            (v.buffer, v.pad, v.verdict, f"{v.max_abs_change:.3g}", str(v.trials), v.reason)
            for v in self.verdicts
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"graphbuf drill --padding-contract: {self.spec}; tasks: {', '.join(self.tasks)}; "
            f"tolerance {self.tolerance:g}"
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


def _live_outputs(session: DrillSession, step: Step) -> tuple[torch.Tensor, ...]:
    p = session.plan
    env = {**p.constants, "requests": step.requests, "tokens": step.requests * p.tokens_per_request}
    outs = session.step(step)
    rules = [getattr(t, "output_rows", "tokens") for t in session.tasks]
    return tuple(o[: parse_expr(r).eval(env)].clone() for o, r in zip(outs, rules))


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
) -> PaddingContract:
    """The padding contract of the spec's tasks (see the module docstring), from ``trials`` batches drawn
    through :mod:`graphbuf.testing` at capture sizes with room for padded rows."""
    session = DrillSession(
        spec, device=device, seed=seed, overrides=overrides, allow_factories=allow_factories
    )
    p, bufs = session.plan, session.buffers
    tpr = p.tokens_per_request
    roomy = [s for s in p.capture_sizes if s // tpr >= 2] or list(p.capture_sizes)

    def at(size: int) -> Any:
        top = max(1, size // tpr - 1)
        return st.integers(1, top).flatmap(
            lambda live: sources(p, live, size=size, relations=session.relations).map(
                lambda src: (size, live, src)
            )
        )

    drawn = sample(st.sampled_from(roomy).flatmap(at), seed=seed, count=trials)
    report = PaddingContract(session.spec.name, [getattr(t, "name", "?") for t in session.tasks], tolerance)
    verdicts = {b.name: PadVerdict(b.name, str(b.pad)) for b in p.buffers}
    rng = np.random.default_rng(seed)
    for trial, (size, live, srcs) in enumerate(drawn):
        bufs.refresh(size, srcs, num_reqs=live)
        views = bufs.view(size)
        args = session.host_args(size, live, srcs)
        session.randomize(live, seed + trial)
        base = _live_outputs(session, Step(size, views, None, args, live))
        for b in p.buffers:
            v = verdicts[b.name]
            if b.keep or b.name not in srcs:
                v.reason = "keep: never padded by a refresh"
                continue
            view = views[b.name]
            src_shape = np.shape(srcs[b.name]) if not isinstance(srcs[b.name], torch.Tensor) else tuple(
                srcs[b.name].shape
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
                change = _change(base, _live_outputs(session, Step(size, views, None, args, live)))
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
    report.verdicts = list(verdicts.values())
    return report

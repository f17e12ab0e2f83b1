"""``graphbuf drill`` on the shipped spec, timed phase by phase.

Usage: ``python bench/bench_drill.py [--replays 60] [--seed 0] [--threads 0] [--json PATH]``, or
``python bench/bench_drill.py --model tiny [--requests 4] [--seed 0] [--threads 0]`` for the whole-model
drill (``graphbuf drill gemma4-31b-it-mtp --model tiny``): its wall and CPU seconds (the CPU figure is the
steadier one on a shared machine, the more so at ``--threads 1``) and, per dtype, capture seconds, steps, the
checks run and the accepted drafts per request-step.

Runs :func:`graphbuf.drill.session.run_drill` on ``gemma4-31b-it-mtp`` exactly as ``graphbuf drill`` does
(every
capture size, ``--replays`` batches compared with eager, the drill's own tolerance) and prints where its
wall time goes, as a table and, on the last line, as JSON.

How the phases are measured: the bench wraps, from outside and for its own run only, the functions the drill
calls (nothing in graphbuf is changed or read privately). Each wrapper pushes its phase on a stack and time
is charged to the innermost phase only, so the phases add up to the drill's wall time:

* ``import``: importing torch, graphbuf's drill and the spec's task module (before the drill starts);
* ``setup``: ``DrillSession.__init__`` itself: spec, plan, buffers, task bind (random KV), the warm refresh;
* ``capture``: ``GraphRunner.capture``: every capture size recorded (the captured callable included);
* ``refresh``: ``StaticBuffers.refresh``: buffer refreshes before replays (and the session's warm one);
* ``task update``: ``Graph.reissue``: decode tasks re-issued with fresh host KV lengths;
* ``replay``: ``Graph.replay``: the captured graphs run;
* ``eager fallback``: the callable run eagerly by the runner (batches above the largest capture size);
* ``eager reference``: the callable run eagerly on the raw batch, what each replay is compared with;
* ``task inputs``: ``DrillSession.randomize``: fresh queries and KV blocks per batch;
* ``compare``: the rest of ``DrillSession.check``: host arguments, output copies, reference views, errors;
* ``runner``: the rest of ``GraphRunner.run``: address checks, live rows;
* ``draw``: everything else: drawing batches through Hypothesis, the report.

``--threads 0`` (default) keeps torch's intra-op thread count (the machine's cores, as ``graphbuf drill``
runs). No figure is asserted; the exit status is 1 only if the drill itself fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["PHASES", "PhaseClock", "main", "render", "run"]

SPEC = "gemma4-31b-it-mtp"  # bench/common.SPEC; not imported here, so that ``import`` is timed alone

PHASES = (
    "import",
    "setup",
    "capture",
    "refresh",
    "task update",
    "replay",
    "eager fallback",
    "eager reference",
    "task inputs",
    "compare",
    "runner",
    "draw",
)


class PhaseClock:
    """Exclusive wall time per phase: a phase entered inside another one pauses the outer one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)
        self._stack: list[str] = []
        self._since = time.perf_counter()

    @property
    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    def start(self) -> None:
        """Start charging time from now (to ``draw`` while no phase is open)."""
        self._since = time.perf_counter()

    def stop(self) -> None:
        """Charge the time since the last event; call once at the end."""
        self._charge()

    def _charge(self) -> None:
        now = time.perf_counter()
        self.seconds[self._stack[-1] if self._stack else "draw"] += now - self._since
        self._since = now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._charge()
        self._stack.append(name)
        self.calls[name] += 1
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def wrap(self, owner: Any, attr: str, pick: Callable[[str | None], str | None]) -> Callable[[], None]:
        """Replace ``owner.attr`` by a wrapper timed as phase ``pick(current phase)`` (None: not a phase of
        its own); return the undo."""
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = pick(self.current)
            if name is None:
                return original(*args, **kwargs)
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, original)


def _eager_phase(current: str | None) -> str | None:
    if current in ("capture", "setup"):
        return None  # part of capturing (the callable recorded), or of the session's set-up
    return "eager fallback" if current == "runner" else "eager reference"


def run(replays: int = 60, seed: int = 0, threads: int = 0) -> dict[str, Any]:
    """Run the drill once, timed by phase; return figures and the drill's verdict."""
    started = time.perf_counter()
    t0 = time.perf_counter()
    import torch

    from graphbuf.drill.session import DrillSession, run_drill
    from graphbuf.spec.models import load_spec

    for task in load_spec(SPEC).tasks:  # the spec's task factories, imported as the drill will
        __import__(task.factory.partition(":")[0])
    import_s = time.perf_counter() - t0
    from graphbuf.buffers.slab import StaticBuffers
    from graphbuf.graphs.graph import Graph
    from graphbuf.graphs.runner import GraphRunner

    if threads > 0:
        torch.set_num_threads(threads)
    from graphbuf.drill.allocator import keep_freed_memory

    heap = keep_freed_memory()  # as `graphbuf drill` does
    clock = PhaseClock()
    clock.seconds["import"] = import_s
    fixed: dict[tuple[Any, str], str] = {
        (DrillSession, "__init__"): "setup",
        (GraphRunner, "capture"): "capture",
        (StaticBuffers, "refresh"): "refresh",
        (Graph, "reissue"): "task update",
        (Graph, "replay"): "replay",
        (DrillSession, "randomize"): "task inputs",
        (DrillSession, "check"): "compare",
        (GraphRunner, "run"): "runner",
    }
    undo = [
        clock.wrap(owner, attr, lambda _current, name=name: name) for (owner, attr), name in fixed.items()
    ]
    undo.append(clock.wrap(DrillSession, "step", _eager_phase))
    try:
        clock.start()  # the drill starts now: nothing before it is "draw"
        t1 = time.perf_counter()
        report = run_drill(SPEC, replays=replays, seed=seed)
        drill_s = time.perf_counter() - t1
        clock.stop()
    finally:
        for u in reversed(undo):
            u()
    total = time.perf_counter() - started
    doc = report.as_dict()
    return {
        "spec": SPEC,
        "replays": replays,
        "replays_by_size": {str(r["size"]): r["replays"] for r in doc["sizes"]},
        "eager_runs": doc["eager"]["runs"],
        "shrink_replays": doc["shrink_replays"],
        "ok": report.ok,
        "tasks": doc["tasks"],
        "tolerance": doc["tolerance"],
        "phases_s": {k: round(v, 3) for k, v in clock.seconds.items()},
        "phase_calls": {k: v for k, v in clock.calls.items() if k not in ("import", "draw")},
        "drill_s": round(drill_s, 3),
        "total_s": round(total, 3),
        "torch_threads": torch.get_num_threads(),
        "heap_kept": heap,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_model(requests: int, seed: int, threads: int = 0) -> dict[str, Any]:
    """The whole-model drill as ``graphbuf drill SPEC --model tiny`` runs it, timed from outside (imports
    excluded), with ``threads`` torch intra-op threads (0: torch's default)."""
    import torch

    from graphbuf.drill.model import run_model_drill

    if threads > 0:
        torch.set_num_threads(threads)
    wall, cpu = time.perf_counter(), time.process_time()
    report = run_model_drill(SPEC, requests=requests, seed=seed)
    doc = report.as_dict()
    return {
        "spec": SPEC,
        "model": "tiny",
        "requests": requests,
        "ok": report.ok,
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "runs": {
            r["dtype"]: {
                "steps": r["steps"],
                "mtp_off_steps": r["mtp_off_steps"],
                "prefills": r["prefills"],
                "capture_s": r["capture_seconds"],
                "layer1_steps": r["layer1_replay_eager"]["checked"],
                "layer1_draft_steps": r["layer1_draft_replay_eager"]["checked"],
                "layer3_positions": r["layer3_teacher_forced"]["positions"],
                "accepted_per_request_step": r["accepted_per_request_step"],
                "acceptance_rate": r["acceptance_rate"],
                "problems": r["problems"],
            }
            for r in doc["runs"]
        },
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def render(res: dict[str, Any]) -> str:
    """The phase table."""
    total = res["total_s"]
    lines = [
        f"graphbuf drill {res['spec']}: {res['replays']} replays, tasks {', '.join(res['tasks'])}, "
        f"tolerance {res['tolerance']:g}: {'PASS' if res['ok'] else 'FAIL'}",
        f"{'phase':<16} {'seconds':>8} {'share':>6} {'calls':>6}",
    ]
    for name, seconds in res["phases_s"].items():
        calls = res["phase_calls"].get(name, "")
        lines.append(f"{name:<16} {seconds:>8.2f} {100 * seconds / total:>5.1f}% {calls!s:>6}")
    lines.append(f"{'total wall':<16} {total:>8.2f}")
    lines.append(
        f"torch threads {res['torch_threads']}, {res['cpus']} cpus, "
        f"load average (1 min) {res['load_avg_1m']}; replays by size {res['replays_by_size']}, "
        f"eager {res['eager_runs']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=60, help="batches replayed and compared (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="the drill's seed (default 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--model", choices=("tiny",), help="time the whole-model drill instead")
    parser.add_argument("--requests", type=int, default=4, help="--model: requests served (default 4)")
    args = parser.parse_args(argv)
    if args.replays < 0 or args.threads < 0 or args.requests < 1:
        parser.error("--replays and --threads must be >= 0, --requests >= 1")
    if args.model is not None:
        res = run_model(args.requests, args.seed, args.threads)
        print(
            f"graphbuf drill {SPEC} --model tiny, {args.requests} requests: "
            f"{'PASS' if res['ok'] else 'FAIL'} in {res['wall_s']} s wall, {res['cpu_s']} s CPU "
            f"(torch threads {res['torch_threads']}, load average {res['load_avg_1m']} on {res['cpus']} cpus)"
        )
        for dtype, r in res["runs"].items():
            hist = ", ".join(f"{a}: {n}" for a, n in r["accepted_per_request_step"].items())
            print(f"  {dtype}: {r['steps']} steps, accepted drafts per request-step {hist}")
    else:
        res = run(args.replays, args.seed, args.threads)
        print(render(res))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

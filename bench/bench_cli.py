"""``graphbuf check`` wall time on the shipped spec (target ≤ 0.3 s), and where the time goes.

Each run is a fresh interpreter (``python -m graphbuf check SPEC``), as a user or CI runs it; the figure is
the median wall time of ``--runs`` runs. For scale it also times a bare interpreter, ``import torch`` (what
``check`` no longer pays) and, in this process, the check itself with its imports already loaded. Nothing here
asserts a timing. Usage: ``python bench/bench_cli.py [--runs N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SPEC = "gemma4-31b-it-mtp"
TARGET_S = 0.3

__all__ = ["main", "render", "run"]


def _wall(argv: list[str], runs: int, cpu: dict[str, float] | None = None, key: str = "") -> float:
    """Median wall seconds; with ``cpu``, also the median CPU seconds (user + system) of the child, which
    a busy shared machine inflates far less than wall time."""
    samples, cpu_samples = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        samples.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_samples.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if cpu is not None:
        cpu[key] = statistics.median(cpu_samples)
    return statistics.median(samples)


def run(runs: int = 7) -> dict[str, Any]:
    """Median wall seconds of each command over ``runs`` fresh interpreters."""
    py = sys.executable
    res: dict[str, Any] = {"spec": SPEC, "runs": runs, "target_s": TARGET_S}
    cpu: dict[str, float] = {}
    res["cpu_s"] = cpu
    res["python_s"] = _wall([py, "-c", "pass"], runs, cpu, "python")
    res["import_torch_s"] = _wall([py, "-c", "import torch"], max(1, runs // 2), cpu, "import_torch")
    for name, argv in (
        ("check", ["check", SPEC]),
        ("check_coverage_json", ["check", SPEC, "--coverage", "--json"]),
        ("plan", ["plan", SPEC]),
        ("sizes", ["sizes", SPEC]),
    ):
        res[f"{name}_s"] = _wall([py, "-m", "graphbuf", *argv], runs, cpu, name)
    from graphbuf.cli import main  # warm: the work itself, imports already paid

    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        with open("/dev/null", "w") as sink:
            stdout, sys.stdout = sys.stdout, sink
            try:
                main(["check", SPEC])
            finally:
                sys.stdout = stdout
        samples.append(time.perf_counter() - t0)
    res["check_in_process_s"] = statistics.median(samples)
    res["meets_target"] = res["check_s"] <= TARGET_S
    return res


def render(res: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1000:7.1f} ms"  # noqa: E731
    cpu = res["cpu_s"]
    return "\n".join(
        [
            f"graphbuf CLI, {res['spec']}, median of {res['runs']} fresh interpreters:  wall        cpu",
            f"  python -c pass                     {ms(res['python_s'])} {ms(cpu['python'])}",
            f"  python -c 'import torch'           {ms(res['import_torch_s'])} {ms(cpu['import_torch'])}"
            "  (not paid by check)",
            f"  graphbuf check                     {ms(res['check_s'])} {ms(cpu['check'])}  "
            f"(target ≤ {res['target_s'] * 1000:.0f} ms wall: {'met' if res['meets_target'] else 'MISSED'})",
            f"  graphbuf check --coverage --json   {ms(res['check_coverage_json_s'])} "
            f"{ms(cpu['check_coverage_json'])}",
            f"  graphbuf plan                      {ms(res['plan_s'])} {ms(cpu['plan'])}",
            f"  graphbuf sizes                     {ms(res['sizes_s'])} {ms(cpu['sizes'])}",
            f"  check in process (imports loaded)  {ms(res['check_in_process_s'])}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    res = run(args.runs)
    print(render(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

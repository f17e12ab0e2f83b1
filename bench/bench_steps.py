"""Refresh cost per decode step when only what changed is written: staged writes vs whole-row copies.

Usage: ``python bench/bench_steps.py [--quick] [--json PATH] [--plot PNG] [--table MD]``. Figures are printed,
never asserted; the last line reads ``steps: staged/copy worst=X staged/unchecked worst=Y copy/staged bytes
at 128K=Z``.

A decode trace (``graphbuf.testing.DecodeBatch``) at 128K context × 256 requests, block 128 and block 16,
k = 3 (4 tokens per request), two block-table groups, seq_lens, query_start_loc, slot_mapping per group.
Per live count 1 … 256 the batch is filled with requests of random lengths, then every step each request
grows by 1 … 4 tokens (new blocks at boundaries), about one in 64 finishes (the batch condenses: the last
rows move into the holes) and as many join. Each contender keeps its own host state, applies the step's
writes to it and brings its captured buffers (cpu arrays) up to date; one step of each runs in turn (the
order rotates), so drift hits all alike. Per step, µs (median over the trace) and bytes written:

* (a) copy: vLLM-style, no checks: live rows × full width of each table, seq_lens, query_start_loc,
  slot_mapping copied, padded rows filled;
* (b) unchecked: staged writes without checks: the changed cells only (numpy fancy indexing), rows that
  leave the live range cleared, rows that enter copied over their used width;
* (c) bound: graphbuf's bound refresh (``refresh(size, bound, num_reqs=n)``) of the same host arrays;
* (d) staged: graphbuf's staged writes (``StaticBuffers.stage``) and ``refresh(size, {qsl}, num_reqs=n)``:
  the changed cells checked and written.

All four must leave the same live contents (checked after each trace, outside timing). Targets: (d) ≤ 1.0×
(a) at every live count; (d) ≤ 1.3× (b); (d) moves ≥ 20× fewer bytes than (a) at 64+ live requests.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import DECODE_GROUPS, decode_spec, render_table, write_json

from graphbuf import GraphSpec, StaticBuffers
from graphbuf.testing_steps import DecodeBatch, Step, Write

__all__ = ["main", "plot", "render", "run"]

CONTEXT = 131072
REQUESTS = 256
TPR = 4  # k = 3
LIVE = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BLOCKS = (128, 16)
GROUPS = DECODE_GROUPS
QSL = "query_start_loc"


def spec(block_size: int) -> GraphSpec:
    sizes = [TPR * r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    return decode_spec(
        f"steps-128K-x256-b{block_size}", max_num_seqs=REQUESTS, tokens_per_request=TPR,
        block_size=block_size, max_model_len=CONTEXT, sizes=sizes, slots_per_group=True,
    )  # fmt: skip


def trace(
    sb: StaticBuffers, live: int, steps: int, rng: np.random.Generator
) -> list[tuple[int, list[Write]]]:
    """(live requests, writes) of a fill step and ``steps`` decode steps at about ``live`` requests."""
    batch = DecodeBatch(sb, slots="slot_mapping", offsets=QSL)
    hi = CONTEXT - TPR * (steps + 2)
    first = Step(join=tuple(int(x) for x in rng.integers(TPR, hi, live)), grow=(1,) * live)
    out = [(live, batch.advance(first))]
    for _ in range(steps):
        n = batch.live
        must = [r for r, ln in enumerate(batch.lens) if ln + TPR > batch.max_len]
        finish = sorted(set(must) | {int(r) for r in np.flatnonzero(rng.random(n) < 1 / 64)})
        joins = tuple(int(x) for x in rng.integers(TPR, hi, len(finish)))
        grow = tuple(int(g) for g in rng.integers(1, TPR + 1, n))
        out.append((n, batch.advance(Step(tuple(finish), joins, grow))))
    return out


class Host:
    """A contender's host state: full-capacity arrays and per-row table lengths, changed by the writes."""

    def __init__(self, sb: StaticBuffers, track: bool) -> None:
        self.arrays = {name: np.zeros(tuple(t.shape), dtype=t.numpy().dtype) for name, t in sb.full.items()}
        self.arrays["slot_mapping.full"][:] = -1
        self.arrays["slot_mapping.sliding"][:] = -1
        self.lens = {n: np.zeros(a.shape[0], np.int64) for n, a in self.arrays.items() if a.ndim == 2}
        self.track = track
        self.runs: dict[str, list[tuple[int, int]]] = {n: [] for n in self.arrays}
        self.cells: dict[str, list[np.ndarray]] = {n: [] for n in self.arrays}

    def apply(self, writes: list[Write]) -> None:
        arrays, lens, track = self.arrays, self.lens, self.track
        for name, op, args in writes:
            a = arrays[name]
            runs = self.runs[name]
            if op == "set":  # 1-D run from row 0 (DecodeBatch's seq_lens and slot mappings)
                r, v = args
                a[r : r + len(v)] = v
                if track:
                    runs.append((r, r + len(v)))
                continue
            w = a.shape[1]
            ln = lens[name]
            if op in ("set_row", "move_row"):  # row r becomes v (move_row: a copy of row s), the rest pad
                r, v = args if op == "set_row" else (args[1], a[args[0], : ln[args[0]]].copy())
                k, old = len(v), int(ln[r])
                a[r, :k] = v
                if old > k:
                    a[r, k:old] = 0
                ln[r] = k
                if track:
                    runs.append((r * w, r * w + max(k, old)))
            elif op == "scatter":
                rows, vals, cols = args
                a[rows, cols] = vals
                np.maximum.at(ln, rows, cols + 1)
                if track:
                    self.cells[name].append(rows * w + cols)
            else:
                raise ValueError(op)


class Copy:
    """(a): live rows × full width, no checks (vLLM's ``copy_to_gpu(n)`` plus the padded rows)."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.host = Host(sb, track=False)
        self.dst = {n: np.zeros_like(a) for n, a in self.host.arrays.items()}
        self.bytes = 0

    def __call__(self, size: int, n: int, writes: list[Write], qsl: np.ndarray) -> None:
        self.host.apply(writes)
        s, d = self.host.arrays, self.dst
        moved = 0
        for g in GROUPS:
            name = f"block_table.{g}"
            d[name][:n] = s[name][:n]
            d[name][n : size // TPR] = 0
            moved += d[name][: size // TPR].nbytes
            sm = f"slot_mapping.{g}"
            d[sm][: n * TPR] = s[sm][: n * TPR]
            d[sm][n * TPR : size] = -1
            moved += d[sm][:size].nbytes
        d["seq_lens"][:n] = s["seq_lens"][:n]
        d["seq_lens"][n : size // TPR] = 0
        d[QSL][: n + 1] = qsl
        d[QSL][n + 1 : size // TPR + 1] = qsl[n]
        self.bytes = moved + d["seq_lens"][: size // TPR].nbytes + d[QSL][: size // TPR + 1].nbytes


class Unchecked:
    """(b): staged writes without checks: changed cells of live rows, entering rows over their used width,
    leaving rows cleared over the widest row; numpy fancy indexing."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.host = Host(sb, track=True)
        self.dst = {n: np.zeros_like(a) for n, a in self.host.arrays.items()}
        self.dst["slot_mapping.full"][:] = -1
        self.dst["slot_mapping.sliding"][:] = -1
        self.shown = dict.fromkeys(self.dst, 0)
        self.colmax = dict.fromkeys(self.dst, 0)
        self.bytes = 0

    def __call__(self, size: int, n: int, writes: list[Write], qsl: np.ndarray) -> None:
        h = self.host
        h.apply(writes)
        moved = 0
        for name, a in h.arrays.items():
            if name == QSL:
                continue
            d = self.dst[name]
            live = n * TPR if name.startswith("slot") else n
            shown = self.shown[name]
            w = a.shape[1] if a.ndim == 2 else 1
            parts = list(h.cells[name])
            runs = h.runs[name]
            if runs:
                r = np.array(runs, dtype=np.int64)
                lengths = r[:, 1] - r[:, 0]
                ends = np.cumsum(lengths)
                parts.append(np.repeat(r[:, 0] - (ends - lengths), lengths) + np.arange(ends[-1]))
            runs.clear()
            h.cells[name].clear()
            idx = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else None)
            if idx is not None:
                idx = idx[idx < min(live, shown) * w]
            df, sf = d.reshape(-1), a.reshape(-1)
            if live > shown:
                if a.ndim == 2:
                    for r in range(shown, live):
                        k = int(h.lens[name][r])
                        d[r, :k] = a[r, :k]
                        moved += k * a.itemsize
                else:
                    d[shown:live] = a[shown:live]
                    moved += (live - shown) * a.itemsize
            elif live < shown:
                pad = -1 if name.startswith("slot") else 0
                if a.ndim == 2:
                    c = self.colmax[name]
                    d[live:shown, :c] = pad
                    moved += (shown - live) * c * a.itemsize
                else:
                    d[live:shown] = pad
                    moved += (shown - live) * a.itemsize
            if idx is not None and idx.size:
                df[idx] = sf[idx]
                moved += idx.size * a.itemsize
            if a.ndim == 2 and live:
                self.colmax[name] = max(self.colmax[name], int(h.lens[name][:live].max()))
            self.shown[name] = live
        d = self.dst[QSL]
        d[: n + 1] = qsl
        d[n + 1 : size // TPR + 1] = qsl[n]
        self.bytes = moved + (size // TPR + 1) * 4


class Bound:
    """(c): graphbuf's bound refresh of a host state like (a)'s."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.sb = sb
        self.host = Host(sb, track=False)
        self.bound = sb.bind(self.host.arrays)
        self.bytes = 0

    def __call__(self, size: int, n: int, writes: list[Write], qsl: np.ndarray) -> None:
        self.host.apply(writes)
        self.host.arrays[QSL][: n + 1] = qsl
        self.sb.refresh(size, self.bound, num_reqs=n)
        self.bytes = self.sb.stats.last_bytes


class Staged:
    """(d): graphbuf's staged writes, committed by ``refresh(size, {query_start_loc}, num_reqs=n)``."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.sb = sb
        # A server keeps its handles (as vLLM keeps its BlockTable): stage() once per buffer.
        self.handles = {name: sb.stage(name) for name in sb.names if name != QSL}
        self.bytes = 0

    def __call__(self, size: int, n: int, writes: list[Write], qsl: np.ndarray) -> None:
        handles = self.handles
        for name, op, args in writes:
            getattr(handles[name], op)(*args)
        self.sb.refresh(size, {QSL: qsl}, num_reqs=n)
        self.bytes = self.sb.stats.last_bytes


def _same(live: dict[str, Callable[[str, int], np.ndarray]], names: list[str], n: int, where: str) -> None:
    for name in names:
        rows = n * TPR if name.startswith("slot") else n + 1 if name == QSL else n
        got = {k: f(name, rows) for k, f in live.items()}
        first = next(iter(got.values()))
        for k, v in got.items():
            if not np.array_equal(v, first):
                raise AssertionError(f"{where}: {name}: contender {k} differs")


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    steps = 12 if quick else 120
    live_counts = (1, 16, 64) if quick else LIVE
    out: dict[str, Any] = {"steps": steps, "points": []}
    rng = np.random.default_rng(seed)
    for block in BLOCKS:
        gs = spec(block)
        for live in live_counts:
            sbs = [StaticBuffers(gs) for _ in range(2)]
            tr = trace(sbs[0], live, steps, rng)
            cs = {"copy": Copy(sbs[0]), "unchecked": Unchecked(sbs[0]), "bound": Bound(sbs[0]),
                  "staged": Staged(sbs[1])}  # fmt: skip
            us: dict[str, list[float]] = {k: [] for k in cs}
            nbytes: dict[str, list[int]] = {k: [] for k in cs}
            order = list(cs)
            gc.disable()
            try:
                for i, (n, writes) in enumerate(tr):
                    size = next(s for s in sbs[0].capture_sizes if s >= n * TPR)
                    qsl = np.arange(0, (n + 1) * TPR, TPR, dtype=np.int32)
                    for k in order[i % 4 :] + order[: i % 4]:
                        t0 = time.perf_counter_ns()
                        cs[k](size, n, writes, qsl)
                        dt = time.perf_counter_ns() - t0
                        if i:  # the fill step is not a decode step
                            us[k].append(dt / 1e3)
                            nbytes[k].append(cs[k].bytes)
            finally:
                gc.enable()
            n = tr[-1][0]
            views = {
                "copy": lambda name, r, c=cs["copy"]: c.dst[name][:r],
                "unchecked": lambda name, r, c=cs["unchecked"]: c.dst[name][:r],
                "bound": lambda name, r, s=sbs[0]: s.full[name][:r].numpy(),
                "staged": lambda name, r, s=sbs[1]: s.full[name][:r].numpy(),
            }
            _same(views, list(sbs[0].names), n, f"block {block}, live {live}")
            point = {"block": block, "live": live}
            for k in cs:
                point[f"{k}_us"] = statistics.median(us[k])
                point[f"{k}_bytes"] = statistics.median(nbytes[k])
            out["points"].append(point)
            print(
                f"block {block:>3} live {live:>3}: "
                + "  ".join(f"{k} {point[f'{k}_us']:8.1f} µs {point[f'{k}_bytes']:>9.0f} B" for k in cs),
                file=sys.stderr,
            )
    pts = out["points"]
    out["staged_over_copy"] = max(p["staged_us"] / p["copy_us"] for p in pts)
    out["staged_over_unchecked"] = max(p["staged_us"] / p["unchecked_us"] for p in pts)
    out["bytes_ratio_64plus"] = min(p["copy_bytes"] / p["staged_bytes"] for p in pts if p["live"] >= 64)
    return out


def render(res: dict[str, Any]) -> str:
    rows = [
        [
            p["block"], p["live"],
            f"{p['copy_us']:.1f}", f"{p['unchecked_us']:.1f}",
            f"{p['bound_us']:.1f}", f"{p['staged_us']:.1f}",
            f"{p['staged_us'] / p['copy_us']:.2f}", f"{p['staged_us'] / p['unchecked_us']:.2f}",
            f"{p['copy_bytes']:.0f}", f"{p['staged_bytes']:.0f}",
            f"{p['copy_bytes'] / p['staged_bytes']:.0f}",
        ]
        for p in res["points"]
    ]  # fmt: skip
    head = ["block", "live", "(a) copy µs", "(b) unchecked µs", "(c) bound µs", "(d) staged µs", "d/a", "d/b",
            "(a) bytes", "(d) bytes", "a/d bytes"]  # fmt: skip
    title = f"decode step at 128K context x 256 requests, k = 3, cpu (median of {res['steps']} steps)"
    return render_table(title, head, rows)


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, block in zip(axes, BLOCKS):
        pts = [p for p in res["points"] if p["block"] == block]
        xs = [p["live"] for p in pts]
        for k, label in (("copy", "(a) copy, unchecked"), ("unchecked", "(b) staged, unchecked"),
                         ("bound", "(c) graphbuf bound"), ("staged", "(d) graphbuf staged")):  # fmt: skip
            ax.plot(xs, [p[f"{k}_us"] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"128K context, block {block}")
        ax.set_xlabel("live requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("µs per decode step (median)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 live counts, 12 steps (a smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--table", type=Path, help="write the table (markdown) here")
    args = ap.parse_args(argv)
    res = run(quick=args.quick, seed=args.seed)
    table = render(res)
    print(table)
    if args.json:
        write_json(args.json, "bench_steps", res)
    if args.plot:
        plot(res, args.plot)
    if args.table:
        args.table.write_text(table + "\n")
    print(
        f"steps: staged/copy worst={res['staged_over_copy']:.2f} "
        f"staged/unchecked worst={res['staged_over_unchecked']:.2f} "
        f"copy/staged bytes at 128K={res['bytes_ratio_64plus']:.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

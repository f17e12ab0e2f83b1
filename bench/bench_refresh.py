"""Refresh cost of the Gemma4-31B-it + MTP spec: graphbuf vs a hand-written floor vs per-layer resolution.

Usage: ``python bench/bench_refresh.py [--quick] [--json PATH] [--plot PNG]``.

Three ways to write one decode step's host sources (torch CPU tensors, see ``common.step_buffers``) into
the buffers a graph captured at a size, all on cpu:

* graphbuf: ``StaticBuffers.refresh(size, sources)`` — validates every source, then writes. Measured from
  the torch tensors (column "graphbuf"), from numpy views of the same memory ("gb(np)"), and from the
  persistent buffers bound once with ``StaticBuffers.bind`` and refreshed by request count and live width
  ("gb(bound)", the way vLLM's ``CpuGpuBuffer`` keeps its host side).
* floor: the same copies and fills written by hand in plain torch, once per buffer (both block tables,
  seq_lens, query_start_loc, both slot mappings), with no validation at all.
* baseline: per-layer resolution as the upstream fix does it — for each of the model's layers, copy that
  layer's block-table rows (of its KV group) into the layer's own captured buffer, clear its padded rows
  and stale columns, and copy its KV lengths into the layer's captured lengths buffer; then query offsets
  and slot mappings once.

All three must leave identical contents (checked once per size and batch, outside timing, starting from
poisoned memory). Sizes run with the batch full (live requests = the size's requests) and half full
(rounded up). The layer sweep builds the spec with ``num_layers`` overridden and scales the baseline's loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SPEC, StepBuffers, compare, render_table, step_buffers, write_json

from graphbuf.buffers.slab import StaticBuffers
from graphbuf.planning.planner import Plan, plan

__all__ = ["LAYER_COUNTS", "Floor", "PerLayerBaseline", "main", "plot_layers", "run"]

NUM_BLOCKS = 4096
LAYER_COUNTS = (15, 30, 60, 120, 240)
Sources = dict[str, torch.Tensor]


def _captured(p: Plan, name: str, size: int, poison: bool = True) -> torch.Tensor:
    """A plain torch tensor of buffer ``name``'s captured shape at ``size``, poisoned."""
    b = p[name]
    return torch.full(p.shape_at(b, size), torch.iinfo(b.dtype).min, dtype=b.dtype)


class Floor:
    """Hand-written refresh of the Gemma4 spec's six buffers: plain torch, no validation."""

    def __init__(self, p: Plan, size: int) -> None:
        self.bt_full = _captured(p, "block_table.full", size)
        self.bt_sliding = _captured(p, "block_table.sliding", size)
        self.seq_lens = _captured(p, "seq_lens", size)
        self.qsl = _captured(p, "query_start_loc", size)
        self.slot_full = _captured(p, "slot_mapping.full", size)
        self.slot_sliding = _captured(p, "slot_mapping.sliding", size)

    def __call__(self, src: Sources) -> None:
        lens = src["seq_lens"]
        n = lens.shape[0]
        for bt, s in ((self.bt_full, src["block_table.full"]), (self.bt_sliding, src["block_table.sliding"])):
            w = s.shape[1]
            bt[:n, :w].copy_(s)
            if w < bt.shape[1]:
                bt[:n, w:].fill_(0)
            if n < bt.shape[0]:
                bt[n:].fill_(0)
        self.seq_lens[:n].copy_(lens)
        if n < self.seq_lens.shape[0]:
            self.seq_lens[n:].fill_(0)
        self.qsl[: n + 1].copy_(src["query_start_loc"])
        if n + 1 < self.qsl.shape[0]:
            self.qsl[n + 1 :].fill_(self.qsl[n])
        for slot, s in (
            (self.slot_full, src["slot_mapping.full"]),
            (self.slot_sliding, src["slot_mapping.sliding"]),
        ):
            t = s.shape[0]
            slot[:t].copy_(s)
            if t < slot.shape[0]:
                slot[t:].fill_(-1)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {
            "block_table.full": self.bt_full,
            "block_table.sliding": self.bt_sliding,
            "seq_lens": self.seq_lens,
            "query_start_loc": self.qsl,
            "slot_mapping.full": self.slot_full,
            "slot_mapping.sliding": self.slot_sliding,
        }


class PerLayerBaseline:
    """Per-layer resolution: every layer owns captured block-table and KV-length buffers and refreshes them.

    Layer ``i`` is a full-attention layer when ``i % (sliding_layers_per_full + 1)`` is the last of its
    period (Gemma4's 5 sliding : 1 full pattern), else a sliding-window layer.
    """

    def __init__(self, p: Plan, size: int, num_layers: int) -> None:
        period = int(p.constants["sliding_layers_per_full"]) + 1  # type: ignore[arg-type]
        self.layers: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for i in range(num_layers):
            group = "full" if i % period == period - 1 else "sliding"
            self.layers.append(
                (
                    f"block_table.{group}",
                    _captured(p, f"block_table.{group}", size),
                    _captured(p, "seq_lens", size),
                )
            )
        self.qsl = _captured(p, "query_start_loc", size)
        self.slot_full = _captured(p, "slot_mapping.full", size)
        self.slot_sliding = _captured(p, "slot_mapping.sliding", size)

    def __call__(self, src: Sources) -> None:
        lens = src["seq_lens"]
        n = lens.shape[0]
        for name, bt, kv in self.layers:
            s = src[name]
            w = s.shape[1]
            bt[:n, :w].copy_(s)
            if w < bt.shape[1]:
                bt[:n, w:].fill_(0)
            if n < bt.shape[0]:
                bt[n:].fill_(0)
            kv[:n].copy_(lens)
            if n < kv.shape[0]:
                kv[n:].fill_(0)
        self.qsl[: n + 1].copy_(src["query_start_loc"])
        if n + 1 < self.qsl.shape[0]:
            self.qsl[n + 1 :].fill_(self.qsl[n])
        for slot, s in (
            (self.slot_full, src["slot_mapping.full"]),
            (self.slot_sliding, src["slot_mapping.sliding"]),
        ):
            t = s.shape[0]
            slot[:t].copy_(s)
            if t < slot.shape[0]:
                slot[t:].fill_(-1)

    def check_equal(self, views: dict[str, torch.Tensor] | Any, where: str) -> None:
        """Raise AssertionError unless every layer's buffers and the shared ones equal ``views``."""
        for i, (name, bt, kv) in enumerate(self.layers):
            _same(bt, views[name], f"{where}: baseline layer {i} {name}")
            _same(kv, views["seq_lens"], f"{where}: baseline layer {i} seq_lens")
        _same(self.qsl, views["query_start_loc"], f"{where}: baseline query_start_loc")
        _same(self.slot_full, views["slot_mapping.full"], f"{where}: baseline slot_mapping.full")
        _same(self.slot_sliding, views["slot_mapping.sliding"], f"{where}: baseline slot_mapping.sliding")


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # A correctness check of the benchmark itself (not a timing assertion).
    if got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(
            f"{what}: contents differ from graphbuf's view ({list(got.shape)} vs {list(want.shape)})"
        )


def _check_identical(p: Plan, size: int, step: StepBuffers, layers: int, where: str) -> None:
    """Run every variant once from poisoned memory and require identical captured contents."""
    src = step.sources
    bufs = StaticBuffers(p, "cpu", poison=True)
    bufs.refresh(size, src)
    views = bufs.view(size)
    bound = StaticBuffers(p, "cpu", poison=True)
    bound.bind(step.persistent).refresh(size, step.live, widths=step.widths)
    for name, t in bound.view(size).items():
        _same(t, views[name], f"{where}: bound {name}")
    floor = Floor(p, size)
    floor(src)
    for name, t in floor.buffers().items():
        _same(t, views[name], f"{where}: floor {name}")
    base = PerLayerBaseline(p, size, layers)
    base(src)
    base.check_equal(views, where)


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Measure; return JSON-ready results (``sizes`` per batch fill, ``layers`` sweep, ``summary``)."""
    p = plan(SPEC, overrides={"num_blocks": NUM_BLOCKS})
    layers = int(p.constants["num_layers"])  # type: ignore[arg-type]
    tpr = p.tokens_per_request
    rng = np.random.default_rng(seed)
    bufs = StaticBuffers(p, "cpu")
    fast_iters, slow_iters = (400, 60) if quick else (3000, 300)
    sizes: dict[str, list[dict[str, Any]]] = {"full": [], "half": []}
    for size in p.capture_sizes:
        req = size // tpr
        for fill, live in (("full", req), ("half", -(-req // 2))):
            step = step_buffers(p, live, rng)
            src = step.sources
            _check_identical(p, size, step, layers, f"size {size} ({fill}, {live} live)")
            floor = Floor(p, size)
            base = PerLayerBaseline(p, size, layers)
            # The same memory as numpy arrays: vLLM's CpuGpuBuffer keeps an `.np` view beside `.cpu`.
            src_np = {k: v.numpy() for k, v in src.items()}
            bound = bufs.bind(step.persistent)
            t = compare(
                {
                    "graphbuf": lambda s=size, x=src: bufs.refresh(s, x),
                    "graphbuf_np": lambda s=size, x=src_np: bufs.refresh(s, x),
                    "graphbuf_bound": lambda s=size, b=bound, st=step: b.refresh(
                        s, st.live, widths=st.widths
                    ),
                    "floor": lambda x=src, f=floor: f(x),
                    "baseline": lambda x=src, b=base: b(x),
                },
                iters={
                    "graphbuf": fast_iters,
                    "graphbuf_np": fast_iters,
                    "graphbuf_bound": fast_iters,
                    "floor": fast_iters,
                    "baseline": slow_iters,
                },
                rounds=15,  # short interleaved rounds: this host's speed flips every few seconds
            )
            sizes[fill].append(
                {
                    "size": size,
                    "live_requests": live,
                    "width": int(src["block_table.full"].shape[1]),
                    "graphbuf_us": round(t["graphbuf"], 2),
                    "graphbuf_np_us": round(t["graphbuf_np"], 2),
                    "graphbuf_bound_us": round(t["graphbuf_bound"], 2),
                    "floor_us": round(t["floor"], 2),
                    "baseline_us": round(t["baseline"], 2),
                    "baseline_layers": layers,
                    "ratio_baseline_over_graphbuf": round(t["baseline"] / t["graphbuf"], 2),
                    "ratio_baseline_over_graphbuf_np": round(t["baseline"] / t["graphbuf_np"], 2),
                    "ratio_baseline_over_graphbuf_bound": round(t["baseline"] / t["graphbuf_bound"], 2),
                    "ratio_floor_over_graphbuf": round(t["floor"] / t["graphbuf"], 3),
                }
            )

    # Layer sweep at the largest size, batch full: graphbuf on a spec variant with num_layers=L.
    size = p.capture_sizes[-1]
    step = step_buffers(p, size // tpr, rng)
    src = step.sources
    calls = {}
    for n_layers in LAYER_COUNTS:
        pl = plan(SPEC, overrides={"num_blocks": NUM_BLOCKS, "num_layers": n_layers})
        _check_identical(pl, size, step, n_layers, f"layers {n_layers}")
        b = StaticBuffers(pl, "cpu")
        base = PerLayerBaseline(pl, size, n_layers)
        calls[f"graphbuf/{n_layers}"] = lambda b=b: b.refresh(size, src)
        bound = b.bind(step.persistent)
        calls[f"bound/{n_layers}"] = lambda bd=bound: bd.refresh(size, step.live, widths=step.widths)
        calls[f"baseline/{n_layers}"] = lambda base=base: base(src)
    floor = Floor(p, size)
    calls["floor"] = lambda: floor(src)
    iters = {k: slow_iters // 2 if k.startswith("baseline") else fast_iters for k in calls}
    t = compare(calls, iters=iters, rounds=15)
    sweep = [
        {
            "layers": n,
            "graphbuf_us": round(t[f"graphbuf/{n}"], 2),
            "graphbuf_bound_us": round(t[f"bound/{n}"], 2),
            "baseline_us": round(t[f"baseline/{n}"], 2),
            "ratio_baseline_over_graphbuf": round(t[f"baseline/{n}"] / t[f"graphbuf/{n}"], 2),
            "ratio_baseline_over_graphbuf_bound": round(t[f"baseline/{n}"] / t[f"bound/{n}"], 2),
        }
        for n in LAYER_COUNTS
    ]
    all_rows = sizes["full"] + sizes["half"]
    ref = layers if layers in LAYER_COUNTS else 60
    summary = {
        "min_ratio_baseline_over_graphbuf": min(r["ratio_baseline_over_graphbuf"] for r in all_rows),
        "min_ratio_baseline_over_graphbuf_np": min(r["ratio_baseline_over_graphbuf_np"] for r in all_rows),
        "min_ratio_baseline_over_graphbuf_bound": min(
            r["ratio_baseline_over_graphbuf_bound"] for r in all_rows
        ),
        "target_ratio_baseline_over_graphbuf": 50,
        "max_graphbuf_over_floor": round(max(r["graphbuf_us"] / r["floor_us"] for r in all_rows), 3),
        "max_graphbuf_bound_over_floor": round(
            max(r["graphbuf_bound_us"] / r["floor_us"] for r in all_rows), 3
        ),
        "median_graphbuf_bound_over_floor": round(
            statistics.median(r["graphbuf_bound_us"] / r["floor_us"] for r in all_rows), 3
        ),
        "median_ratio_baseline_over_graphbuf_bound": round(
            statistics.median(r["ratio_baseline_over_graphbuf_bound"] for r in all_rows), 2
        ),
        "target_graphbuf_over_floor": 1.0,
        "graphbuf_240_over_60": round(t["graphbuf/240"] / t[f"graphbuf/{ref}"], 3),
        "graphbuf_bound_240_over_60": round(t["bound/240"] / t[f"bound/{ref}"], 3),
        "target_flatness": "within 15% (0.85 .. 1.15)",
        "sweep_size": size,
        "sweep_floor_us": round(t["floor"], 2),
    }
    return {
        "spec": SPEC,
        "overrides": {"num_blocks": NUM_BLOCKS},
        "quick": quick,
        "iters": {"graphbuf_and_floor": fast_iters, "baseline": slow_iters},
        "sizes": sizes,
        "layers": sweep,
        "summary": summary,
    }


def render(res: dict[str, Any]) -> str:
    """Every table of :func:`run`'s results, as printed."""
    out = []
    layers = res["sizes"]["full"][0]["baseline_layers"]
    headers = [
        "size",
        "live",
        "width",
        "graphbuf µs",
        "gb(np) µs",
        "gb(bound) µs",
        "floor µs",
        f"baseline({layers}) µs",
        "base/gb",
        "base/gb(np)",
        "base/gb(bound)",
        "floor/gb",
    ]
    for fill, what in (("full", "batch full"), ("half", "batch half full (padding exercised)")):
        rows = [
            [
                r["size"],
                r["live_requests"],
                r["width"],
                r["graphbuf_us"],
                r["graphbuf_np_us"],
                r["graphbuf_bound_us"],
                r["floor_us"],
                r["baseline_us"],
                r["ratio_baseline_over_graphbuf"],
                r["ratio_baseline_over_graphbuf_np"],
                r["ratio_baseline_over_graphbuf_bound"],
                r["ratio_floor_over_graphbuf"],
            ]
            for r in res["sizes"][fill]
        ]
        out.append(render_table(f"refresh, {res['spec']} on cpu, {what} (median µs)", headers, rows))
    s = res["summary"]
    rows = [
        [
            r["layers"],
            r["graphbuf_us"],
            r["graphbuf_bound_us"],
            r["baseline_us"],
            r["ratio_baseline_over_graphbuf"],
            r["ratio_baseline_over_graphbuf_bound"],
        ]
        for r in res["layers"]
    ]
    out.append(
        render_table(
            f"refresh vs layer count, size {s['sweep_size']}, batch full "
            f"(median µs; hand-written floor {s['sweep_floor_us']} µs)",
            ["layers", "graphbuf µs", "gb(bound) µs", "baseline µs", "base/gb", "base/gb(bound)"],
            rows,
        )
    )
    out.append(
        f"summary: baseline/graphbuf min {s['min_ratio_baseline_over_graphbuf_bound']}× from bound sources, "
        f"{s['min_ratio_baseline_over_graphbuf_np']}× from numpy sources, "
        f"{s['min_ratio_baseline_over_graphbuf']}× from torch sources "
        f"(target ≥ {s['target_ratio_baseline_over_graphbuf']}×; median over rows "
        f"{s['median_ratio_baseline_over_graphbuf_bound']}× bound); graphbuf/floor max "
        f"{s['max_graphbuf_bound_over_floor']} bound (median {s['median_graphbuf_bound_over_floor']}), "
        f"{s['max_graphbuf_over_floor']} torch sources "
        f"(target ≤ {s['target_graphbuf_over_floor']}); 240 vs 60 layers {s['graphbuf_bound_240_over_60']} "
        f"bound, {s['graphbuf_240_over_60']} torch sources (target {s['target_flatness']})"
    )
    return "\n\n".join(out)


def plot_layers(res: dict[str, Any], path: Path) -> Path:
    """Plot refresh µs vs layer count (graphbuf, per-layer baseline, floor) to ``path`` (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = res["layers"]
    xs = [r["layers"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    lines = (
        ("baseline_us", "tab:red", "per-layer baseline (plain torch)"),
        ("graphbuf_us", "tab:blue", "graphbuf refresh (torch sources)"),
        ("graphbuf_bound_us", "tab:green", "graphbuf refresh (bound sources)"),
    )
    for key, color, label in lines:
        ax.plot(xs, [r[key] for r in sweep], "o-", color=color, label=label)
    floor = res["summary"]["sweep_floor_us"]
    ax.axhline(floor, color="tab:gray", linestyle="--", label="hand-written floor (once per buffer)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("layers")
    ax.set_ylabel("refresh, median µs (log)")
    size = res["summary"]["sweep_size"]
    ax.set_title(f"{res['spec']}: refresh at size {size}, batch full, cpu", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--plot", type=Path, help="write the layer-count plot (PNG) to this path")
    args = parser.parse_args(argv)
    res = run(quick=args.quick)
    print(render(res))
    if args.json:
        write_json(args.json, "refresh", res)
    if args.plot:
        plot_layers(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

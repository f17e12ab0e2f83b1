"""Refresh cost vs capacity: the same live batch refreshed into buffers of growing capacity, and a live
sweep at the 128K-context × 256-sequence envelope, beside a vLLM-style contender and a plain numpy copy.

Usage: ``python bench/bench_capacity.py [--quick] [--json PATH] [--plot PNG]``. Figures are printed, never
asserted. The spec is vLLM-shaped: two block-table groups (``full``, ``sliding``) of ``max_num_seqs`` rows ×
``cdiv(max_model_len, 16)`` int32 columns, seq_lens, query_start_loc (``repeat_last``), slot_mapping.

* capacity sweep: 4 live requests × 16 blocks at capture size 8, buffers from 0.03 MiB (4K × 16) to
  128 MiB (1M × 256). Target: largest / smallest ≤ 1.5 for mapping and bound sources.
* live sweep at 16 MiB (128K × 256): 1 → 256 live requests at full width. Target: at 256 × full width
  within 2× of one plain numpy copy of the same bytes.
* vLLM-style contender (copy the first n rows at full width from the persistent host buffers, fill the
  padded rows; no validation): graphbuf no slower at any point.
* the same contender checking bounds as graphbuf must (one numpy reduction per bounded source before its
  copies: what validation costs when written by hand), to separate the price of checking from overhead.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import DECODE_GROUPS, compare, decode_spec, median_us, render_table, write_json

from graphbuf import GraphSpec, StaticBuffers

__all__ = ["main", "plot", "render", "run"]

ENVELOPES = ((4096, 16), (32768, 64), (131072, 256), (524288, 256), (1048576, 256))
GROUPS = DECODE_GROUPS
MIB = 1 << 20


def spec(max_model_len: int, max_num_seqs: int) -> GraphSpec:
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= max_num_seqs]
    return decode_spec(
        f"capacity-{max_model_len // 1024}K-x{max_num_seqs}", max_num_seqs=max_num_seqs, tokens_per_request=1,
        block_size=16, max_model_len=max_model_len, sizes=sizes, slots_per_group=False,
    )  # fmt: skip


class Persistent:
    """vLLM-style persistent host buffers (``CpuGpuBuffer.np``) at full capacity, filled for ``n`` requests
    of ``blocks`` blocks each; ``live`` are the slices a mapping refresh takes."""

    def __init__(self, sb: StaticBuffers, rng: np.random.Generator) -> None:
        self.rng = rng
        self.arrays = {name: np.zeros(tuple(t.shape), dtype=t.numpy().dtype) for name, t in sb.full.items()}

    def fill(self, n: int, blocks: int) -> dict[str, np.ndarray]:
        a = self.arrays
        for g in GROUPS:  # live blocks; columns past them are 0 (the contender copies them too)
            bt = a[f"block_table.{g}"]
            bt[...] = 0
            bt[:n, :blocks] = self.rng.integers(0, 1 << 20, (n, blocks), dtype=np.int32)
        a["seq_lens"][:n] = np.minimum(blocks * 16, 1 + np.arange(n) * 7 % (blocks * 16))
        a["query_start_loc"][: n + 1] = np.arange(n + 1)
        a["slot_mapping"][:n] = np.arange(n) * 3
        live = {f"block_table.{g}": a[f"block_table.{g}"][:n, :blocks] for g in GROUPS}
        live.update(seq_lens=a["seq_lens"][:n], query_start_loc=a["query_start_loc"][: n + 1])
        live["slot_mapping"] = a["slot_mapping"][:n]
        return live


class VllmStyle:
    """The contender: its own device buffers (here host arrays), refreshed as vLLM's GPU model runner
    does: the first n rows at full width (``copy_to_gpu(n)``), then the padded rows of the capture size.
    ``checked``: first check every live value against the spec's bounds, as graphbuf must (block tables
    0 .. num_blocks - 1 viewed unsigned, seq_lens 0 .. max_model_len, query_start_loc 0 .. tokens,
    slot_mapping >= -1), raising before any copy."""

    def __init__(self, sb: StaticBuffers, src: dict[str, np.ndarray], *, checked: bool = False) -> None:
        self.dst = {name: np.zeros(tuple(t.shape), dtype=t.numpy().dtype) for name, t in sb.full.items()}
        self.src = src
        self.checked = checked
        c = sb.plan.constants
        self.limits = (int(c["num_blocks"]) - 1, int(c["max_model_len"]), int(c["max_num_batched_tokens"]))

    def check(self, n: int) -> None:
        s, (blocks, lens, tokens) = self.src, self.limits
        bad = any(np.maximum.reduce(s[f"block_table.{g}"][:n].view(np.uint32), None) > blocks for g in GROUPS)
        bad |= np.maximum.reduce(s["seq_lens"][:n].view(np.uint32), None) > lens
        bad |= np.maximum.reduce(s["query_start_loc"][: n + 1].view(np.uint32), None) > tokens
        bad |= np.minimum.reduce(s["slot_mapping"][:n], None) < -1
        if bad:
            raise ValueError("out of bounds")

    def __call__(self, size: int, n: int) -> None:
        if self.checked:
            self.check(n)
        d, s = self.dst, self.src
        for g in GROUPS:
            name = f"block_table.{g}"
            d[name][:n] = s[name][:n]
            d[name][n:size] = 0
        d["seq_lens"][:n] = s["seq_lens"][:n]
        d["seq_lens"][n:size] = 0
        d["query_start_loc"][: n + 1] = s["query_start_loc"][: n + 1]
        d["query_start_loc"][n + 1 : size + 1] = s["query_start_loc"][n]
        d["slot_mapping"][:n] = s["slot_mapping"][:n]
        d["slot_mapping"][n:size] = -1


def _check_same(sb: StaticBuffers, contender: VllmStyle, size: int, where: str) -> None:
    for name, view in sb.view(size).items():
        want = contender.dst[name][: view.shape[0], : view.shape[1]] if view.dim() == 2 else None
        if want is None:
            want = contender.dst[name][: view.shape[0]]
        if not np.array_equal(view.numpy(), want):
            raise AssertionError(f"{where}: {name} differs between graphbuf and the vLLM-style contender")


def _measure(
    sb: StaticBuffers, per: Persistent, size: int, n: int, blocks: int, iters: int
) -> dict[str, Any]:
    live = per.fill(n, blocks)
    bound = sb.bind(per.arrays)
    widths = {f"block_table.{g}": blocks for g in GROUPS}
    contender = VllmStyle(sb, per.arrays)
    checked = VllmStyle(sb, per.arrays, checked=True)
    nbytes = sum(a.nbytes for a in live.values())
    flat_src, flat_dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    t = compare(
        {
            "mapping": lambda: sb.refresh(size, live),
            "bound": lambda: sb.refresh(size, bound, num_reqs=n, widths=widths),
            "vllm": lambda: contender(size, n),
            "checked": lambda: checked(size, n),
            "copy": lambda: np.copyto(flat_dst, flat_src),
        },
        iters=iters,
        rounds=9,
        warmup=3,
    )
    sb.refresh(size, live)
    contender(size, n)
    _check_same(sb, contender, size, f"{sb.plan.spec.name} size {size} n {n}")
    return {
        "mapping_us": round(t["mapping"], 2),
        "bound_us": round(t["bound"], 2),
        "vllm_style_us": round(t["vllm"], 2),
        "vllm_checked_us": round(t["checked"], 2),
        "numpy_copy_us": round(t["copy"], 2),
        "live_bytes": nbytes,
        "last_bytes": sb.stats.last_bytes,
    }


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    iters = 150 if quick else 1500
    capacity = []
    for max_model_len, max_num_seqs in ENVELOPES:
        sb = StaticBuffers(spec(max_model_len, max_num_seqs))
        per = Persistent(sb, rng)
        row = {
            "envelope": f"{max_model_len // 1024}K x {max_num_seqs}",
            "capacity_mib": round(sb.plan.total_bytes / MIB, 3),
            **_measure(sb, per, 8, 4, 16, iters),
        }
        capacity.append(row)
        del sb, per
    sb = StaticBuffers(spec(131072, 256))
    per = Persistent(sb, rng)
    full_width = int(sb.full["block_table.full"].shape[1])
    live_sweep = []
    for n in (1, 4, 16, 64, 256) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256):
        it = max(10, min(iters, int(iters * 64 / n)))
        live_sweep.append(
            {"live_requests": n, "width": full_width, **_measure(sb, per, n, n, full_width, it)}
        )
    # The concurrency guard every refresh takes: a non-blocking acquire and a release of one lock.
    lock = threading.Lock()

    def guard() -> None:
        if lock.acquire(blocking=False):
            lock.release()

    guard_us = median_us(guard, iters=200 if quick else 2000, inner=100)
    first, last = capacity[0], capacity[-1]
    top = live_sweep[-1]
    summary = {
        "mapping_largest_over_smallest": round(last["mapping_us"] / first["mapping_us"], 3),
        "bound_largest_over_smallest": round(last["bound_us"] / first["bound_us"], 3),
        "target_largest_over_smallest": 1.5,
        "mapping_at_256_full_over_numpy_copy": round(top["mapping_us"] / top["numpy_copy_us"], 3),
        "bound_at_256_full_over_numpy_copy": round(top["bound_us"] / top["numpy_copy_us"], 3),
        "target_over_numpy_copy": 2.0,
        "max_mapping_over_vllm_style": round(
            max(r["mapping_us"] / r["vllm_style_us"] for r in capacity + live_sweep), 3
        ),
        "max_bound_over_vllm_style": round(
            max(r["bound_us"] / r["vllm_style_us"] for r in capacity + live_sweep), 3
        ),
        "target_over_vllm_style": 1.0,
        "max_bound_over_vllm_checked": round(
            max(r["bound_us"] / r["vllm_checked_us"] for r in capacity + live_sweep), 3
        ),
        "concurrency_guard_ns": round(guard_us * 1e3, 1),
        "concurrency_guard_share_of_smallest_mapping_refresh": round(guard_us / first["mapping_us"], 4),
    }
    return {"quick": quick, "capacity": capacity, "live": live_sweep, "summary": summary}


def render(res: dict[str, Any]) -> str:
    cap = render_table(
        "refresh vs capacity: 4 live requests x 16 blocks at capture size 8, cpu (median µs)",
        ["envelope", "MiB", "mapping µs", "bound µs", "vLLM-style µs", "+check µs", "last_bytes",
         "live bytes"],
        [
            [r["envelope"], r["capacity_mib"], r["mapping_us"], r["bound_us"], r["vllm_style_us"],
             r["vllm_checked_us"], r["last_bytes"], r["live_bytes"]]
            for r in res["capacity"]
        ],
    )  # fmt: skip
    live = render_table(
        "refresh vs live requests at 16 MiB (128K x 256), full width, capture size = live (median µs)",
        ["live", "width", "mapping µs", "bound µs", "vLLM-style µs", "+check µs", "numpy copy µs",
         "last_bytes", "live bytes"],
        [
            [r["live_requests"], r["width"], r["mapping_us"], r["bound_us"], r["vllm_style_us"],
             r["vllm_checked_us"], r["numpy_copy_us"], r["last_bytes"], r["live_bytes"]]
            for r in res["live"]
        ],
    )  # fmt: skip
    s = res["summary"]
    text = (
        f"summary: largest/smallest capacity {s['mapping_largest_over_smallest']} mapping, "
        f"{s['bound_largest_over_smallest']} bound (target <= 1.5); at 256 x full width over one numpy copy "
        f"{s['mapping_at_256_full_over_numpy_copy']} mapping, {s['bound_at_256_full_over_numpy_copy']} bound "
        f"(target <= 2); max over vLLM-style {s['max_mapping_over_vllm_style']} mapping, "
        f"{s['max_bound_over_vllm_style']} bound (target <= 1); max bound over vLLM-style with the same "
        f"bounds check {s['max_bound_over_vllm_checked']}; concurrency guard "
        f"{s['concurrency_guard_ns']} ns per refresh "
        f"({s['concurrency_guard_share_of_smallest_mapping_refresh']:.2%} of the smallest mapping refresh)"
    )
    return "\n\n".join([cap, live, text])


def plot(res: dict[str, Any], path: Path) -> Path:
    """Refresh µs vs capacity (left) and vs live requests at 16 MiB (right), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.0), dpi=120)
    lines = (
        ("mapping_us", "tab:blue", "graphbuf (mapping)"),
        ("bound_us", "tab:green", "graphbuf (bound)"),
        ("vllm_style_us", "tab:red", "vLLM-style (n rows full width + pad rows)"),
        ("vllm_checked_us", "tab:orange", "vLLM-style + the same bounds check (numpy)"),
    )
    xs = [r["capacity_mib"] for r in res["capacity"]]
    for key, color, label in lines:
        a.plot(xs, [r[key] for r in res["capacity"]], "o-", color=color, label=label)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("buffer capacity, MiB (log)")
    a.set_ylabel("refresh, median µs (log)")
    a.set_title("4 requests x 16 blocks, size 8", fontsize=10)
    xs = [r["live_requests"] for r in res["live"]]
    for key, color, label in (*lines, ("numpy_copy_us", "tab:gray", "one numpy copy of the live bytes")):
        b.plot(xs, [r[key] for r in res["live"]], "o-", color=color, label=label)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("live requests at full width (16 MiB capacity)")
    b.set_title("128K x 256: live sweep", fontsize=10)
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    res = run(quick=args.quick)
    print(render(res))
    if args.json:
        write_json(args.json, "capacity", res)
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

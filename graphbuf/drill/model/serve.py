"""Serving the tiny Gemma4 the way the target model runs under MTP, every decode step through graphbuf.

A :class:`Scenario` is what one drill serves: requests (prompt, arrival step, tokens to generate) and a
drafter (seed, accuracy). :func:`serve` runs it: arriving requests are prefilled eagerly (one request,
q_len = prompt length), then every step verifies ``1 + k`` tokens per live request (the last accepted
token and ``k`` draft tokens) through ``GraphRunner.run``: the step's sources (token ids, positions, block
tables, seq_lens, query_start_loc, slot mappings) are refreshed into the captured buffers and the graph
of the smallest capture size holding the batch replays (eagerly above the largest). Greedy acceptance:
draft token j+1 is accepted while it equals the target's argmax after j accepted tokens; the step emits
the accepted drafts plus the target's next token. Requests that reach their length leave and free their
blocks (reused last-freed first, so stale slots point at live data).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from graphbuf.graphs.runner import GraphRunner, Step

__all__ = ["MAX_STEPS", "Request", "Scenario", "ServeResult", "serve"]

#: Decode steps after which :func:`serve` gives up.
MAX_STEPS = 10_000


@dataclass(frozen=True)
class Request:
    """One request: ``prompt`` token ids, the decode step it arrives at, how many tokens it generates."""

    prompt: tuple[int, ...]
    arrival: int
    max_new: int

    def as_dict(self) -> dict[str, Any]:
        return {"prompt": list(self.prompt), "arrival": self.arrival, "max_new": self.max_new}


@dataclass(frozen=True)
class Scenario:
    """What one drill serves: requests and the drafter (``accuracy``: chance each draft token is the
    reference's next token; draws from ``draft_seed``, request and position, so a request's drafts do not
    depend on the batch it runs in)."""

    requests: tuple[Request, ...]
    draft_seed: int = 0
    accuracy: float = 0.6

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": [r.as_dict() for r in self.requests],
            "draft_seed": self.draft_seed,
            "accuracy": self.accuracy,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Scenario:
        reqs = tuple(
            Request(tuple(int(t) for t in r["prompt"]), int(r["arrival"]), int(r["max_new"]))
            for r in doc["requests"]
        )
        return cls(reqs, int(doc["draft_seed"]), float(doc["accuracy"]))


@dataclass
class ServeResult:
    """Token streams by request index, and what the serving did."""

    streams: dict[int, list[int]] = field(default_factory=dict)
    steps: int = 0
    prefills: int = 0
    accepted: Counter = field(default_factory=Counter)  # accepted draft tokens per request-step -> count
    batch_sizes: Counter = field(default_factory=Counter)  # live requests per step -> count
    step_seconds: float = 0.0
    tokens: int = 0  # tokens emitted by decode steps
    joined_mid_run: int = 0  # requests prefilled after the first step
    finished_mid_run: int = 0  # requests that left while others were still served
    error: str | None = None


class _Blocks:
    """A free list of block ids, last freed handed out first."""

    def __init__(self, num_blocks: int, reverse: bool) -> None:
        ids = list(range(num_blocks))
        self.free = ids if reverse else ids[::-1]  # pop() takes from the end

    def take(self) -> int:
        return self.free.pop()

    def give(self, ids: list[int]) -> None:
        self.free.extend(ids)


@dataclass
class _Live:
    index: int
    req: Request
    blocks: dict[str, list[int]]
    out: list[int]
    computed: int  # tokens whose K/V is in the cache
    need: int  # blocks per group at its full length
    prev_seq_len: int | None = None


def _drafts(
    scenario: Scenario, index: int, emitted: int, reference: list[int], k: int, vocab: int
) -> list[int]:
    rng = random.Random(f"{scenario.draft_seed}/{index}/{emitted}")
    out = []
    for j in range(k):
        pos = emitted + j
        right = reference[pos] if pos < len(reference) else rng.randrange(vocab)
        if rng.random() < scenario.accuracy:
            out.append(right)
        else:
            out.append((right + 1 + rng.randrange(vocab - 1)) % vocab)
    return out


def serve(
    scenario: Scenario,
    step_fn: Any,
    runner: GraphRunner,
    references: dict[int, list[int]],
    *,
    k: int,
    block_size: int,
    num_blocks: int,
    vocab: int,
    faults: frozenset[str] = frozenset(),
) -> ServeResult:
    """Serve ``scenario`` (see the module docstring); ``references[i]``: request i's reference stream (what
    the drafter is right about). Prefills run ``step_fn`` eagerly; decode steps go through ``runner``.
    An exception stops the serving; its text is ``result.error``."""
    result = ServeResult()
    groups = ("sliding", "full")
    pools = {"sliding": _Blocks(num_blocks, reverse=True), "full": _Blocks(num_blocks, reverse=False)}
    waiting = sorted(range(len(scenario.requests)), key=lambda i: (scenario.requests[i].arrival, i))
    live: list[_Live] = []
    q_len = 1 + k
    buffers = runner.buffers
    step = 0
    try:
        while waiting or live:
            if step > MAX_STEPS:
                raise RuntimeError(
                    f"not done after {MAX_STEPS} steps (requests waiting for blocks that never free)"
                )
            for i in [i for i in waiting if scenario.requests[i].arrival <= step]:
                req = scenario.requests[i]
                need = -(-(len(req.prompt) + req.max_new + k) // block_size)
                # blocks the live requests may still take
                owed = sum(e.need - len(e.blocks["full"]) for e in live)
                if any(len(pools[g].free) - owed < need for g in groups):
                    continue  # no room yet: it waits for blocks
                waiting.remove(i)
                entry = _Live(i, req, {g: [] for g in groups}, [], 0, need)
                _grow(entry, pools, len(req.prompt), block_size)
                logits = step_fn(_prefill_step(entry, block_size, buffers.device))
                entry.out.append(int(logits[-1].argmax()))
                entry.computed = len(req.prompt)
                result.prefills += 1
                result.joined_mid_run += step > 0
                live.append(entry)
            live.sort(key=lambda e: e.index)
            done = [e for e in live if len(e.out) >= e.req.max_new]
            for e in done:
                _finish(e, live, pools, result)
                result.finished_mid_run += bool(live or waiting)
            if not live:
                step += 1
                continue
            drafts = {e.index: _drafts(scenario, e.index, len(e.out), references.get(e.index, []), k, vocab)
                      for e in live}  # fmt: skip
            for e in live:
                _grow(e, pools, e.computed + q_len, block_size)
            sources = _sources(live, drafts, q_len, block_size, faults)
            n = len(live)
            t0 = time.perf_counter()
            if "pad_not_cleared" in faults and runner.size_for(n) is not None:
                for g in groups:  # planted: a hand-written refresh that writes the live rows only
                    name = f"slot_mapping.{g}"
                    buffers.full[name][: n * q_len].copy_(torch.as_tensor(sources.pop(name)))
            logits = runner.run(sources, num_reqs=n)
            targets = logits.argmax(-1).view(n, q_len).tolist()
            result.step_seconds += time.perf_counter() - t0
            result.steps += 1
            result.batch_sizes[n] += 1
            for e in live:
                row, d = targets[live.index(e)], drafts[e.index]
                accepted = 0
                while accepted < k and d[accepted] == row[accepted]:
                    accepted += 1
                emit = ([*d[:accepted], row[accepted]])[: e.req.max_new - len(e.out)]
                e.out.extend(emit)
                result.tokens += len(emit)
                result.accepted[accepted] += 1
                e.prev_seq_len = e.computed + q_len
                e.computed += accepted + 1
            step += 1
        for e in list(live):
            _finish(e, live, pools, result)
    except Exception as exc:  # a rejected refresh or a kernel fault is a failure the drill reports
        result.error = f"step {step}: {type(exc).__name__}: {exc}"
        for e in live:
            result.streams[e.index] = e.out
    return result


def _finish(e: _Live, live: list[_Live], pools: dict[str, _Blocks], result: ServeResult) -> None:
    live.remove(e)
    for g, ids in e.blocks.items():
        pools[g].give(ids[::-1])
    result.streams[e.index] = e.out


def _grow(e: _Live, pools: dict[str, _Blocks], tokens: int, block_size: int) -> None:
    for g, ids in e.blocks.items():
        while len(ids) * block_size < tokens:
            ids.append(pools[g].take())


def _slot(blocks: list[int], pos: int, block_size: int) -> int:
    return blocks[pos // block_size] * block_size + pos % block_size


def _prefill_step(e: _Live, block_size: int, device: torch.device) -> Step:
    n = len(e.req.prompt)
    pos = list(range(n))

    def t(values: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)

    views = {
        "input_ids": t(e.req.prompt, torch.int64),
        "positions": t(pos, torch.int64),
        "seq_lens": t([n], torch.int32),
        "query_start_loc": t([0, n], torch.int32),
    }
    for g, ids in e.blocks.items():
        views[f"block_table.{g}"] = t([ids], torch.int32)
        views[f"slot_mapping.{g}"] = t([_slot(ids, p, block_size) for p in pos], torch.int64)
    return Step(n, views, None, {}, 1)


def _sources(
    live: list[_Live], drafts: dict[int, list[int]], q_len: int, block_size: int, faults: frozenset[str]
) -> dict[str, np.ndarray]:
    ids, pos, lens = [], [], []
    slots: dict[str, list[int]] = {"sliding": [], "full": []}
    for e in live:
        ids += [e.out[-1], *drafts[e.index]]
        p = list(range(e.computed, e.computed + q_len))
        pos += p
        lens.append(e.computed + q_len)
        for g in slots:
            slots[g] += [_slot(e.blocks[g], x, block_size) for x in p]
    if "stale_seq_len" in faults:  # planted: the first request that ran last step keeps last step's seq_len
        for i, e in enumerate(live):
            if e.prev_seq_len is not None:
                lens[i] = e.prev_seq_len
                break
    out: dict[str, np.ndarray] = {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "positions": np.asarray(pos, dtype=np.int64),
        "seq_lens": np.asarray(lens, dtype=np.int32),
        "query_start_loc": np.arange(len(live) + 1, dtype=np.int32) * q_len,
    }
    for g in slots:
        width = max(len(e.blocks[g]) for e in live)
        table = np.zeros((len(live), width), dtype=np.int32)
        for i, e in enumerate(live):
            table[i, : len(e.blocks[g])] = e.blocks[g]
        out[f"block_table.{g}"] = table
        out[f"slot_mapping.{g}"] = np.asarray(slots[g], dtype=np.int64)
    return out

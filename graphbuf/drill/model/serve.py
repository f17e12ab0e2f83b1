"""Serving the tiny Gemma4 under MTP with its real assistant, every decode and draft step through graphbuf.

A :class:`Scenario` is what one drill serves: requests (prompt, arrival step, tokens to generate) and when
steps run without drafts and with DP padding. :class:`Server` runs it the way vLLM runs the 31B:

* at most ``max_num_seqs`` requests live; an arriving request is prefilled eagerly (one request, the whole
  prompt), which gives its first token and the hidden state its first drafts start from;
* a draft step per draft token: the assistant (:class:`.paged.PagedAssistant`) at the request's last target
  position (constant over the step's drafts), its inputs the last token and the hidden state the target (or
  the previous draft) gave, through its own ``GraphRunner`` (one token per request);
* then a verify step (``1 + k`` tokens per request, greedy acceptance) or, every ``mtp_off_every`` steps, an
  MTP-off decode step (one token per request: the full layers' paged decode with host KV lengths re-issued);
  every ``dp_pad_every`` steps ``num_reqs`` is padded beyond the live rows (a DP rank padding to its busiest
  peer: padded requests with ``seq_len`` 0, slots -1);
* blocks: kernel blocks of ``block_size`` for the sliding group; the full group's manager blocks are twice
  that (vLLM's page-size unification), its block table in kernel blocks; block 0 is the null block. A sliding
  block wholly out of every future query's window is replaced by the null block and freed, and freed blocks
  are reused last-freed first, so stale ids point at live data.

Each decode step is checked by :mod:`.criterion`'s layers 1 and 2; each draft step by layer 1 and against
transformers' own assistant forward over the same K/V.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import LargeHeadBinding
from graphbuf.graphs.runner import GraphRunner, Step

from .criterion import FP32_LIVE_TOL, LayerCount, TeacherForced, caches_differ, logits_differ
from .paged import PagedAssistant, PagedGemma4

__all__ = ["MAX_STEPS", "Request", "Scenario", "ServeResult", "Server"]

#: Decode steps after which the serving gives up.
MAX_STEPS = 10_000
_GROUPS = ("sliding", "full")


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
    """What one drill serves: requests; every ``mtp_off_every``-th step runs without drafts and every
    ``dp_pad_every``-th step pads ``num_reqs`` by one (0: never)."""

    requests: tuple[Request, ...]
    mtp_off_every: int = 4
    dp_pad_every: int = 3

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": [r.as_dict() for r in self.requests],
            "mtp_off_every": self.mtp_off_every,
            "dp_pad_every": self.dp_pad_every,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Scenario:
        reqs = tuple(
            Request(tuple(int(t) for t in r["prompt"]), int(r["arrival"]), int(r["max_new"]))
            for r in doc["requests"]
        )
        return cls(reqs, int(doc.get("mtp_off_every", 4)), int(doc.get("dp_pad_every", 3)))


@dataclass
class ServeResult:
    """Token streams by request index, what the serving did, and the per-step checks."""

    streams: dict[int, list[int]] = field(default_factory=dict)
    rows: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # the logits row behind each token
    steps: int = 0
    decode_steps: int = 0  # MTP-off steps (one token per request)
    dp_padded_steps: int = 0
    prefills: int = 0
    accepted: Counter = field(default_factory=Counter)  # accepted drafts per request-step -> count
    accepted_by_step: list[str] = field(default_factory=list)  # per verify step: accepted per request
    batch_sizes: Counter = field(default_factory=Counter)  # live requests per step -> count
    nulled_blocks: int = 0  # sliding blocks replaced by the null block
    step_seconds: float = 0.0
    tokens: int = 0
    joined_mid_run: int = 0
    finished_mid_run: int = 0
    replay_eager: LayerCount = field(default_factory=LayerCount)  # layer 1, decode steps
    live_eager: LayerCount = field(default_factory=LayerCount)  # layer 2
    draft_replay_eager: LayerCount = field(default_factory=LayerCount)  # layer 1, draft steps
    drafter: TeacherForced = field(default_factory=TeacherForced)  # drafts vs transformers' assistant
    error: str | None = None


class _Blocks:
    """A free list of block ids ``1 .. count - 1`` (0 is the null block), last freed handed out first."""

    def __init__(self, count: int) -> None:
        self.free = list(range(count - 1, 0, -1))

    def take(self) -> int:
        return self.free.pop()

    def give(self, ids: list[int]) -> None:
        self.free.extend(i for i in ids if i != 0)


@dataclass
class _Live:
    index: int
    req: Request
    blocks: dict[str, list[int]]  # sliding: kernel blocks; full: manager blocks
    out: list[int]
    rows: list[torch.Tensor]
    computed: int  # tokens whose K/V is in the cache
    hidden: torch.Tensor  # the target's hidden state behind out[-1]
    need: dict[str, int]  # blocks per group at the request's full length
    prev_seq_len: int | None = None


@dataclass
class _Batch:
    """One decode step's inputs: the correct sources of the live requests (padding included) and the
    views of the live requests alone."""

    sources: dict[str, np.ndarray]
    live_views: dict[str, torch.Tensor]
    lens: list[int]
    q_len: int
    live: int
    num_reqs: int


class Server:
    """Serves a :class:`Scenario` through the verify, decode and draft runners of one model session."""

    def __init__(
        self, *, target: PagedGemma4, assistant: PagedAssistant, verify: GraphRunner, decode: GraphRunner,
        draft: GraphRunner, reference_assistant: Any, k: int, block_size: int, num_blocks: int,
        window: int, max_num_seqs: int, table_width: int, exact: bool, faults: frozenset[str],
    ) -> None:  # fmt: skip
        self.target, self.assistant = target, assistant
        self.verify, self.decode, self.draft = verify, decode, draft
        self.reference_assistant = reference_assistant
        self.k, self.bs, self.num_blocks, self.window = k, block_size, num_blocks, window
        self.max_num_seqs = max_num_seqs
        self.table_width = table_width  # kernel blocks per request at the model length: vLLM's table width
        self.tol = 0.0 if exact else FP32_LIVE_TOL
        self.faults = faults
        self.device = verify.buffers.device

    # --- blocks and slots ---------------------------------------------------------------------------------

    def _grow(self, e: _Live, pools: dict[str, _Blocks], tokens: int) -> None:
        for g, ids in e.blocks.items():
            per = self.bs * (2 if g == "full" else 1)
            while len(ids) * per < tokens:
                ids.append(pools[g].take())

    def _table(self, e: _Live, group: str) -> list[int]:
        """The group's block table row in kernel blocks (a full manager block m is kernel blocks 2m, 2m+1)."""
        if group == "sliding":
            return list(e.blocks["sliding"])
        return [2 * m + j for m in e.blocks["full"] for j in (0, 1)]

    def _slot(self, e: _Live, group: str, pos: int) -> int:
        per = self.bs * (2 if group == "full" else 1)
        return e.blocks[group][pos // per] * per + pos % per

    def _null_out_of_window(self, e: _Live, pools: dict[str, _Blocks], result: ServeResult) -> None:
        """Sliding blocks before every future query's window (the next draft sees keys >= computed -
        window) become the null block; their ids go back to the pool."""
        first = max(0, e.computed - self.window) // self.bs
        ids = e.blocks["sliding"]
        for i in range(min(first, len(ids))):
            if ids[i] != 0:
                pools["sliding"].give([ids[i]])
                ids[i] = 0
                result.nulled_blocks += 1

    # --- serving ------------------------------------------------------------------------------------------

    def serve(self, scenario: Scenario) -> ServeResult:
        """Serve ``scenario`` from the caches and buffers as they are (the caller cleans them). An exception
        stops the serving; its text is ``result.error``."""
        result = ServeResult()
        pools = {"sliding": _Blocks(self.num_blocks), "full": _Blocks(self.num_blocks // 2)}
        waiting = sorted(range(len(scenario.requests)), key=lambda i: (scenario.requests[i].arrival, i))
        live: list[_Live] = []
        step = 0
        try:
            while waiting or live:
                if step > MAX_STEPS:
                    raise RuntimeError(f"not done after {MAX_STEPS} steps (requests waiting for blocks)")
                self._admit(scenario, step, waiting, live, pools, result)
                for e in [e for e in live if len(e.out) >= e.req.max_new]:
                    self._finish(e, live, pools, result)
                    result.finished_mid_run += bool(live or waiting)
                if live:
                    for e in live:
                        self._null_out_of_window(e, pools, result)
                    self._step(scenario, step, live, pools, result)
                step += 1
        except Exception as exc:  # a rejected refresh or a kernel fault is a failure the drill reports
            result.error = f"step {step}: {type(exc).__name__}: {exc}"
            for e in list(live):
                self._finish(e, live, pools, result)
        return result

    def _admit(
        self, scenario: Scenario, step: int, waiting: list[int], live: list[_Live],
        pools: dict[str, _Blocks], result: ServeResult,
    ) -> None:  # fmt: skip
        for i in [i for i in waiting if scenario.requests[i].arrival <= step]:
            if len(live) >= self.max_num_seqs:
                return
            req = scenario.requests[i]
            total = len(req.prompt) + req.max_new + self.k
            # the most blocks it holds at once: sliding blocks out of the window go back to the pool
            held = -(-(len(req.prompt) + self.window + 2 * self.k + 2) // self.bs) + 1
            need = {"sliding": min(-(-total // self.bs), held), "full": -(-total // (2 * self.bs))}
            owed = {
                g: sum(max(0, x.need[g] - sum(1 for b in x.blocks[g] if b)) for x in live) for g in _GROUPS
            }
            if any(len(pools[g].free) - owed[g] < need[g] for g in _GROUPS):
                continue  # no room yet: it waits for blocks
            waiting.remove(i)
            e = _Live(i, req, {g: [] for g in _GROUPS}, [], [], 0, torch.empty(0), need)
            self._grow(e, pools, len(req.prompt))
            logits, hidden = self.target(self._prefill_step(e))
            e.out.append(int(logits[-1].argmax()))
            e.rows.append(logits[-1].clone())
            e.hidden = hidden[-1].clone()
            e.computed = len(req.prompt)
            result.prefills += 1
            result.joined_mid_run += step > 0
            live.append(e)
        live.sort(key=lambda e: e.index)

    def _finish(self, e: _Live, live: list[_Live], pools: dict[str, _Blocks], result: ServeResult) -> None:
        live.remove(e)
        for g, ids in e.blocks.items():
            pools[g].give(ids[::-1])
        result.streams[e.index] = e.out[: e.req.max_new]
        result.rows[e.index] = e.rows[: e.req.max_new]

    def _tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), dtype=dtype, device=self.device)

    def _prefill_step(self, e: _Live) -> Step:
        n = len(e.req.prompt)
        views = {
            "input_ids": self._tensor(e.req.prompt, torch.int64),
            "positions": self._tensor(range(n), torch.int64),
            "seq_lens": self._tensor([n], torch.int32),
            "query_start_loc": self._tensor([0, n], torch.int32),
        }
        for g in _GROUPS:
            views[f"block_table.{g}"] = self._tensor([self._table(e, g)], torch.int32)
            views[f"slot_mapping.{g}"] = self._tensor([self._slot(e, g, p) for p in range(n)], torch.int64)
        return Step(n, views, None, LargeHeadBinding.host_args(1, [n]), 1)

    def _step(
        self, scenario: Scenario, step: int, live: list[_Live], pools: dict[str, _Blocks], result: ServeResult
    ) -> None:
        every = scenario.mtp_off_every
        mtp = not (every and step % every == every - 1)
        drafts = self._draft(step, live, result) if mtp else {e.index: [] for e in live}
        q_len = 1 + self.k if mtp else 1
        for e in live:
            self._grow(e, pools, e.computed + q_len)
        pad = scenario.dp_pad_every
        extra = 1 if pad and step % pad == pad - 1 and len(live) < self.max_num_seqs else 0
        batch = self._batch(live, drafts, q_len, extra)
        t0 = time.perf_counter()
        logits, hidden = self._run_checked(step, batch, result)
        result.step_seconds += time.perf_counter() - t0
        result.steps += 1
        result.decode_steps += not mtp
        result.dp_padded_steps += bool(extra)
        result.batch_sizes[len(live)] += 1
        targets = logits.argmax(-1).view(len(live), q_len).tolist()
        accepted_here = []
        for r, e in enumerate(live):
            row, d = targets[r], drafts[e.index]
            accepted = 0
            while accepted < len(d) and d[accepted] == row[accepted]:
                accepted += 1
            emit = [*d[:accepted], row[accepted]][: e.req.max_new - len(e.out)]
            e.out.extend(emit)
            e.rows.extend(logits[r * q_len + j].clone() for j in range(len(emit)))
            e.hidden = hidden[r * q_len + accepted].clone()
            result.tokens += len(emit)
            if mtp:
                result.accepted[accepted] += 1
                accepted_here.append(str(accepted))
            e.prev_seq_len = e.computed + q_len
            e.computed += accepted + 1
        if mtp:
            result.accepted_by_step.append("".join(accepted_here))

    # --- the decode step and its checks -------------------------------------------------------------------

    def _batch(self, live: list[_Live], drafts: dict[int, list[int]], q_len: int, extra: int) -> _Batch:
        ids, pos, lens = [], [], []
        slots: dict[str, list[int]] = {g: [] for g in _GROUPS}
        tables = {g: [self._table(e, g) for e in live] for g in _GROUPS}
        for e in live:
            ids += [e.out[-1], *drafts[e.index]]
            p = list(range(e.computed, e.computed + q_len))
            pos += p
            lens.append(e.computed + q_len)
            for g in _GROUPS:
                slots[g] += [self._slot(e, g, x) for x in p]
        live_views = {
            "input_ids": self._tensor(ids, torch.int64), "positions": self._tensor(pos, torch.int64),
            "seq_lens": self._tensor(lens, torch.int32),
            "query_start_loc": self._tensor(np.arange(len(live) + 1) * q_len, torch.int32),
        }  # fmt: skip
        sources: dict[str, np.ndarray] = {
            "input_ids": np.asarray(ids + [0] * (extra * q_len), dtype=np.int64),
            "positions": np.asarray(pos + [0] * (extra * q_len), dtype=np.int64),
            "seq_lens": np.asarray(lens + [0] * extra, dtype=np.int32),
            "query_start_loc": np.arange(len(live) + extra + 1, dtype=np.int32) * q_len,
        }
        for g in _GROUPS:
            width = max(len(t) for t in tables[g])
            table = np.zeros((len(live) + extra, width), dtype=np.int32)
            for i, t in enumerate(tables[g]):
                table[i, : len(t)] = t
            sources[f"block_table.{g}"] = table
            sources[f"slot_mapping.{g}"] = np.asarray(slots[g] + [-1] * (extra * q_len), dtype=np.int64)
            wide = np.zeros((len(live), self.table_width), dtype=np.int32)
            wide[:, :width] = table[: len(live)]
            live_views[f"block_table.{g}"] = self._tensor(wide, torch.int32)
            live_views[f"slot_mapping.{g}"] = self._tensor(slots[g], torch.int64)
        if "stale_seq_len" in self.faults:  # planted: the first request that ran last step keeps its seq_len
            for i, e in enumerate(live):
                if e.prev_seq_len is not None:
                    sources["seq_lens"] = sources["seq_lens"].copy()
                    sources["seq_lens"][i] = e.prev_seq_len
                    break
        return _Batch(sources, live_views, lens, q_len, len(live), len(live) + extra)

    def _run_checked(
        self, step: int, batch: _Batch, result: ServeResult
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step through its runner; layer 1 on a replay, layer 2 always; the caches end as the
        runner left them."""
        runner = self.verify if batch.q_len > 1 else self.decode
        n = batch.num_reqs
        size = runner.size_for(n)
        host = {}  # the decode route's host KV lengths, for the graph's batch; the verify call takes none
        if batch.q_len == 1:
            host = LargeHeadBinding.host_args(size if size else n, batch.sources["seq_lens"])
        before = [kv.clone() for kv in self.target.kv]
        if "pad_not_cleared" in self.faults and size is not None:
            sources = dict(batch.sources)
            for g in _GROUPS:  # planted: a hand-written refresh that writes the live rows only
                name = f"slot_mapping.{g}"
                runner.buffers.full[name][: n * batch.q_len].copy_(torch.as_tensor(sources.pop(name)))
        else:
            sources = batch.sources
        logits, hidden = (t.clone() for t in runner.run(sources, num_reqs=n, host_args=host))
        after = [kv.clone() for kv in self.target.kv]
        caches = self.target.caches
        if size is not None:  # layer 1: the same refreshed buffers, run eagerly
            # From the caches the replay left: the eager run rewrites every slot the replay wrote (the same
            # slot buffers) before any read, so it reads what it would read from the caches before the step.
            want, _ = self.target(Step(size, runner.buffers.view(size), None, host, n))
            problem = logits_differ(logits, want[: logits.shape[0]], 0.0)
            problem = problem or caches_differ(caches, _pairs(after), 0.0)
            result.replay_eager.add(step, problem)
        self._restore(before)  # layer 2: the live requests alone, straight from their state
        rows = batch.live * batch.q_len
        live_host = LargeHeadBinding.host_args(batch.live, batch.lens) if batch.q_len == 1 else {}
        want, _ = self.target(Step(rows, batch.live_views, None, live_host, batch.live))
        problem = logits_differ(logits[:rows], want, self.tol) or caches_differ(
            caches, _pairs(after), self.tol, blocks=self.num_blocks
        )
        result.live_eager.add(step, problem)
        self._restore(after)
        return logits[:rows], hidden[:rows]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for kv, s in zip(self.target.kv, saved):
            kv.copy_(s)

    # --- drafts ---------------------------------------------------------------------------------------------

    def _draft(self, step: int, live: list[_Live], result: ServeResult) -> dict[int, list[int]]:
        """``k`` drafts per live request through the draft runner, each checked by layer 1, then all of the
        step's drafts against one batched forward of transformers' assistant over the same K/V."""
        n = len(live)
        sources = self._draft_sources(live)
        tokens = [e.out[-1] for e in live]
        hidden = torch.stack([e.hidden for e in live])
        size = self.draft.size_for(n)
        inputs: list[tuple[list[int], torch.Tensor]] = []  # per draft: the tokens and hidden states it read
        rows: list[torch.Tensor] = []  # per draft: the logits the replay gave
        for _ in range(self.k):
            self.assistant.hidden_in[:n].copy_(hidden)
            sources["input_ids"] = np.asarray(tokens, dtype=np.int64)
            logits, out = (t.clone() for t in self.draft.run(sources, num_reqs=n))
            if size is not None:
                want, want_hidden = self.assistant(Step(size, self.draft.buffers.view(size), None, {}, n))
                problem = logits_differ(logits, want[:n], 0.0) or logits_differ(out, want_hidden[:n], 0.0)
                result.draft_replay_eager.add(step, problem)
            inputs.append((tokens, hidden))
            rows.append(logits)
            tokens, hidden = logits.argmax(-1).tolist(), out
        theirs = self._reference_drafts(live, inputs)  # [k, n, vocab]
        drafts: dict[int, list[int]] = {}
        for r, e in enumerate(live):
            ours = torch.stack([x[r] for x in rows])
            drafts[e.index] = ours.argmax(-1).tolist()
            result.drafter.add(e.index, drafts[e.index], ours, theirs[:, r])
        return drafts

    def _draft_sources(self, live: list[_Live]) -> dict[str, np.ndarray]:
        """The draft step's sources but its token ids: every draft of a step at the request's last target
        position, over the target's KV length, through both groups' block tables."""
        n, seq = len(live), [e.computed for e in live]
        sources: dict[str, np.ndarray] = {
            "positions": np.asarray([s - 1 for s in seq], dtype=np.int64),
            "seq_lens": np.asarray(seq, dtype=np.int32),
            "query_start_loc": np.arange(n + 1, dtype=np.int32),
        }
        for g in _GROUPS:
            tables = [self._table(e, g) for e in live]
            table = np.zeros((n, max(len(t) for t in tables)), dtype=np.int32)
            for i, t in enumerate(tables):
                table[i, : len(t)] = t
            sources[f"block_table.{g}"] = table
        return sources

    def _reference_drafts(
        self, live: list[_Live], inputs: list[tuple[list[int], torch.Tensor]]
    ) -> torch.Tensor:
        """transformers' ``Gemma4AssistantForCausalLM`` forward for every draft of the step at once (``[k,
        n, vocab]``): one row per draft and request, the target's K/V of its last sliding and full layers
        gathered through each request's own block lists (no graphbuf buffer), left-padded to the longest
        and masked."""
        lengths = [e.computed for e in live]
        width = max(lengths)
        spans = {"sliding": min(self.window, width), "full": width}  # the sliding KV: the last window tokens
        shared = {}
        for g, kind in (("sliding", "sliding_attention"), ("full", "full_attention")):
            key_cache, value_cache = self.target.caches[self.target.last_layer[g]]
            span = spans[g]
            kv = key_cache.new_zeros((2, len(live), span, *key_cache.shape[2:]))
            for r, (e, length) in enumerate(zip(live, lengths)):
                first = max(0, length - span)
                slots = self._tensor([self._slot(e, g, p) for p in range(first, length)], torch.int64)
                for c, cache in enumerate((key_cache, value_cache)):
                    kv[c, r, span - (length - first) :] = cache.view(-1, *cache.shape[2:]).index_select(
                        0, slots
                    )
            shared[kind] = tuple(
                t.transpose(1, 2).repeat(len(inputs), 1, 1, 1) for t in kv
            )  # [k n, Nkv, L, D]
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=self.device)
        tokens = self._tensor([t for toks, _ in inputs for t in toks], torch.int64).unsqueeze(1)
        hidden = torch.cat([h for _, h in inputs]).unsqueeze(1)
        positions = self._tensor([n - 1 for n in lengths] * len(inputs), torch.int64).unsqueeze(1)
        with torch.no_grad():
            joined = torch.cat([self.target.model.model.embed_tokens(tokens), hidden], dim=-1)
            out = self.reference_assistant(
                inputs_embeds=joined, position_ids=positions, shared_kv_states=shared,
                attention_mask=mask.repeat(len(inputs), 1),
            )  # fmt: skip
        return out.logits[:, 0].float().view(len(inputs), len(live), -1)


def _pairs(kv: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t[0], t[1]) for t in kv]

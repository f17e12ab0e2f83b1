"""``graphbuf drill SPEC --model tiny``: the whole tiny Gemma4 served under MTP through graphbuf, token for
token against transformers' eager greedy generation.

:func:`run_model_drill` builds transformers' ``Gemma4ForCausalLM`` (:mod:`.tiny`), captures its whole step
(:class:`.paged.PagedGemma4`) at every capture size of the model spec with ``GraphRunner``, serves a
:class:`.serve.Scenario` drawn from the seed, and compares every request's tokens with
``model.generate(do_sample=False)`` on the same weights (float32: must be identical; bfloat16: reported). A
failing float32 run is shrunk (fewer requests, fewer tokens, while it still fails), saved as JSON, and
``--replay FILE`` serves exactly that scenario again.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import random
import shlex
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphbuf.buffers.slab import StaticBuffers
from graphbuf.errors import SpecError
from graphbuf.graphs.runner import GraphRunner
from graphbuf.planning.planner import plan
from graphbuf.spec.models import GraphSpec, load_spec

from .paged import FAULTS, PagedGemma4
from .serve import Request, Scenario, ServeResult, serve
from .tiny import MODEL_CONSTANTS, build_model

__all__ = [
    "MODELS",
    "MODEL_SPEC",
    "DtypeRun",
    "ModelDrillReport",
    "ModelSession",
    "draw_scenario",
    "run_model_drill",
    "run_model_drill_cli",
]

#: ``--model`` names → the model spec whose buffers and geometry the drill serves.
MODELS = {"tiny": "gemma4-tiny-model"}
MODEL_SPEC = MODELS["tiny"]
FORMAT = "graphbuf-model-drill/1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_Key = tuple[Any, ...]
#: Per process: the tiny models built (sessions deep-copy them) and transformers' reference streams with
#: their seconds, by (model constants, dtype, seed, device) and prompt; planted faults never touch either.
_MODELS: dict[_Key, Any] = {}
_REFERENCES: dict[_Key, dict[tuple[int, ...], tuple[list[int], float]]] = {}


def _model_spec(spec: str, model: str) -> GraphSpec:
    """The spec the model drill serves: ``spec`` itself when it declares the model step's buffers
    (``input_ids``, ``positions``), else the model's spec, which must keep ``spec``'s speculative tokens
    and buffers."""
    if model not in MODELS:
        raise SpecError(f"--model {model!r}: unknown; allowed: {', '.join(MODELS)}")
    given = load_spec(spec)
    if {"input_ids", "positions"} <= set(given.buffers):
        return given
    target = load_spec(MODELS[model])
    missing = sorted(set(given.buffers) - set(target.buffers))
    k_given, k_target = (
        given.constants.get("num_speculative_tokens"),
        target.constants.get("num_speculative_tokens"),
    )
    if missing or k_given != k_target or list(given.groups) != list(target.groups):
        raise SpecError(
            f"--model {model}: {MODELS[model]} does not serve {given.name}: buffers {missing} missing, "
            f"num_speculative_tokens {k_target} vs {k_given}, groups {target.groups} vs {given.groups}"
        )
    return target


def _with_faults(spec: GraphSpec, faults: frozenset[str]) -> GraphSpec:
    buffers = dict(spec.buffers)
    if "pad_not_cleared" in faults:  # the slot mappings may be left out of a refresh (written by hand)
        buffers["slot_mapping"] = buffers["slot_mapping"].model_copy(update={"keep": True})
    if "short_block_table" in faults:  # one column short, the extra column silently dropped
        bt = buffers["block_table"]
        buffers["block_table"] = bt.model_copy(update={"cols": f"({bt.cols}) - 1", "overflow": "truncate"})
    return spec.model_copy(update={"buffers": buffers})


# ----------------------------------------------------------------------------------------------------------


class ModelSession:
    """Model, paged step, buffers and captured graphs for one dtype; :meth:`serve` runs a scenario from a
    clean state (caches zeroed, buffers refreshed to their pads), so a shrunk scenario fails alike in a
    fresh session."""

    def __init__(
        self, spec: GraphSpec, *, dtype: str, model_seed: int, device: str, faults: frozenset[str]
    ) -> None:
        unknown = sorted(faults - set(FAULTS))
        if unknown:
            raise SpecError(f"model drill: unknown faults {unknown}; allowed: {', '.join(FAULTS)}")
        base = plan(spec, overrides={"num_blocks": 1})
        c = base.constants
        self.k = int(c["num_speculative_tokens"])  # type: ignore[arg-type]
        self.block_size = int(c["block_size"])  # type: ignore[arg-type]
        self.max_model_len = int(c["max_model_len"])  # type: ignore[arg-type]
        self.vocab = int(c["vocab_size"])  # type: ignore[arg-type]
        self.max_seqs = int(c["max_num_seqs"])  # type: ignore[arg-type]
        self.num_blocks = 2 * self.max_seqs * -(-self.max_model_len // self.block_size)
        self.faults = faults
        self.plan = plan(_with_faults(spec, faults), overrides={"num_blocks": self.num_blocks})
        key = (tuple(sorted((n, self.plan.constants[n]) for n in MODEL_CONSTANTS)), dtype, model_seed, device)
        if key not in _MODELS:
            c, torch_dtype = self.plan.constants, _DTYPES[dtype]
            _MODELS[key] = build_model(c, dtype=torch_dtype, seed=model_seed, device=device)
        self.model = copy.deepcopy(_MODELS[key])  # this session's own (its attention is switched per step)
        self._references = _REFERENCES.setdefault(key, {})
        self.step = PagedGemma4(self.model, num_blocks=self.num_blocks, block_size=self.block_size,
                                faults=faults)  # fmt: skip
        self.buffers = StaticBuffers(self.plan, device)
        self.runner = GraphRunner(self.buffers, self.step, output_rows="tokens")
        t0 = time.perf_counter()
        self.runner.capture()
        self.capture_seconds = time.perf_counter() - t0
        self.reference_seconds = 0.0
        self.reference_tokens = 0

    def reference(self, req: Request) -> list[int]:
        """transformers' eager greedy generation of ``req`` on the same weights (memoized per process by
        model and prompt, with the seconds it took; a longer run serves a shorter one)."""
        have, seconds = self._references.get(req.prompt, ([], 0.0))
        if len(have) < req.max_new:
            ids = torch.tensor([req.prompt], dtype=torch.long, device=self.buffers.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_new,
                    min_new_tokens=req.max_new, do_sample=False, pad_token_id=0,
                )  # fmt: skip
            have, seconds = out[0, len(req.prompt) :].tolist(), time.perf_counter() - t0
            self._references[req.prompt] = (have, seconds)
        self.reference_seconds += seconds * req.max_new / len(have)
        self.reference_tokens += req.max_new
        return have[: req.max_new]

    def serve(self, scenario: Scenario) -> tuple[ServeResult, dict[int, list[int]]]:
        """Serve ``scenario`` from a clean state; return the result and the reference streams."""
        refs = {i: self.reference(r) for i, r in enumerate(scenario.requests)}
        for key_cache, value_cache in self.step.caches:
            key_cache.zero_()
            value_cache.zero_()
        largest = self.buffers.capture_sizes[-1]
        self.buffers.refresh(largest, _empty_sources(self.buffers), num_reqs=0)
        for name in self.buffers.names:  # rows written by hand (a planted fault) are unknown to the refresh
            pad = self.plan[name].pad
            self.buffers.full[name].fill_(0 if pad == "repeat_last" else pad)
        result = serve(
            scenario, self.step, self.runner, refs, k=self.k, block_size=self.block_size,
            num_blocks=self.num_blocks, vocab=self.vocab, faults=self.faults,
        )  # fmt: skip
        return result, refs


def _empty_sources(buffers: StaticBuffers) -> dict[str, np.ndarray]:
    out = {}
    for name in buffers.names:
        b = buffers.plan[name]
        shape = (0, b.shape[1]) if len(b.shape) == 2 else (0,)
        if name.startswith("query_start_loc"):
            shape = (1,)
        out[name] = np.zeros(shape, dtype=np.dtype(b.dtype_name))
    return out


def draw_scenario(session: ModelSession, requests: int, seed: int) -> Scenario:
    """``requests`` requests drawn from ``seed``: prompt lengths 4..36, at least 16 tokens each (request 0
    runs to the model length, into the block table's last column), two arriving at step 0 and the rest
    joining over the first steps; drafter accuracy 0.6."""
    rng = random.Random(seed)
    k, top = session.k, session.max_model_len
    reqs = []
    for i in range(requests):
        p = rng.randint(24, 36) if i == 0 else rng.randint(4, 36)
        room = top - p - k
        max_new = room if i == 0 else rng.randint(16, max(16, min(room, 32)))
        arrival = 0 if i < 2 else rng.randint(1, 4 * i)
        reqs.append(Request(tuple(rng.randrange(session.vocab) for _ in range(p)), arrival, max_new))
    return Scenario(tuple(reqs), draft_seed=seed, accuracy=0.6)


# ----------------------------------------------------------------------------------------------------------


@dataclass
class DtypeRun:
    """One dtype's serving compared with transformers."""

    dtype: str
    requests: int
    result: ServeResult
    divergences: dict[int, int]  # request -> first differing position (len of the shorter: a length mismatch)
    replays_by_size: dict[int, int]
    eager_steps: int
    capture_seconds: float
    reference_tokens_per_s: float

    @property
    def identical(self) -> int:
        return self.requests - len(self.divergences)

    @property
    def ok(self) -> bool:
        return not self.divergences and self.result.error is None

    @property
    def replay_tokens_per_s(self) -> float:
        r = self.result
        return r.tokens / r.step_seconds if r.step_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        steps = sum(r.accepted.values())
        return {
            "dtype": self.dtype,
            "requests": self.requests,
            "steps": r.steps,
            "prefills": r.prefills,
            "joined_mid_run": r.joined_mid_run,
            "finished_mid_run": r.finished_mid_run,
            "accepted_per_request_step": {str(a): n for a, n in sorted(r.accepted.items())},
            "mean_accepted": (sum(a * n for a, n in r.accepted.items()) / steps) if steps else None,
            "batch_sizes": {str(b): n for b, n in sorted(r.batch_sizes.items())},
            "replays_by_size": {str(s): n for s, n in sorted(self.replays_by_size.items())},
            "eager_steps": self.eager_steps,
            "identical": self.identical,
            "divergences": {str(i): p for i, p in sorted(self.divergences.items())},
            "error": r.error,
            "capture_seconds": round(self.capture_seconds, 2),
            "replay_tokens_per_s": round(self.replay_tokens_per_s, 1),
            "transformers_eager_tokens_per_s": round(self.reference_tokens_per_s, 1),
        }


@dataclass
class ModelDrillReport:
    spec: str
    model: str
    device: str
    runs: list[DtypeRun] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    shrink_serves: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """float32 streams identical to transformers' (other dtypes are reported, not judged)."""
        return all(r.ok for r in self.runs if r.dtype == "float32") and self.failure is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec, "model": self.model, "device": self.device, "ok": self.ok,
            "runs": [r.as_dict() for r in self.runs], "failure": self.failure,
            "shrink_serves": self.shrink_serves, "seconds": round(self.seconds, 2),
        }  # fmt: skip

    def render(self) -> str:
        lines = [f"graphbuf drill: {self.spec} --model {self.model} on {self.device} (transformers' Gemma4)"]
        for run in self.runs:
            d, r = run.as_dict(), run.result
            verdict = "must match" if run.dtype == "float32" else "reported"
            lines += [
                f"[{run.dtype}, {verdict}] requests {d['requests']} (joined mid-run {d['joined_mid_run']}, "
                f"finished mid-run {d['finished_mid_run']}), decode steps {d['steps']}, "
                f"prefills {d['prefills']}",
                "  accepted draft tokens per request-step: "
                + ", ".join(f"{a}: {n}" for a, n in d["accepted_per_request_step"].items())
                + (f" (mean {d['mean_accepted']:.2f})" if d["mean_accepted"] is not None else ""),
                "  live requests per step: " + ", ".join(f"{b}: {n}" for b, n in d["batch_sizes"].items()),
                "  replays per capture size: "
                + ", ".join(f"{s}: {n}" for s, n in d["replays_by_size"].items())
                + f"; eager steps {d['eager_steps']} (prefills and batches above the largest size)",
                f"  identical sequences: {run.identical}/{run.requests}"
                + "".join(f"; request {i} first differs at token {p}"
                          for i, p in sorted(run.divergences.items())),
                f"  tokens/s: replay {d['replay_tokens_per_s']:.1f}, transformers eager generate "
                f"{d['transformers_eager_tokens_per_s']:.1f}; capture {d['capture_seconds']:.1f} s",
            ]  # fmt: skip
            if r.error:
                lines.append(f"  error: {r.error}")
        if self.failure is not None:
            f = self.failure
            lines.append(
                f"smallest failing scenario: {f['requests']} requests, {f['tokens']} tokens"
                + (f" (shrunk in {self.shrink_serves} serves)" if self.shrink_serves else "")
                + f": {f['what']}"
            )
            if f.get("saved"):
                lines.append(f"saved to {f['saved']}")
            if f.get("replay_command"):
                lines.append(f"replay it: {f['replay_command']}")
        lines.append(f"{'PASS' if self.ok else 'FAIL'} in {self.seconds:.1f} s")
        return "\n".join(lines)


def _divergences(result: ServeResult, refs: Mapping[int, list[int]]) -> dict[int, int]:
    out = {}
    for i, ref in refs.items():
        got = result.streams.get(i, [])
        if got != ref:
            out[i] = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return out


def _dtype_run(session: ModelSession, dtype: str, scenario: Scenario) -> DtypeRun:
    before = dict(session.runner.stats.replays_by_size)
    eager_before = session.runner.stats.eager
    result, refs = session.serve(scenario)
    by_size = {s: n - before.get(s, 0) for s, n in session.runner.stats.replays_by_size.items()}
    ref_rate = session.reference_tokens / session.reference_seconds if session.reference_seconds else 0.0
    return DtypeRun(dtype, len(scenario.requests), result, _divergences(result, refs),
                    {s: n for s, n in by_size.items() if n}, result.prefills + session.runner.stats.eager
                    - eager_before, session.capture_seconds, ref_rate)  # fmt: skip


def _shrink(session: ModelSession, scenario: Scenario, budget: int) -> tuple[Scenario, DtypeRun, int]:
    """Fewer requests, then fewer tokens per request, while float32 still fails (at most ``budget``)."""
    best = scenario
    best_run = _dtype_run(session, "float32", scenario)
    serves = 0

    def attempt(cand: Scenario) -> bool:
        nonlocal best, best_run, serves
        if serves >= budget:
            return False
        serves += 1
        run = _dtype_run(session, "float32", cand)
        if not run.ok:
            best, best_run = cand, run
            return True
        return False

    for i in sorted(best_run.divergences):  # most bugs show in one request served alone
        if len(best.requests) > 1:
            alone = Request(best.requests[i].prompt, 0, best.requests[i].max_new)
            if attempt(Scenario((alone,), best.draft_seed, best.accuracy)):
                break
    changed = True
    while changed and serves < budget:
        changed = False
        for i in reversed(range(len(best.requests))):
            if len(best.requests) > 1 and i < len(best.requests):
                reqs = best.requests[:i] + best.requests[i + 1 :]
                changed |= attempt(Scenario(reqs, best.draft_seed, best.accuracy))
        for i in range(len(best.requests)):
            r = best.requests[i]
            if r.max_new > 1:
                short = Request(r.prompt, r.arrival, max(1, r.max_new // 2))
                reqs = (*best.requests[:i], short, *best.requests[i + 1 :])
                changed |= attempt(Scenario(reqs, best.draft_seed, best.accuracy))
    return best, best_run, serves


def _what(run: DtypeRun) -> str:
    if run.result.error:
        return run.result.error
    return "; ".join(
        f"request {i} differs from transformers at token {p}" for i, p in sorted(run.divergences.items())
    )


def run_model_drill(
    spec: str = "gemma4-31b-it-mtp",
    *,
    model: str = "tiny",
    requests: int = 8,
    seed: int = 0,
    model_seed: int = 0,
    device: str = "cpu",
    dtypes: Iterable[str] = ("float32", "bfloat16"),
    faults: Iterable[str] = (),
    scenario: Scenario | None = None,
    save: str | Path | None = None,
    replay: str | Path | None = None,
    shrink_budget: int = 12,
) -> ModelDrillReport:
    """Serve the tiny Gemma4 through graphbuf and compare with transformers (module docstring).

    ``requests``/``seed`` draw the scenario (:func:`draw_scenario`) unless ``scenario`` is given;
    ``faults``: planted bugs (:data:`.paged.FAULTS`, for the drill's own tests). A float32 failure is shrunk
    with at most ``shrink_budget`` more serves and, with ``save``, written there as JSON; ``replay``: serve
    only the scenario saved in that file (float32, with its faults, seeds and device)."""
    started = time.perf_counter()
    fault_set = frozenset(faults)
    if replay is not None:
        doc = load_model_batch(replay)
        spec, model, device = doc["spec"], doc["model"], doc["device"]
        model_seed, fault_set = int(doc["model_seed"]), frozenset(doc["faults"])
        scenario, dtypes = Scenario.from_dict(doc["scenario"]), ("float32",)
    model_spec = _model_spec(spec, model)
    report = ModelDrillReport(spec=str(spec), model=model, device=device)
    for dtype in dtypes:
        if dtype not in _DTYPES:
            raise SpecError(f"model drill: dtype {dtype!r}; allowed: {', '.join(_DTYPES)}")
        session = ModelSession(
            model_spec, dtype=dtype, model_seed=model_seed, device=device, faults=fault_set
        )
        chosen = scenario if scenario is not None else draw_scenario(session, requests, seed)
        run = _dtype_run(session, dtype, chosen)
        report.runs.append(run)
        if dtype == "float32" and not run.ok and replay is None:
            small, small_run, report.shrink_serves = _shrink(session, chosen, shrink_budget)
            report.failure = {
                "requests": len(small.requests), "tokens": sum(r.max_new for r in small.requests),
                "what": _what(small_run), "saved": str(save) if save is not None else None,
            }  # fmt: skip
            if save is not None:
                save_model_batch(save, report, small, model_seed, fault_set, small_run)
        elif dtype == "float32" and not run.ok:
            report.failure = {
                "requests": len(chosen.requests), "tokens": sum(r.max_new for r in chosen.requests),
                "what": _what(run), "saved": None,
            }  # fmt: skip
    report.seconds = time.perf_counter() - started
    return report


def save_model_batch(
    path: str | Path, report: ModelDrillReport, scenario: Scenario, model_seed: int,
    faults: frozenset[str], run: DtypeRun,
) -> None:  # fmt: skip
    """Write a failing scenario as JSON with what replays it (spec, model, seeds, device, faults)."""
    doc = {
        "format": FORMAT, "spec": report.spec, "model": report.model, "device": report.device,
        "model_seed": model_seed, "faults": sorted(faults), "scenario": scenario.as_dict(),
        "failure": {"what": _what(run), "divergences": {str(i): p for i, p in run.divergences.items()}},
    }  # fmt: skip
    Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def load_model_batch(path: str | Path) -> dict[str, Any]:
    """A saved model-drill scenario; SpecError naming the file if it is not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: cannot read a saved model-drill scenario: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SpecError(f'{path}: not a saved model-drill scenario (expected "format": {FORMAT!r})')
    for key, kind in (("spec", str), ("model", str), ("device", str), ("model_seed", int), ("faults", list),
                      ("scenario", dict)):  # fmt: skip
        if not isinstance(doc.get(key), kind):
            raise SpecError(
                f"{path}: malformed saved model-drill scenario: {key!r} must be a {kind.__name__}"
            )
    return doc


def run_model_drill_cli(args: argparse.Namespace, overrides: Mapping[str, int]) -> int:
    """``graphbuf drill SPEC --model NAME`` (:mod:`graphbuf.cli`): float32 must match; bfloat16 reported."""
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(
            "graphbuf drill --model needs transformers: pip install -c constraints.txt -e '.[model]'",
            name="transformers",
        )
    if overrides:
        raise SpecError(f"--model {args.model}: --set is not supported (the model spec fixes its constants)")
    save = args.save
    if save is None and args.replay is None:
        fd, save = tempfile.mkstemp(prefix="graphbuf-model-drill-", suffix=".json")
        os.close(fd)
    report = run_model_drill(args.spec, model=args.model, seed=args.seed, device=args.device,
                             save=save if args.replay is None else None, replay=args.replay)  # fmt: skip
    if args.save is None and args.replay is None and report.failure is None:
        os.unlink(save)
    if report.failure is not None and args.replay is None:
        report.failure["replay_command"] = (
            f"graphbuf drill {shlex.quote(args.spec)} --model {args.model} --replay {shlex.quote(str(save))}"
        )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1

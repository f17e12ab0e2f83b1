"""``graphbuf drill SPEC --model tiny``: the whole tiny Gemma4 and its MTP assistant served through graphbuf,
judged in three layers per dtype (:mod:`.criterion`).

:func:`run_model_drill` builds transformers' ``Gemma4ForCausalLM`` and ``Gemma4AssistantForCausalLM``
(:mod:`.tiny`), captures the target's verify step, its MTP-off decode step and the assistant's draft step
(:mod:`.paged`) at every capture size with ``GraphRunner``, serves a :class:`.serve.Scenario` drawn from the
seed (:class:`.serve.Server`), and checks every step: replay = eager on the same buffers (bit-identical),
replay = a live-only eager step built from the requests' state, and teacher-forced agreement with
transformers' own forward. A failing run is shrunk (fewer requests, fewer tokens, while it still fails), saved
as JSON, and ``--replay FILE`` serves exactly that scenario again.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import random
import shlex
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import LargeHeadBinding
from graphbuf.buffers.slab import StaticBuffers
from graphbuf.errors import SpecError
from graphbuf.graphs.runner import OVERSIZE, GraphRunner
from graphbuf.planning.planner import plan
from graphbuf.spec.models import GraphSpec, load_spec

from .criterion import TeacherForced
from .paged import FAULTS, PagedAssistant, PagedGemma4
from .replay_file import load_model_replay
from .report import DtypeRun, ModelDrillReport
from .serve import Request, Scenario, Server, ServeResult
from .tiny import MODEL_CONSTANTS, build_models

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
FORMAT = "graphbuf-model-drill/2"
#: The fewest tokens a drawn request generates (the issue's floor for the shipped run).
MIN_NEW = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_Key = tuple[Any, ...]
#: Per process: the tiny models built in float32 (sessions deep-copy them and cast the copies to their
#: dtype), by (model constants, seed, device); planted faults never touch them.
_MODELS: dict[_Key, tuple[Any, Any]] = {}


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


def _one_token(spec: GraphSpec, sizes: list[int], drop: tuple[str, ...]) -> GraphSpec:
    """``spec`` captured at one token per request at ``sizes`` (requests), without the buffers ``drop``."""
    capture = spec.capture.model_copy(update={"tokens_per_request": 1, "sizes": sizes})
    buffers = {n: b for n, b in spec.buffers.items() if n not in drop}
    return spec.model_copy(update={"capture": capture, "buffers": buffers})


class ModelSession:
    """Models, paged steps, buffers and captured graphs for one dtype; :meth:`serve` runs a scenario from a
    clean state (caches zeroed, buffers refreshed to their pads), so a shrunk scenario fails alike in a
    fresh session."""

    def __init__(
        self, spec: GraphSpec, *, dtype: str, model_seed: int, device: str, faults: frozenset[str]
    ) -> None:
        unknown = sorted(faults - set(FAULTS))
        if unknown:
            raise SpecError(f"model drill: unknown faults {unknown}; allowed: {', '.join(FAULTS)}")
        c = plan(spec, overrides={"num_blocks": 2}).constants
        self.dtype = dtype
        self.k, self.block_size = int(c["num_speculative_tokens"]), int(c["block_size"])  # type: ignore[arg-type]
        self.max_model_len, self.vocab = int(c["max_model_len"]), int(c["vocab_size"])  # type: ignore[arg-type]
        self.max_seqs = int(c["max_num_seqs"])  # type: ignore[arg-type]
        if int(c["full_manager_block_size"]) != 2 * self.block_size:  # type: ignore[arg-type]
            raise SpecError(
                f"{spec.name}: full_manager_block_size must be 2 * block_size (the drill's layout)"
            )
        # kernel blocks per group (block 0 is the null block): the full group's manager blocks for every live
        # request at the model length; the sliding group reuses its out-of-window blocks
        self.num_blocks = 2 * (self.max_seqs * -(-self.max_model_len // (2 * self.block_size)) + 1)
        self.faults = faults
        faulty = _with_faults(spec, faults)
        over = {"num_blocks": self.num_blocks}
        self.plan = plan(faulty, overrides=over)
        key = (tuple(sorted((n, self.plan.constants[n]) for n in MODEL_CONSTANTS)), model_seed, device)
        if key not in _MODELS:
            _MODELS[key] = build_models(
                self.plan.constants, dtype=torch.float32, seed=model_seed, device=device
            )
        model, assistant = (copy.deepcopy(m).to(_DTYPES[dtype]) for m in _MODELS[key])  # this session's own
        self.model = model
        rows = OVERSIZE * self.plan.capture_sizes[-1]
        self.target = PagedGemma4(model, num_blocks=self.num_blocks, block_size=self.block_size,
                                  q_len=1 + self.k, max_rows=rows, faults=faults)  # fmt: skip
        self.assistant = PagedAssistant(assistant, self.target, max_rows=rows, faults=faults)
        # every live count replays, padded up to a size: the draft step (k per verify step) at half and all of
        # max_num_seqs, the MTP-off decode step (every mtp_off_every-th step) at max_num_seqs only
        decode_plan = plan(_one_token(faulty, [self.max_seqs], ()), overrides=over)
        halves = sorted({max(1, self.max_seqs // 2), self.max_seqs})
        draft_plan = plan(_one_token(faulty, halves, ("slot_mapping",)), overrides=over)
        self.runners = {
            "verify": GraphRunner(StaticBuffers(self.plan, device), self.target, output_rows="tokens"),
            "decode": GraphRunner(StaticBuffers(decode_plan, device), self.target, output_rows="tokens"),
            "draft": GraphRunner(StaticBuffers(draft_plan, device), self.assistant, output_rows="tokens"),
        }
        t0 = time.perf_counter()
        for name, runner in self.runners.items():
            with torch.no_grad():
                if name == "decode":
                    runner.capture(host_args=lambda size: LargeHeadBinding.host_args(size, []))
                else:
                    runner.capture()
        self.capture_seconds = time.perf_counter() - t0
        window = int(self.plan.constants["sliding_window"])  # type: ignore[arg-type]
        self.server = Server(
            target=self.target, assistant=self.assistant, verify=self.runners["verify"],
            decode=self.runners["decode"], draft=self.runners["draft"], reference_assistant=assistant,
            k=self.k, block_size=self.block_size, num_blocks=self.num_blocks, window=window,
            max_num_seqs=self.max_seqs, table_width=-(-self.max_model_len // self.block_size),
            exact=dtype != "float32", faults=faults,
        )  # fmt: skip

    def serve(self, scenario: Scenario) -> ServeResult:
        """Serve ``scenario`` from a clean state."""
        for kv in self.target.kv:
            kv.zero_()
        for runner in self.runners.values():
            buffers = runner.buffers
            buffers.refresh(buffers.capture_sizes[-1], _empty_sources(buffers), num_reqs=0)
            for name in buffers.names:  # rows written by hand (a planted fault) are unknown to the refresh
                pad = buffers.plan[name].pad
                buffers.full[name].fill_(0 if pad == "repeat_last" else pad)
        return self.server.serve(scenario)

    def teacher_forced(self, scenario: Scenario, result: ServeResult) -> TeacherForced:
        """Layer 3: transformers' own forward (its eager attention) over each served stream, compared
        position by position with the logits rows that chose the served tokens."""
        tf = TeacherForced()
        for i, served in sorted(result.streams.items()):
            prompt = list(scenario.requests[i].prompt)
            if not served:
                continue
            ids = torch.tensor([prompt + served[:-1]], dtype=torch.long, device=self.target.kv[0].device)
            with torch.no_grad():
                logits = self.model(ids, use_cache=False).logits[0, len(prompt) - 1 :]
            tf.add(i, served, torch.stack(result.rows[i]), logits)
        return tf


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
    """``requests`` requests drawn from ``seed``, each generating :data:`MIN_NEW` to ``MIN_NEW + 4`` tokens:
    request 0's prompt leaves just that room, so it runs to the model length (into the block table's last
    column); the others' prompts are 4..36 tokens. Two arrive at step 0, the rest join over the first
    steps; every 4th step MTP-off, every 3rd DP-padded."""
    rng = random.Random(seed)
    k, top = session.k, session.max_model_len
    reqs = []
    for i in range(requests):
        extra = rng.randint(0, 4)
        p = top - k - MIN_NEW - extra if i == 0 else rng.randint(4, 36)
        max_new = MIN_NEW + extra if i == 0 else rng.randint(MIN_NEW, MIN_NEW + 4)
        arrival = 0 if i < 2 else rng.randint(1, 2 * i)
        reqs.append(Request(tuple(rng.randrange(session.vocab) for _ in range(p)), arrival, max_new))
    return Scenario(tuple(reqs))


def _dtype_run(session: ModelSession, scenario: Scenario) -> DtypeRun:
    stats = {name: r.stats for name, r in session.runners.items()}
    before = {name: dict(s.replays_by_size) for name, s in stats.items()}
    eager_before = sum(s.eager for s in stats.values())
    result = session.serve(scenario)
    teacher = session.teacher_forced(scenario, result)
    replays = {
        name: {
            z: n - before[name].get(z, 0) for z, n in s.replays_by_size.items() if n - before[name].get(z, 0)
        }
        for name, s in stats.items()
    }
    eager = result.prefills + sum(s.eager for s in stats.values()) - eager_before
    return DtypeRun(session.dtype, len(scenario.requests), result, teacher, replays, eager,
                    session.capture_seconds)  # fmt: skip


def _shrink(session: ModelSession, scenario: Scenario, budget: int) -> tuple[Scenario, DtypeRun, int]:
    """Fewer requests, then fewer tokens per request, while the run still fails (at most ``budget``)."""
    best = scenario
    best_run = _dtype_run(session, scenario)
    serves = 0

    def attempt(cand: Scenario) -> bool:
        nonlocal best, best_run, serves
        if serves >= budget:
            return False
        serves += 1
        run = _dtype_run(session, cand)
        if not run.ok:
            best, best_run = cand, run
            return True
        return False

    def with_requests(reqs: tuple[Request, ...]) -> Scenario:
        return Scenario(reqs, best.mtp_off_every, best.dp_pad_every)

    changed = True
    while changed and serves < budget:
        changed = False
        for i in reversed(range(len(best.requests))):
            if len(best.requests) > 1 and i < len(best.requests):
                changed |= attempt(with_requests(best.requests[:i] + best.requests[i + 1 :]))
        for i in range(len(best.requests)):
            r = best.requests[i]
            if r.max_new > 1:
                short = Request(r.prompt, r.arrival, max(1, r.max_new // 2))
                changed |= attempt(with_requests((*best.requests[:i], short, *best.requests[i + 1 :])))
    return best, best_run, serves


def _what(run: DtypeRun) -> str:
    return "; ".join(run.problems)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after: its full passes scan every object
    torch, transformers and the captured graphs hold, and the drill's garbage waits for the next pass."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_model_drill(
    spec: str = "gemma4-31b-it-mtp",
    *,
    model: str = "tiny",
    requests: int = 4,
    seed: int = 0,
    model_seed: int = 0,
    device: str = "cpu",
    dtypes: Iterable[str] = ("float32", "bfloat16"),
    faults: Iterable[str] = (),
    scenario: Scenario | None = None,
    save: str | Path | None = None,
    replay: str | Path | None = None,
    shrink_budget: int = 6,
) -> ModelDrillReport:
    """Serve the tiny Gemma4 through graphbuf and judge every dtype (module docstring).

    ``requests``/``seed`` draw the scenario (:func:`draw_scenario`) unless ``scenario`` is given;
    ``faults``: planted bugs (:data:`.paged.FAULTS`, for the drill's own tests). The first failing dtype is
    shrunk with at most ``shrink_budget`` more serves and, with ``save``, written there as JSON; ``replay``:
    serve only the scenario saved in that file (its dtype, faults, seeds and device)."""
    started = time.perf_counter()
    fault_set = frozenset(faults)
    if replay is not None:
        doc = load_model_batch(replay)
        spec, model, device = doc["spec"], doc["model"], doc["device"]
        model_seed, fault_set = int(doc["model_seed"]), frozenset(doc["faults"])
        scenario, dtypes = Scenario.from_dict(doc["scenario"]), (doc["dtype"],)
    model_spec = _model_spec(spec, model)
    report = ModelDrillReport(spec=str(spec), model=model, device=device)
    with _collector_paused():  # serving makes no garbage worth collecting mid-run
        for dtype in dtypes:
            if dtype not in _DTYPES:
                raise SpecError(f"model drill: dtype {dtype!r}; allowed: {', '.join(_DTYPES)}")
            session = ModelSession(
                model_spec, dtype=dtype, model_seed=model_seed, device=device, faults=fault_set
            )
            chosen = scenario if scenario is not None else draw_scenario(session, requests, seed)
            run = _dtype_run(session, chosen)
            report.runs.append(run)
            if run.ok or report.failure is not None:
                continue
            small, small_run = chosen, run
            if replay is None:
                small, small_run, report.shrink_serves = _shrink(session, chosen, shrink_budget)
            report.failure = {
                "dtype": dtype, "requests": len(small.requests),
                "tokens": sum(r.max_new for r in small.requests), "what": _what(small_run),
                "saved": str(save) if save is not None and replay is None else None,
            }  # fmt: skip
            if save is not None and replay is None:
                save_model_batch(save, report, small, model_seed, fault_set, small_run)
    report.seconds = time.perf_counter() - started
    return report


def save_model_batch(
    path: str | Path, report: ModelDrillReport, scenario: Scenario, model_seed: int,
    faults: frozenset[str], run: DtypeRun,
) -> None:  # fmt: skip
    """Write a failing scenario as JSON with what replays it (spec, model, seeds, device, faults)."""
    doc = {
        "format": FORMAT, "spec": report.spec, "model": report.model, "device": report.device,
        "model_seed": model_seed, "faults": sorted(faults), "dtype": run.dtype,
        "scenario": scenario.as_dict(),
        "failure": {"what": _what(run), "problems": run.problems},
    }  # fmt: skip
    Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def load_model_batch(path: str | Path) -> dict[str, Any]:
    """A saved model-drill scenario, every field checked and bounded (:mod:`.replay_file`); a
    BatchFileError naming the file, the field and the value if it is not one."""
    return load_model_replay(
        path, format_name=FORMAT, models=MODELS, served=_model_spec, dtypes=tuple(_DTYPES), faults=FAULTS
    )


def run_model_drill_cli(args: argparse.Namespace, overrides: Mapping[str, int]) -> int:
    """``graphbuf drill SPEC --model NAME`` (:mod:`graphbuf.cli`): every dtype judged by layers 1-3."""
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

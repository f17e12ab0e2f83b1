"""Mutation testing of graphbuf's core modules with mutmut (issue 24 §2): one command, per-module kill scores.

    python tools/mutation.py [--module NAME ...] [--sample N] [--seed S] [--kernel] [--max-children K]

Each core module is mutated alone, against its own fast tests (:data:`MODULES`), in a scratch copy of the
repository under ``build/mutation/<module>/`` (mutmut works in the current directory and reads its settings
from ``setup.cfg``: the copy gets one written for that module; the working tree is never touched). The
numpy refresh path is measured (``GRAPHBUF_NATIVE=0``) unless ``--kernel``: the kernel does the checks and
writes of several Python functions in one C call, so those mutants would survive for that reason alone.

``--sample N`` runs N mutants drawn with ``--seed`` from each module's (all are generated; the tests' stats
are collected once). Mutants listed in ``tests/mutation/EQUIVALENT.md`` (equivalent: no input tells them
apart) and the device-only functions of :data:`DEVICE_ONLY` (reached only with a cuda/npu device) are left
out of the score and counted apart. Prints one line per module and writes ``build/mutation/report.json``
(``--report``);
``--survivors`` prints each surviving mutant's diff. Needs ``.venv/bin/pip install -c constraints.txt -e
'.[mutation]'``. Not part of ``.ci/run`` (minutes per module); run before a release or after changing a core
module.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutation"

#: Module name -> (file, its own fast tests).
MODULES: dict[str, tuple[str, list[str]]] = {
    "refresh.validate": (
        "graphbuf/buffers/validate.py",
        [
            "tests/unit/buffers/test_refresh.py",
            "tests/unit/buffers/test_validate.py",
            "tests/unit/buffers/test_validate_pins.py",
            "tests/unit/buffers/test_mapping.py",
            "tests/unit/buffers/test_atomic_errors.py",
            "tests/unit/buffers/test_bound.py",
            "tests/unit/buffers/test_staged.py",  # check_row is the staged writes' value rule
            "tests/unit/buffers/test_staged_hostile.py",
        ],
    ),
    "refresh.commit": (
        "graphbuf/buffers/commit.py",
        [
            "tests/unit/buffers/test_refresh.py",
            "tests/unit/buffers/test_commit.py",
            "tests/unit/buffers/test_commit_pins.py",
            "tests/unit/buffers/test_staged.py",
            "tests/unit/buffers/test_slab.py",
        ],
    ),
    "refresh.backend": (
        "graphbuf/buffers/backend.py",
        [
            "tests/unit/buffers/test_backend.py",
            "tests/unit/buffers/test_native.py",
            "tests/unit/buffers/test_refresh.py",
            "tests/unit/buffers/test_commit.py",
            "tests/unit/buffers/test_packed_upload.py",
        ],
    ),
    "refresh.bound": (
        "graphbuf/buffers/bound.py",
        [
            "tests/unit/buffers/test_bound.py",
            "tests/unit/buffers/test_bound_pins.py",
            "tests/unit/buffers/test_bound_messages_pins.py",
            "tests/unit/buffers/test_atomic_errors.py",
        ],
    ),
    "refresh.layout": (
        "graphbuf/buffers/layout.py",
        [
            "tests/unit/buffers/test_layout.py",
            "tests/unit/buffers/test_refresh.py",
            "tests/unit/buffers/test_bound_pins.py",
        ],
    ),
    "refresh.mapping": (
        "graphbuf/buffers/mapping.py",
        [
            "tests/unit/buffers/test_mapping.py",
            "tests/unit/buffers/test_refresh.py",
            "tests/unit/buffers/test_bound_pins.py",
        ],
    ),
    "refresh.eager": (
        "graphbuf/buffers/eager.py",
        [
            "tests/unit/buffers/test_eager.py",
            "tests/unit/buffers/test_refresh.py",
            "tests/unit/buffers/test_bound_pins.py",
        ],
    ),
    "graphs.watch": (
        "graphbuf/graphs/watch.py",
        [
            "tests/unit/graphs/test_watch.py",
            "tests/unit/graphs/test_graph_fidelity.py",
            "tests/unit/graphs/test_runner.py",
            "tests/unit/graphs/test_runner_pins.py",
        ],
    ),
    "graphs.runner": (
        "graphbuf/graphs/runner.py",
        ["tests/unit/graphs/test_runner.py", "tests/unit/graphs/test_runner_pins.py"],
    ),
    "spec": (
        "graphbuf/spec/models.py",
        [
            "tests/unit/spec/test_models.py",
            "tests/unit/spec/test_models_hostile.py",
            "tests/unit/spec/test_models_edges.py",
            "tests/unit/spec/test_models_pins.py",
            "tests/unit/spec/test_models_growth_pins.py",
            "tests/unit/spec/test_constants.py",
        ],
    ),
    "expr": (
        "graphbuf/spec/expr.py",
        ["tests/unit/spec/test_expr.py", "tests/unit/spec/test_models_pins.py"],
    ),
    "planner": (
        "graphbuf/planning/planner.py",
        [
            "tests/unit/planning/test_planner.py",
            "tests/unit/adapters/spec/test_costs.py",
            "tests/unit/planning/test_planner_pins.py",
        ],
    ),
}

#: Functions that run only with a cuda/npu device (their mutants cannot be killed on a cpu-only machine):
#: module -> regular expression over mutmut's mutant names. (Uploads run on the cpu too: ``upload_copies=2``.
#: validate.py's device branches sit inside functions the cpu runs too, so they are scored, not set apart.)
DEVICE_ONLY: dict[str, str] = {
    "refresh.commit": r"place_device_source__mutmut",
    "graphs.runner": r"ǁGraphRunnerǁ_warm__mutmut",
}

EQUIVALENT = ROOT / "tests" / "mutation" / "EQUIVALENT.md"
COPIED = ("graphbuf", "tests", "specs", "adapters", "pyproject.toml", "setup.py", "constraints.txt")


def equivalent_names() -> dict[str, str]:
    """Mutant name -> reason, from the table rows of EQUIVALENT.md (``| `name` | reason |``)."""
    out = {}
    for line in EQUIVALENT.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*`([^`]+__mutmut_\d+)`\s*\|\s*(.+?)\s*\|$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def prepare(module: str) -> Path:
    """A scratch copy of the repository with a ``setup.cfg`` mutating ``module`` only."""
    path, tests = MODULES[module]
    work = WORK / module
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "real_vllm_ascend", "mutants")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, work / name, ignore=ignore)
        else:
            shutil.copy2(src, work / name)
    selection = "\n    ".join(["-p", "no:cacheprovider", *tests])
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = graphbuf/\n"
        "also_copy =\n    specs/\n"  # the spec tests read the shipped specs and schema beside graphbuf/
        f"only_mutate = {path}\n"
        f"pytest_add_cli_args_test_selection =\n    {selection}\n"
        "pytest_add_cli_args =\n    -x\n    -q\n",
        encoding="utf-8",
    )
    return work


def mutmut(
    work: Path, names: list[str], env: dict[str, str], max_children: int, *, check: bool = True
) -> None:
    cmd = [sys.executable, "-m", "mutmut", "run", f"--max-children={max_children}", *names]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if check and done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise SystemExit(f"mutmut run failed in {work} (exit {done.returncode}); its last lines:\n{tail}")


def results(work: Path, path: str) -> dict[str, str]:
    """Mutant name -> status (mutmut's own words: killed, survived, no tests, timeout, ...)."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((work / "mutants" / (path + ".meta")).read_text(encoding="utf-8"))
    return {name: status_by_exit_code[code] for name, code in meta["exit_code_by_key"].items()}


def measure(module: str, sample: int | None, seed: int, env: dict[str, str], max_children: int) -> dict:
    path, tests = MODULES[module]
    t0 = time.perf_counter()
    work = prepare(module)
    # Generate every mutant and collect the tests' stats; the name matches none (mutmut then exits 1).
    mutmut(work, ["__graphbuf_generate_only__"], env, max_children, check=False)
    if not (work / "mutants" / (path + ".meta")).is_file():
        raise SystemExit(f"mutation: mutmut generated no mutants for {path} (run it in {work} to see why)")
    every = sorted(results(work, path))
    device_re = re.compile(DEVICE_ONLY[module]) if module in DEVICE_ONLY else None
    equivalent = equivalent_names()
    device = [n for n in every if device_re is not None and device_re.search(n)]
    eligible = [n for n in every if n not in device]
    chosen = eligible
    if sample and sample < len(eligible):
        chosen = sorted(random.Random(seed).sample(eligible, sample))
    if chosen:
        mutmut(work, chosen, env, max_children)
    status = results(work, path)
    got = {n: status[n] for n in chosen}
    excluded = [n for n in chosen if n in equivalent]
    scored = [n for n in chosen if n not in equivalent]
    killed = [n for n in scored if got[n] in ("killed", "timeout", "segfault", "caught by type check")]
    survivors = [n for n in scored if n not in killed]
    return {
        "module": module,
        "file": path,
        "tests": tests,
        "generated": len(every),
        "device_only": len(device),
        "run": len(chosen),
        "equivalent": excluded,
        "scored": len(scored),
        "killed": len(killed),
        "score": round(100 * len(killed) / len(scored), 1) if scored else None,
        "survivors": {n: got[n] for n in survivors},
        "seconds": round(time.perf_counter() - t0, 1),
        "work": str(work),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", choices=sorted(MODULES), help="repeatable; default: all")
    ap.add_argument("--sample", type=int, default=None, help="mutants per module (default: every mutant)")
    ap.add_argument("--seed", type=int, default=24, help="the sample's seed (default 24)")
    ap.add_argument("--kernel", action="store_true", help="keep the native kernel (default: numpy path)")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--survivors", action="store_true", help="print each survivor's diff (mutmut show)")
    ap.add_argument("--report", type=Path, default=WORK / "report.json", help="where the JSON report goes")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    if not args.kernel:
        env["GRAPHBUF_NATIVE"] = "0"
    reports = []
    for module in args.module or sorted(MODULES):
        r = measure(module, args.sample, args.seed, env, args.max_children)
        reports.append(r)
        print(
            f"{module:18} {r['score']}% killed ({r['killed']}/{r['scored']}; {r['run']} run of "
            f"{r['generated']}, {len(r['equivalent'])} equivalent, {r['device_only']} device-only left out) "
            f"in {r['seconds']} s",
            flush=True,
        )
        for name, why in r["survivors"].items():
            print(f"    {why}: {name}")
            if args.survivors:
                subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=r["work"], check=False)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(reports, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``graphbuf`` command: ``plan``, ``check``, ``schema``, ``sizes`` and ``drill``.

Exit codes for every command: 0 ok, 1 failure (``check --strict``: a reachable batch runs eagerly), 2 usage or
spec error. ``check``, ``plan``, ``schema`` and ``sizes`` never import torch; ``drill`` checks its arguments
(ranges, files, the device torch was built for) before it imports torch. ``--json`` prints strict JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphbuf.errors import DeviceUnavailableError, GraphbufError, SpecError, UsageError
from graphbuf.planning.coverage import Coverage, spec_coverage
from graphbuf.planning.planner import Plan, WorkspacePlan, plan
from graphbuf.spec.factories import RouteCost
from graphbuf.spec.models import MAX_CAPTURE_SIZES, GraphSpec, load_spec, resolve_spec_path

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DESCRIPTION = "Graph capture/replay buffers as a declaration: plan, check, schema, sizes and drill a spec."
SEED_MAX = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors exit 2 too, with our prefix
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"graphbuf: usage error: {message}\n")


def _overrides(pairs: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SpecError(f"--set {pair!r}: expected NAME=VALUE with an integer VALUE")
        text = value.strip()
        if not re.fullmatch(r"-?[0-9]{1,19}", text):
            raise SpecError(f"--set {pair[:80]!r}: {value[:40]!r} is not an integer (at most 19 digits)")
        out[name.strip()] = int(text)
    return out


def _spec_file(args: argparse.Namespace) -> None:
    """A usage error unless SPEC names a spec file or a shipped spec (checked before the spec is read)."""
    try:
        resolve_spec_path(args.spec)
    except SpecError as exc:
        raise UsageError(str(exc)) from None


def _ranges(values: Sequence[int]) -> str:
    """``1, 2, 3, 5, 9, 10`` as ``1..3, 5, 9..10``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _dumps(data: Any) -> str:
    """Strict JSON (no NaN or Infinity tokens)."""
    return json.dumps(data, indent=2, allow_nan=False)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _bounds(p: Plan, name: str) -> str:
    b = p[name]
    spec = p.spec.buffers[b.spec_name]
    parts = []
    for which, value in (("min", b.min), ("max", b.max)):
        text = getattr(spec, which)
        if text is None:
            continue
        parts.append(f"{which} {value}" if value is not None else f"{which} {text} (unset)")
    return ", ".join(parts) or "-"


def render_plan(p: Plan, context: int | None = None) -> str:
    """The human-readable plan: buffers and totals, captured rows, workspaces and task routes per capture
    size (routes at ``context`` tokens per request; None: the worst case)."""
    lines = [
        f"{p.spec.name}: {len(p.buffers)} buffers, {p.total_bytes} bytes ({_human(p.total_bytes)}) "
        "in one slab "
        f"(limit {_human(p.max_bytes)}); {len(p.capture_sizes)} capture sizes, "
        f"{p.tokens_per_request} token{'s' if p.tokens_per_request != 1 else ''} per request",
        "",
        _table(
            ("buffer", "dtype", "shape", "bytes", "offset", "pad", "bounds"),
            [
                (
                    b.name,
                    b.dtype_name,
                    list(b.shape),
                    b.nbytes,
                    b.offset,
                    b.pad,
                    _bounds(p, b.name),
                )
                for b in p.buffers
            ],
        ),
        "",
        "captured rows per capture size:",
        _table(
            ("size", "requests", *p.names),
            [
                (s, s // p.tokens_per_request, *(p.shape_at(b, s)[0] for b in p.buffers))
                for s in p.capture_sizes
            ],
        ),
    ]
    if p.workspaces:
        lines += [
            "",
            "task workspaces per capture size (materialized by the task, not allocated by graphbuf; "
            "(not selected): a route the task's options do not select):",
            _table(
                ("size", *(_workspace_header(p, w) for w in p.workspaces)),
                [(s, *(_human(p.workspace_bytes(w, s)) for w in p.workspaces)) for s in p.capture_sizes],
            ),
        ]
    routes = {s: p.route_costs(s, context) for s in p.capture_sizes}
    if any(routes.values()):
        where = "the worst case" if context is None else f"{context} tokens of context per request"
        lines += [
            "",
            f"task routes per capture size, per step at {where} (KV read: all layers; workspace: peak per "
            "call; * = selected by the task's options):",
            _table(
                ("size", "task", "route", "mode", "context", "layers", "kv read", "workspace"),
                [_route_row(s, name, c) for s in p.capture_sizes for name, c in routes[s]],
            ),
        ]
    totals = p.memory_totals()
    lines += [
        "",
        "memory per capture size (buffer rows the graph reads; host staging copies of the slab a refresh "
        "uploads from; task workspaces of the selected routes):",
        _table(
            ("size", "requests", "buffers", "staging", "workspaces"),
            [
                (
                    m.tokens,
                    m.requests,
                    _human(m.buffer_bytes),
                    _human(m.staging_bytes),
                    _human(m.workspace_bytes),
                )
                for m in map(p.memory_at, p.capture_sizes)
            ],
        ),
        f"totals: device slab {_human(totals['slab_bytes'])} (one, shared by every size); host staging "
        f"{_human(totals['staging_bytes'])}; task workspaces {_human(totals['workspace_peak_bytes'])} peak "
        f"(graphs sharing one memory pool), {_human(totals['workspace_sum_bytes'])} summed over sizes",
    ]
    unselected = [w.name for w in p.workspaces if not p.workspace_selected(w)]
    if unselected:
        lines.append(
            f"not counted (routes the task options do not select): {', '.join(unselected)}, "
            f"{_human(totals['unselected_workspace_peak_bytes'])} peak"
        )
    return "\n".join(lines)


def _workspace_header(p: Plan, w: WorkspacePlan) -> str:
    return w.name if p.workspace_selected(w) else f"{w.name} (not selected)"


def _route_row(size: int, task: str, c: RouteCost) -> tuple[object, ...]:
    mode = c.mode + ("*" if c.selected else "")
    read, workspace = _human(c.kv_read_bytes), _human(c.workspace_bytes)
    return (size, task, c.route, mode, c.context, c.layers, read, workspace)


def render_coverage(cov: Coverage) -> str:
    """The coverage table: each reachable batch, the capture size it replays at and its padding waste."""
    return "\n".join([cov.summary(), _table(("requests", "tokens", "capture size", "waste"), cov.table())])


def _cmd_plan(args: argparse.Namespace) -> int:
    _spec_file(args)
    p = plan(args.spec, overrides=_overrides(args.set), allow_factories=args.allow_factory)
    print(_dumps(p.to_dict(args.context)) if args.json else render_plan(p, args.context))
    return EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    if _vllm_config_given(args):
        return _cmd_check_vllm(args)
    if args.spec is None:
        raise UsageError("check: give a spec, or a vLLM configuration (--max-num-seqs, --compilation-config)")
    overrides = _overrides(args.set)
    _spec_file(args)
    # from the path, so a too-large plan names the file
    p = plan(args.spec, overrides=overrides, allow_factories=args.allow_factory)
    cov = spec_coverage(p.spec, p.constants)
    strict_fail = args.strict and not cov.ok
    if args.json:
        print(
            _dumps(
                {
                    "spec": args.spec,
                    "name": p.spec.name,
                    "ok": not strict_fail,
                    "buffers": len(p.buffers),
                    "total_bytes": p.total_bytes,
                    "capture_sizes": list(p.capture_sizes),
                    "coverage": cov.to_dict(),
                }
            )
        )
    else:
        print(
            f"{args.spec}: ok: {p.spec.name}, {len(p.buffers)} buffers, {p.total_bytes} bytes, capture sizes "
            f"{p.capture_sizes[0]}..{p.capture_sizes[-1]} ({len(p.capture_sizes)})"
        )
        print(render_coverage(cov) if args.coverage else cov.summary())
    if strict_fail:
        print(f"graphbuf: check --strict: {args.spec}: {_strict_advice(args, cov)}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _strict_advice(args: argparse.Namespace, cov: Coverage) -> str:
    """Why ``check --strict`` failed and what to run next (a command that accepts this spec)."""
    if cov.max_requests is None:
        return (
            "no serving envelope declared (capture.max_requests); add it to the spec (e.g. `max_requests: "
            f"max_num_seqs` under capture:), then `graphbuf sizes {args.spec}` proposes sizes that cover it"
        )
    sets = "".join(f" --set {pair}" for pair in args.set)
    allow = "".join(f" --allow-factory {m}" for m in args.allow_factory)
    eager = _ranges([b.requests for b in cov.uncovered])
    command = f"graphbuf sizes {args.spec}{sets}{allow}"
    return f"requests {eager} run eagerly; `{command}` proposes capture sizes that cover them"


_VLLM_FLAGS = ("max_num_seqs", "num_speculative_tokens", "capture_sizes", "compilation_config",
               "max_num_batched_tokens", "data_parallel_size")  # fmt: skip


def _vllm_config_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in _VLLM_FLAGS)


def _cmd_check_vllm(args: argparse.Namespace) -> int:
    """``check`` for a vLLM configuration: the coverage certificate of its uniform decode batches."""
    from graphbuf.planning.vllm_coverage import VllmServing, certify, serving_from_compilation_config

    if args.spec is not None:
        raise UsageError(f"check: give a spec ({args.spec}) or a vLLM configuration, not both")
    if args.max_num_seqs is None:
        raise UsageError("check: a vLLM configuration needs --max-num-seqs (the scheduler's max_num_seqs)")
    if args.capture_sizes is not None and args.compilation_config is not None:
        raise UsageError(
            "check: --capture-sizes and --compilation-config both set the capture sizes; give one"
        )
    fields = {
        "max_num_seqs": args.max_num_seqs,
        "num_speculative_tokens": args.num_speculative_tokens or 0,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "data_parallel_size": args.data_parallel_size or 1,
        "platform": args.platform,
    }
    if args.compilation_config is not None:
        serving = serving_from_compilation_config(args.compilation_config, **fields)
    else:
        serving = VllmServing(capture_sizes=args.capture_sizes, **fields)
    cert = certify(serving)
    strict_fail = args.strict and not cert.ok
    print(_dumps({**cert.to_dict(), "ok": not strict_fail}) if args.json else cert.render())
    if strict_fail:
        advice = cert.warning().removeprefix("graphbuf: ")  # the warning the plugin logs carries the prefix
        print(f"graphbuf: check --strict: {advice}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _size_list(text: str) -> tuple[int, ...]:
    """``--capture-sizes 4,8,16`` (commas or spaces) as a tuple of ints."""
    parts = [t for t in re.split(r"[,\s]+", text.strip().strip("[]")) if t]
    if not parts or not all(re.fullmatch(r"[0-9]{1,9}", t) for t in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas")
    return tuple(int(t) for t in parts)


def _cmd_schema(args: argparse.Namespace) -> int:
    print(_dumps(GraphSpec.model_json_schema()))
    return EXIT_OK


def _cmd_sizes(args: argparse.Namespace) -> int:
    from graphbuf.planning.sizes import propose_sizes, render_proposal, write_sizes

    _check_sizes_args(args)
    overrides = _overrides(args.set)
    _spec_file(args)
    if args.write and not Path(args.spec).is_file():
        raise UsageError(f"{args.spec}: --write edits a spec file; give its path (copy a shipped spec first)")
    spec = load_spec(args.spec, allow_factories=args.allow_factory)
    constants = spec.constants_with(overrides, args.spec)
    cov = spec_coverage(spec, constants)
    if cov.max_requests is None:
        raise SpecError(
            f"{args.spec}: capture.max_requests: not declared; `sizes` covers the serving envelope it names "
            "(e.g. max_requests: max_num_seqs)"
        )
    proposal = propose_sizes(
        cov.tokens_per_request,
        cov.max_requests,
        max_waste_pct=args.max_waste,
        max_graphs=args.max_graphs,
        max_tokens=constants.get("max_num_batched_tokens"),
        force=args.force,
    )
    print(render_proposal(proposal))
    if args.write:
        path = resolve_spec_path(args.spec)
        write_sizes(path, proposal.sizes, args.spec, allow_factories=args.allow_factory)
        print(f"wrote {path}")
    return EXIT_OK


def _check_sizes_args(args: argparse.Namespace) -> None:
    if args.max_waste is not None and not (math.isfinite(args.max_waste) and 0 <= args.max_waste < 100):
        raise UsageError(f"--max-waste {args.max_waste:g}: must be a percentage in [0, 100)")
    if args.max_graphs is not None and not 1 <= args.max_graphs <= MAX_CAPTURE_SIZES:
        raise UsageError(f"--max-graphs {args.max_graphs}: must be in 1..{MAX_CAPTURE_SIZES}")
    if args.force and args.max_graphs is None:
        raise UsageError("--force accepts the waste --max-graphs N needs; give --max-graphs N with it")


def _check_drill_args(args: argparse.Namespace) -> None:
    """Every ``drill`` argument checked before torch is imported (a usage error names the first bad one)."""
    from graphbuf.drill.progress import default_replays  # imports no torch

    modes = [flag for flag, on in (("--model", args.model is not None), ("--padding-contract",
             args.padding_contract)) if on]  # fmt: skip
    unused = {
        "--replays": args.replays is not None and bool(modes),
        "--staged": args.staged and bool(modes),
        "--replay": args.replay is not None and args.padding_contract,
        "--save": args.save is not None and args.padding_contract,
        "--set": bool(args.set) and args.model is not None,
        "--allow-factory": bool(args.allow_factory) and args.model is not None,
    }
    if len(modes) > 1:
        raise UsageError("--model and --padding-contract are two drills; give one")
    for flag, ignored in unused.items():
        if ignored:
            raise UsageError(f"{flag} does not apply to drill {modes[0]}")
    args.replays = default_replays() if args.replays is None else args.replays
    if args.replays < 0:
        raise UsageError(f"--replays {args.replays}: must be ≥ 0")
    if not 0 <= args.seed <= SEED_MAX:
        raise UsageError(f"--seed {args.seed}: must be an integer in [0, 2**63 - 1]")
    if args.save is not None and not Path(args.save).resolve().parent.is_dir():
        raise UsageError(f"--save {args.save}: no such directory to write the failing batch into")
    if args.replay is not None and not Path(args.replay).is_file():
        raise UsageError(f"--replay {args.replay}: no such file")
    missing = _device_missing(args.device)
    if missing is not None:
        raise UsageError(f"--device {args.device}: {missing}")


def _device_missing(device: str) -> str | None:
    """Why this installation cannot run on ``device``, read from the installed files without importing
    torch (None: it may; torch's own check follows once it is imported)."""
    if device == "npu" and "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (an Ascend NPU and torch-npu are needed; README: NPU install)"
    if device != "cuda" or "torch" in sys.modules:
        return None
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return None  # no torch at all: the import reports the missing dependency
    version = Path(next(iter(found.submodule_search_locations))) / "version.py"
    try:
        text = version.read_text(encoding="utf-8")
    except OSError:
        return None
    if re.search(r"^cuda\b[^=\n]*=\s*None\s*$", text, flags=re.M):
        build = re.search(r"^__version__\b[^=\n]*=\s*'([^']*)'", text, flags=re.M)
        return f"this torch ({build.group(1) if build else '?'}) is a CPU build, without CUDA"
    return None


def _cmd_drill(args: argparse.Namespace) -> int:
    overrides = _overrides(args.set)
    _check_drill_args(args)
    _spec_file(args)
    from graphbuf.drill.allocator import keep_freed_memory

    keep_freed_memory()  # a drill is a process of its own: its attention temporaries reuse heap memory
    if args.model is not None:  # the whole-model drill (graphbuf/drill/model, needs the `model` extra)
        from graphbuf.drill.model import run_model_drill_cli
        from graphbuf.drill.progress import Progress

        # Its loop may report steps through args.progress; until it does, the elapsed time every 5 s.
        args.progress = Progress()
        args.progress("whole-model drill", 0, 1)
        try:
            return run_model_drill_cli(args, overrides)
        finally:
            args.progress.close()
    if args.padding_contract:
        from graphbuf.drill.padding_contract import run_padding_contract_cli

        return run_padding_contract_cli(args, overrides)
    started = time.perf_counter()
    from graphbuf.drill.session import run_drill_cli  # torch, Hypothesis: the drill's "import" phase

    return run_drill_cli(args, overrides, import_seconds=time.perf_counter() - started)


def _vllm_check_args(p: argparse.ArgumentParser) -> None:
    """``check``'s vLLM configuration flags (instead of a spec): its decode coverage certificate."""
    g = p.add_argument_group(
        "a vLLM configuration instead of a spec (prints its decode coverage certificate)"
    )
    g.add_argument("--max-num-seqs", type=_positive_int, metavar="N", help="the scheduler's max_num_seqs")
    g.add_argument(
        "--num-speculative-tokens",
        type=_non_negative_int,
        metavar="K",
        help="speculative tokens per step (0)",
    )
    g.add_argument(
        "--capture-sizes", type=_size_list, metavar="S,...", help="cudagraph_capture_sizes (default: vLLM's)"
    )
    g.add_argument(
        "--compilation-config", metavar="JSON", help="vLLM's CompilationConfig as JSON (its capture sizes)"
    )
    g.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N", help="(default: no cap)")
    g.add_argument("--data-parallel-size", type=_positive_int, metavar="N", help="DP ranks (1)")
    g.add_argument(
        "--platform", choices=("ascend", "vllm"), default="ascend",
        help="whose default max_cudagraph_capture_size applies: vllm-ascend's (default) or vLLM's",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphbuf", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def spec_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
        p.add_argument(
            "spec",
            nargs="?" if optional else None,
            help="spec file or shipped spec name (e.g. gemma4-31b-it-mtp)",
        )
        p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a constant")
        p.add_argument(
            "--allow-factory",
            action="append",
            default=[],
            metavar="MODULE",
            help="allow the spec's task factories from MODULE (and its submodules) though no graphbuf.tasks "
            "entry point registers them; MODULE is imported",
        )

    p = sub.add_parser("plan", help="print the memory plan of a spec")
    spec_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--context",
        type=_non_negative_int,
        default=None,
        metavar="TOKENS",
        help="live KV tokens per request the task routes' figures assume (default: each route's worst case)",
    )
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("check", help="validate a spec; print a summary and its coverage, or the errors")
    spec_args(p, optional=True)
    _vllm_check_args(p)
    p.add_argument("--coverage", action="store_true", help="print every reachable batch and where it runs")
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when a batch of the serving envelope runs eagerly"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("schema", help="print the spec's JSON Schema")
    p.set_defaults(func=_cmd_schema)

    p = sub.add_parser("sizes", help="propose the fewest capture sizes covering the serving envelope")
    spec_args(p)
    p.add_argument(
        "--max-waste", type=float, default=None, metavar="PCT", help="largest padding waste, percent (10)"
    )
    p.add_argument("--max-graphs", type=int, default=None, metavar="N", help="at most N capture sizes")
    p.add_argument(
        "--force", action="store_true", help="with --max-graphs: accept more waste than --max-waste allows"
    )
    p.add_argument("--write", action="store_true", help="edit the spec's capture.sizes in place")
    p.set_defaults(func=_cmd_sizes)

    p = sub.add_parser("drill", help="capture every size, replay randomized batches, compare with eager")
    spec_args(p)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    p.add_argument(
        "--replays", type=int, default=None,
        help="batches drawn and replayed (default: $GRAPHBUF_DRILL_REPLAYS, else 60)",
    )  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the drawn batches, 0..2**63-1 (reproducible runs)"
    )
    p.add_argument(
        "--save", metavar="FILE", help="on a mismatch, write the shrunk failing batch here (JSON; default: "
        "a temporary file)",
    )  # fmt: skip
    p.add_argument(
        "--replay", metavar="FILE", help="replay only the batch saved in FILE (with its seed and constants)"
    )
    p.add_argument(
        "--padding-contract", action="store_true",
        help="per buffer: do the tasks depend on its pad (required) or not (free)?",
    )  # fmt: skip
    p.add_argument(
        "--staged", action="store_true",
        help="replays commit staged writes (StaticBuffers.stage: changed cells only), not whole sources",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--model", choices=("tiny",), help="serve a whole model (MTP), compare with transformers")
    p.set_defaults(func=_cmd_drill)
    return parser


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _missing_dependency(exc: ImportError) -> UsageError | None:
    """A usage error naming the dependency ``exc`` (or the error it was raised from) says is missing (None:
    not a missing installed package)."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ModuleNotFoundError):
        cause = cause.__cause__
    name = ((cause.name if cause is not None else None) or "").partition(".")[0]
    if not name or name == "graphbuf":
        return None
    hint = install_hint(name)
    return UsageError(f"missing dependency: the module {name!r} is not installed in {sys.prefix}; {hint}")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def install_hint(module: str) -> str:
    """The install command that brings ``module``, from graphbuf's own requirements: the pinned (``-c
    constraints.txt``) editable install from the clone, with the extra that declares it (none for a core
    dependency; the ``npu`` extra pins its own torch and is never combined with the constraints)."""
    found: list[str | None] = []
    for req in importlib.metadata.requires("graphbuf") or []:
        name = re.match(r"[A-Za-z0-9._-]+", req)
        if name is None:
            continue
        dist = _norm(name.group(0))
        if dist == _norm(module) or dist.startswith(_norm(module) + "_") or dist == "py" + _norm(module):
            extra = re.search(r"extra\s*==\s*[\"']([^\"']+)", req)
            found.append(extra.group(1) if extra else None)
    if not found:
        return f"graphbuf does not require it (the code that imported it does): install it into {sys.prefix}"
    extra = None if None in found else found[0]
    pip = Path(sys.executable).parent / "pip"
    shown = os.path.relpath(pip) if not os.path.relpath(pip).startswith("..") else str(pip)
    if extra == "npu":
        return f"from the graphbuf clone: {shown} install -e '.[npu]' (README: NPU install)"
    target = f"'.[{extra}]'" if extra else "."
    return f"from the graphbuf clone: {shown} install -c constraints.txt -e {target}"


def _fail(args: argparse.Namespace, label: str, exc: Exception, code: int) -> int:
    sep = "\n" if label == "spec error" else " "
    print(f"graphbuf: {label}:{sep}{exc}", file=sys.stderr)
    if getattr(args, "json", False) and (code == EXIT_USAGE or args.command != "drill"):
        print(_dumps({"ok": False, "exit": code, "errors": str(exc).splitlines()}))
    return code


def _program() -> str:
    """How this process runs graphbuf, for the commands it prints (a replay command): the console script
    as typed (``.venv/bin/graphbuf``), ``python -m graphbuf``, or ``graphbuf`` when called from Python."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "__main__.py" and Path(argv0).parent.name == "graphbuf":
        return "python -m graphbuf"
    return shlex.quote(argv0) if Path(argv0).name == "graphbuf" else "graphbuf"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code. Labels on stderr: ``spec error`` (the spec is wrong, exit 2),
    ``usage error`` (an argument, a missing file or dependency, an unavailable device; exit 2), ``error``
    (exit 1)."""
    args = build_parser().parse_args(argv)
    args.program = _program()
    try:
        return args.func(args)
    except SpecError as exc:
        return _fail(args, "spec error", exc, EXIT_USAGE)
    except (UsageError, DeviceUnavailableError) as exc:
        return _fail(args, "usage error", exc, EXIT_USAGE)
    except GraphbufError as exc:
        return _fail(args, "error", exc, EXIT_FAIL)
    except ImportError as exc:
        missing = _missing_dependency(exc)
        if missing is None:
            raise
        return _fail(args, "usage error", missing, EXIT_USAGE)
    except BrokenPipeError:  # pragma: no cover - e.g. `graphbuf plan ... | head`
        return EXIT_OK

"""The ``graphbuf`` command: ``plan``, ``check``, ``schema`` and ``drill``.

Exit codes for every command: 0 ok, 1 failure, 2 usage or spec error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from graphbuf.errors import GraphbufError, SpecError
from graphbuf.planner import Plan, plan
from graphbuf.spec import GraphSpec, load_spec

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors exit 2 too, with our prefix
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"graphbuf: error: {message}\n")


def _overrides(pairs: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SpecError(f"--set {pair!r}: expected NAME=VALUE with an integer VALUE")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise SpecError(f"--set {pair!r}: {value!r} is not an integer") from None
    return out


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


def render_plan(p: Plan) -> str:
    """The human-readable plan: buffers and totals, captured rows and workspaces per capture size."""
    lines = [
        f"{p.spec.name}: {len(p.buffers)} buffers, {p.total_bytes} bytes ({_human(p.total_bytes)}) "
        "in one slab "
        f"(limit {_human(p.max_bytes)}); {len(p.capture_sizes)} capture sizes, "
        f"{p.tokens_per_request} tokens per request",
        "",
        _table(
            ("buffer", "dtype", "shape", "bytes", "offset", "pad", "bounds"),
            [
                (
                    b.name,
                    str(b.dtype).removeprefix("torch."),
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
            "task workspaces per capture size (materialized by the task, not allocated by graphbuf):",
            _table(
                ("size", *(w.name for w in p.workspaces)),
                [(s, *(_human(p.workspace_bytes(w, s)) for w in p.workspaces)) for s in p.capture_sizes],
            ),
        ]
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    p = plan(args.spec, overrides=_overrides(args.set))
    print(json.dumps(p.to_dict(), indent=2) if args.json else render_plan(p))
    return EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    overrides = _overrides(args.set)
    spec = load_spec(args.spec, overrides=overrides)
    p = plan(args.spec, overrides=overrides)  # from the path, so a too-large plan names the file
    print(
        f"{args.spec}: ok: {spec.name}, {len(p.buffers)} buffers, {p.total_bytes} bytes, capture sizes "
        f"{p.capture_sizes[0]}..{p.capture_sizes[-1]} ({len(p.capture_sizes)})"
    )
    return EXIT_OK


def _cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(GraphSpec.model_json_schema(), indent=2))
    return EXIT_OK


def _cmd_drill(args: argparse.Namespace) -> int:
    from graphbuf.drill import run_drill_cli

    return run_drill_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphbuf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", help="spec file or shipped spec name (e.g. gemma4-31b-it-mtp)")
        p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a constant")

    p = sub.add_parser("plan", help="print the memory plan of a spec")
    spec_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("check", help="validate a spec; print a one-line summary or the errors")
    spec_args(p)
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("schema", help="print the spec's JSON Schema")
    p.set_defaults(func=_cmd_schema)

    p = sub.add_parser("drill", help="capture every size, replay randomized batches, compare with eager")
    spec_args(p)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    p.add_argument("--replays", type=int, default=60, help="randomized replays (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_drill)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as exc:
        print(f"graphbuf: spec error:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    except GraphbufError as exc:
        print(f"graphbuf: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except BrokenPipeError:  # pragma: no cover - e.g. `graphbuf plan ... | head`
        return EXIT_OK

# ruff: noqa: E501  (the catalogue is a table: one row per line)
"""The bad-input catalogue: one table of rejected inputs (spec files, CLI arguments, refresh sources).

Every row states the error type, a message fragment that names the place (file and field path, argument,
or buffer name) and, where relevant, the CLI exit code. Invariants checked for every row:

- spec rows: the YAML file written to disk is rejected by ``graphbuf.plan(path)`` with exactly that error
  type, the message names the file and the fragment; ``graphbuf check FILE`` exits 2 with both on stderr;
- CLI rows: ``graphbuf.cli.main(argv)`` in-process exits with the code (argparse usage errors raise
  ``SystemExit(2)``; both are handled) and stderr holds the fragment; no other exception escapes;
- refresh rows: ``StaticBuffers.refresh`` raises exactly that error type naming the buffer, and not one
  byte of the slab changes (the slab holds a previous valid batch, so a stray write shows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
import yaml

import graphbuf
from graphbuf.cli import main as cli_main
from graphbuf.errors import (
    DeviceUnavailableError,
    GraphbufError,
    PlanTooLargeError,
    RefreshError,
    RowsError,
    SpecError,
    UsageError,
    WidthError,
)

Kind = Literal["spec", "cli", "refresh"]
Change = str | bytes | Mapping[str, Any] | Callable[[dict[str, Any]], None]


@dataclass(frozen=True, eq=False)
class Bad:
    """One rejected input and what its rejection must say.

    ``change``: spec rows: raw YAML text, ``{"dotted.path": value}`` edits of the small valid spec
    (conftest ``SMALL_SPEC``), or a function editing it; refresh rows: replacements for a valid 2-request
    batch. ``argv``: CLI arguments; ``{spec}`` is a valid spec file, ``{dir}`` the temporary directory.
    ``error``: the exact exception type (CLI rows: what main() reports; SystemExit: an argparse usage error).
    """

    id: str
    kind: Kind
    error: type[BaseException]
    fragment: str
    exit_code: int | None = None
    change: Change | None = None
    argv: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    size: int = 4
    strict: bool = False
    num_reqs: int | None = None
    skip: str | None = None


def S(id: str, fragment: str, change: Change, error: type[SpecError] = SpecError) -> Bad:
    """A spec row: ``plan(file)`` raises ``error``; ``graphbuf check file`` exits 2."""
    return Bad(id, "spec", error, fragment, 2, change)


def C(
    id: str, error: type[BaseException], fragment: str, code: int, argv: str, skip: str | None = None
) -> Bad:
    """A CLI row: ``main(argv.split())`` exits ``code`` with ``fragment`` on stderr."""
    return Bad(id, "cli", error, fragment, code, argv=tuple(argv.split()), skip=skip)


def R(id: str, error: type[RefreshError], fragment: str, change: Mapping[str, Any], **kw: Any) -> Bad:
    """A refresh row: ``refresh(size, {**valid_batch, **change} - drop)`` raises ``error``."""
    return Bad(id, "refresh", error, fragment, change=change, **kw)


def _rename_seq_lens(spec: dict[str, Any]) -> None:
    spec["buffers"]["seq.lens"] = spec["buffers"].pop("seq_lens")


def good_batch(requests: int = 2) -> dict[str, np.ndarray]:
    """A valid batch of ``requests`` requests for the small spec (tokens_per_request 2)."""
    n = requests
    return {
        "block_table.a": (np.arange(n * 3, dtype=np.int32) % 32).reshape(n, 3),
        "block_table.b": np.full((n, 2), 7, dtype=np.int32),
        "seq_lens": np.arange(3, 3 + n, dtype=np.int32),
        "query_start_loc": np.arange(n + 1, dtype=np.int32) * 2,
        "slot_mapping": np.arange(2 * n, dtype=np.int64) + 5,
    }


_CUDA = "a CUDA device is present: --device cuda is valid here" if torch.cuda.is_available() else None
_NPU = "torch_npu is importable: --device npu may be valid here" if find_spec("torch_npu") else None
_DEEP = 5000
_I32, _I64 = np.int32, np.int64
_SL, _BT = "buffers.seq_lens", "block_table"

CASES: list[Bad] = [
    # ---------------------------------------------------------------------------------- spec: YAML syntax
    S("yaml-unclosed-flow-list", "line 3, column 1: invalid YAML", "version: 1\ngroups: [a, b\n"),
    S("yaml-bad-indent", "line 3, column 6: invalid YAML", "version: 1\nname: x\n  bad: 1\n"),
    S("yaml-duplicate-key", "line 2, column 1: invalid YAML: duplicate key 'version'", "version: 1\nversion: 1\n"),
    S("yaml-top-level-list", "(top level): expected a mapping of spec fields, got list", "- 1\n- 2\n"),
    S("yaml-empty-file", "(top level): expected a mapping of spec fields, got NoneType", ""),
    S("yaml-python-tag", "line 2, column 7: invalid YAML", "version: 1\nname: !!python/name:os.system\n"),
    # Nesting past the YAML composer's recursion limit: a SpecError, not a RecursionError.
    S("yaml-nested-too-deep", "YAML", "version: 1\nmeta: " + "[" * _DEEP + "]" * _DEEP + "\n"),
    # Bytes that are not UTF-8: a SpecError naming the file, not a UnicodeDecodeError.
    S("yaml-not-utf8", "UTF-8", b"version: 1\nname: \xff\xfe\n"),
    # ---------------------------------------------------------------------------------- spec: wrong types
    S("dtype-unknown", f"{_SL}.dtype: got 'int33'; allowed: one of 'bool'", {f"{_SL}.dtype": "int33"}),
    S("version-2", "version: got 2; allowed: 1", {"version": 2}),
    S("sizes-a-string", "capture.sizes: got 'many'; allowed: a mapping with keys start, stop, step or a list", {"capture.sizes": "many"}),
    S("per-group-not-bool", f"{_SL}.per_group: Input should be a valid boolean", {f"{_SL}.per_group": "maybe"}),
    S("overflow-unknown-policy", f"{_SL}.overflow: got 'wrap'; allowed: one of 'reject', 'truncate'", {f"{_SL}.overflow": "wrap"}),
    S("constant-a-list", "constants.block_size: got [16]; allowed: an integer within ±(2**63 - 1), an expression", {"constants.block_size": [16]}),
    # A YAML boolean is not an integer: `true` must not be read as 1.
    S("constant-a-bool", "constants.max_model_len", {"constants.max_model_len": True}),
    # ---------------------------------------------------------------------------------- spec: unknown keys
    S("unknown-top-level-key", "bufers: unknown key; allowed: version, name", {"bufers": {}}),
    S("unknown-buffer-key", f"{_SL}.colums: unknown key; allowed: dtype, rows", {f"{_SL}.colums": 3}),
    S("unknown-range-key", "capture.sizes.stpe: unknown key", {"capture.sizes": {"start": 2, "stop": 8, "stpe": 2}}),
    # ---------------------------------------------------------------------------------- spec: expressions
    S("cdiv-one-argument", "constants.max_blocks: cdiv()", {"constants.max_blocks": "cdiv(max_model_len)"}),
    S("unknown-name", f"{_SL}.rows: unknown name(s) undefined_const", {f"{_SL}.rows": "requests * undefined_const"}),
    S("python-call", f"{_SL}.cols: unexpected character", {f"{_SL}.cols": "__import__('os')"}),
    S("power-operator", f"{_SL}.rows: unexpected '*' at position 14", {f"{_SL}.rows": "requests * 10**3"}),
    S("constant-divides-by-zero", "constants.max_blocks: division by zero", {"constants.max_blocks": "max_model_len // 0"}),
    S("capture-variable-in-bound", f"{_SL}.max: unknown name(s) tokens", {f"{_SL}.max": "tokens"}),
    # Nesting past the expression parser's recursion limit: a SpecError, not a RecursionError.
    S("expression-nested-too-deep", f"{_SL}.rows", {f"{_SL}.rows": "(" * 2000 + "requests" + ")" * 2000}),
    # ---------------------------------------------------------------------------------- spec: impossible sizes
    S("rows-not-positive", f"{_SL}.rows: 'requests - 4' evaluates to", {f"{_SL}.rows": "requests - 4"}),
    S("size-not-multiple", "capture.sizes[1]: size 3 is not a multiple", {"capture.sizes": [2, 3]}),
    S("size-above-batched-tokens", "capture.sizes[1]: size 16 exceeds", {"capture.sizes": [2, 16]}),
    S("size-duplicated", "capture.sizes[1]: size 2 is duplicated", {"capture.sizes": [2, 2]}),
    S("range-step-zero", "capture.sizes.step: must be ≥ 1", {"capture.sizes": {"start": 2, "stop": 8, "step": 0}}),
    # 5·10^11 sizes: rejected by arithmetic on the range, not by expanding it (MemoryError).
    S("range-astronomical", "capture.sizes", {"capture.sizes": {"start": 2, "stop": 10**12, "step": 2}}),
    S("tokens-per-request-zero", "capture.tokens_per_request: must be ≥ 1", {"capture.tokens_per_request": 0}),
    S("pad-overflows-dtype", f"{_SL}.pad: 300 is not representable in int8", {f"{_SL}.dtype": "int8", f"{_SL}.pad": 300}),
    # Padded rows would break the buffer's own bounds (today: every padding refresh fails, naming no buffer).
    S("pad-outside-bounds", f"{_SL}.pad: pad -1 is below the buffer's min 0", {f"{_SL}.pad": -1}),
    S("min-above-max", f"{_SL}.max: max 1 is below min 5", {f"{_SL}.min": 5, f"{_SL}.max": 1}),
    S("duplicate-group", "groups[1]: duplicate group 'a'", {"groups": ["a", "a"]}),
    S("dotted-buffer-name", "buffer names must be identifiers", _rename_seq_lens),
    S("task-factory-without-colon", "tasks[0].factory: expected", {"tasks": [{"name": "t", "factory": "pkg.fn"}]}),
    # ---------------------------------------------------------------------------------- spec: hostile (issue 12)
    S("constant-cycle", "constants.a: dependency cycle: a -> b -> a", {"constants.a": "b", "constants.b": "a"}),
    S("expr-too-deep", "nested deeper than 64 levels", {"constants.deep": "+".join(["1"] * 100)}),
    S("expr-overflow", "overflows: a value exceeds", {"constants.huge": "max_model_len * 4611686018427387904"}),
    S("pad-a-bool", "buffers.seq_lens.pad: ", {"buffers.seq_lens.pad": True}),
    S("rows-shrinking", "must not decrease as requests grow", {"buffers.seq_lens.rows": "max(1, 8 - tokens)"}),
    S("complex-key", "complex keys are not allowed", "version: 1\n? [a, b]\n: 1\n"),
    S("task-unregistered", "tasks[0].factory: 'os:system' is neither registered",
      {"tasks": [{"name": "t", "factory": "os:system"}]}),
    S("task-option-typo", "tasks[0].options.num_headz: unknown option; allowed: num_heads",
      {"tasks": [{"name": "t", "factory": "graphbuf.drill.session:PagedDecodeAttention", "options": {"num_headz": 2}}]}),
    # ---------------------------------------------------------------------------------- spec: oversized plans
    S("plan-above-spec-limit", "limits.max_bytes: the plan needs 3072 bytes", {"limits.max_bytes": 1024}, PlanTooLargeError),
    S("plan-above-default-limit", "largest buffer: block_table.a", {"constants.max_model_len": 10**9}, PlanTooLargeError),
    S("plan-astronomical", "limits.max_bytes", {"constants.max_model_len": 10**15}, PlanTooLargeError),
    S("constant-beyond-int64", "constants.max_model_len: Input should be less than or equal to 9223372036854775807",
      {"constants.max_model_len": 10**30}),
    # ---------------------------------------------------------------------------------- CLI arguments
    C("cli-missing-file", UsageError, "absent.yaml: no such spec file", 2, "check {dir}/absent.yaml"),
    C("cli-spec-a-directory", UsageError, "is a directory; a spec is a YAML file", 2, "check {dir}"),
    C("cli-set-huge", SpecError, "is not an integer (at most 19 digits)", 2, "check {spec} --set num_blocks=" + "9" * 30),
    C("cli-sizes-no-envelope", SpecError, "capture.max_requests: not declared", 2, "sizes {spec}"),
    C("cli-sizes-bad-waste", UsageError, "--max-waste 150: must be a percentage in [0, 100)", 2, "sizes gemma4-31b-it-mtp --max-waste 150"),
    C("cli-unknown-spec-name", UsageError, "no-such-spec: no such spec file and no shipped spec", 2, "plan no-such-spec"),
    C("cli-set-without-equals", SpecError, "--set 'num_blocks': expected NAME=VALUE", 2, "check {spec} --set num_blocks"),
    C("cli-set-empty-name", SpecError, "--set '=3': expected NAME=VALUE", 2, "plan {spec} --set =3"),
    C("cli-set-not-integer", SpecError, "--set 'num_blocks=lots': 'lots' is not an integer", 2, "plan {spec} --set num_blocks=lots"),
    C("cli-set-unknown-constant", SpecError, "overrides.num_blockz: unknown constant", 2, "check {spec} --set num_blockz=3"),
    C("cli-set-breaks-bounds", SpecError, "buffers.block_table.max: max -1 is below min 0", 2, "check {spec} --set num_blocks=0"),
    C("cli-drill-unknown-device", SystemExit, "argument --device: invalid choice: 'tpu'", 2, "drill {spec} --device tpu"),
    C("cli-drill-negative-replays", UsageError, "--replays -1: must be ≥ 0", 2, "drill {spec} --replays -1"),
    C("cli-drill-replays-not-int", SystemExit, "argument --replays: invalid int value: 'many'", 2, "drill {spec} --replays many"),
    C("cli-drill-seed-not-int", SystemExit, "argument --seed: invalid int value: '1.5'", 2, "drill {spec} --seed 1.5"),
    # A device this machine lacks: a usage error (exit 2) naming the device, not a traceback.
    C("cli-drill-cuda-absent", DeviceUnavailableError, "cuda", 2, "drill {spec} --device cuda --replays 1", _CUDA),
    C("cli-drill-npu-absent", DeviceUnavailableError, "npu", 2, "drill {spec} --device npu --replays 1", _NPU),
    C("cli-missing-spec-argument", SystemExit, "the following arguments are required: spec", 2, "plan"),
    C("cli-check-without-spec-or-vllm", UsageError, "check: give a spec, or a vLLM configuration", 2, "check"),
    C("cli-unknown-command", SystemExit, "invalid choice: 'compile'", 2, "compile {spec}"),
    C("cli-unknown-option", SystemExit, "unrecognized arguments: --jsn", 2, "plan {spec} --jsn"),
    # ---------------------------------------------------------------------------------- refresh sources
    R("too-wide", WidthError, "'block_table.a': source is 5 wide", {"block_table.a": np.zeros((2, 5), _I32)}),
    R("too-many-rows", RowsError, "'seq_lens': 3 live rows, but capture size 4 holds 2", {"seq_lens": np.ones(3, _I32)}),
    R("ragged-list", RefreshError, "'block_table.a': ragged", {"block_table.a": [[1, 2], [3]]}),
    R("float-tensor", RefreshError, "'seq_lens': dtype float32 cannot be cast safely to int32", {"seq_lens": torch.ones(2)}),
    R("int64-array-for-int32", RefreshError, "'seq_lens': dtype int64 cannot be cast", {"seq_lens": np.ones(2, _I64)}),
    R("uint64-for-int64", RefreshError, "'slot_mapping': dtype uint64 cannot be cast", {"slot_mapping": np.ones(4, np.uint64)}),
    R("bfloat16-for-int32", RefreshError, "'seq_lens': dtype bfloat16 cannot be cast", {"seq_lens": torch.ones(2, dtype=torch.bfloat16)}),
    R("float8-tensor", RefreshError, "'seq_lens': dtype float8_e4m3fn cannot be cast", {"seq_lens": torch.ones(2).to(torch.float8_e4m3fn)}),
    R("complex-tensor", RefreshError, "'seq_lens': dtype complex64", {"seq_lens": torch.ones(2, dtype=torch.complex64)}),
    R("floats-in-int-list", RefreshError, "'seq_lens': list holds floats", {"seq_lens": [1.5, 2.0]}),
    R("list-overflows-int32", RefreshError, "'seq_lens': values 3..1099511627776 do not fit int32", {"seq_lens": [3, 2**40]}),
    R("nan-in-float-buffer", RefreshError, "'scratch': NaN at index [1]", {"scratch": np.array([1, np.nan, 2], np.float32)}),
    R("nan-strict", RefreshError, "'scratch': NaN", {"scratch": torch.tensor([1.0, float("nan"), 2.0])}, strict=True),
    R("float-overflows-float32", RefreshError, "'scratch': value 1e+300 does not fit float32", {"scratch": [1e300, 0.0, 0.0]}),
    R("negative-seq-len", RefreshError, "'seq_lens': value -1 at index [1] is below min 0", {"seq_lens": np.array([3, -1], _I32)}),
    R("negative-seq-len-strict", RefreshError, "'seq_lens': value -1 at index [0] is below min 0", {"seq_lens": torch.tensor([-1, 3], dtype=torch.int32)}, strict=True),
    R("slot-below-min", RefreshError, "'slot_mapping': value -2 at index [1] is below min -1", {"slot_mapping": np.array([0, -2, 1, 2], _I64)}),
    R("slot-int64-min", RefreshError, "'slot_mapping': value -9223372036854775808 at index [0] is below min -1", {"slot_mapping": np.array([-(2**63), 0, 0, 0], _I64)}),
    R("block-id-above-max", RefreshError, "'block_table.b': value 32 at index [0, 1] is above max 31", {"block_table.b": np.array([[0, 32], [1, 1]], _I32)}),
    R("block-id-above-max-strict", RefreshError, "'block_table.b': value 32 at index [1, 0] is above max 31", {"block_table.b": torch.tensor([[0, 1], [32, 1]], dtype=torch.int32)}, strict=True),
    R("transposed-tensor", RefreshError, "'block_table.a': source elements are strided", {"block_table.a": torch.arange(8, dtype=torch.int32).reshape(4, 2).T}),
    R("strided-1d-array", RefreshError, "'seq_lens': source elements are strided", {"seq_lens": np.arange(4, dtype=_I32)[::2]}),
    R("meta-tensor", RefreshError, "'seq_lens': source is on meta", {"seq_lens": torch.empty(2, dtype=torch.int32, device="meta")}),
    R("wrong-ndim", RefreshError, "'seq_lens': expected 1-D source, got shape [2, 1]", {"seq_lens": np.ones((2, 1), _I32)}),
    R("zero-dim-tensor", RefreshError, "'seq_lens': expected 1-D source, got shape []", {"seq_lens": torch.tensor(3, dtype=torch.int32)}),
    R("string-source", RefreshError, "'seq_lens': unsupported source type str", {"seq_lens": "3,4"}),
    R("unknown-buffer", RefreshError, "'seq_len': unknown buffer; known: block_table.a", {"seq_len": [3, 4]}),
    R("per-group-base-name", RefreshError, "'block_table': is declared per group; pass each group's buffer", {_BT: [[1]]}),
    R("missing-buffer", RefreshError, "missing buffer(s) seq_lens; only buffers declared 'keep: true'", {}, drop=("seq_lens",)),
    R("rows-disagree", RefreshError, "'seq_lens': 1 rows, but block_table.a implies 2 live requests", {"seq_lens": np.ones(1, _I32)}),
    R("rows-match-no-count", RefreshError, "'query_start_loc': 0 rows", {"query_start_loc": []}),
    R("num-requests-above-capacity", RowsError, "num_reqs=5, but capture size 4 holds 0..2", {}, num_reqs=5),
    R("num-requests-negative", RowsError, "num_reqs=-1, but capture size 4 holds 0..2", {}, num_reqs=-1),
    R("unknown-capture-size", RefreshError, "refresh(size=3): not a capture size; sizes: 2, 4, 8", {}, size=3),
]  # fmt: skip


def _param(case: Bad) -> Any:
    marks = [pytest.mark.skip(reason=case.skip)] if case.skip else []
    return pytest.param(case, id=f"{case.kind}:{case.id}", marks=marks)


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str, str]:
    try:
        code: int | str | None = cli_main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _spec_file(case: Bad, tmp_path: Path, spec_mapping: Callable[[], dict[str, Any]]) -> Path:
    path = tmp_path / f"{case.id}.yaml"
    change = case.change
    if isinstance(change, bytes):
        path.write_bytes(change)
        return path
    if isinstance(change, str):
        path.write_text(change, encoding="utf-8")
        return path
    spec = spec_mapping()
    if callable(change):
        change(spec)
    else:
        assert change is not None
        for dotted, value in change.items():
            *parents, leaf = dotted.split(".")
            node = spec
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def _check_spec_row(
    case: Bad, tmp_path: Path, spec_mapping: Callable[[], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _spec_file(case, tmp_path, spec_mapping)
    with pytest.raises(SpecError) as info:
        graphbuf.plan(str(path))
    assert type(info.value) is case.error
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert case.fragment in message, message

    code, out, err = _run_cli(["check", str(path)], capsys)
    assert (code, out) == (case.exit_code, "")
    assert err.startswith(f"graphbuf: spec error:\n{path}: "), err
    assert case.fragment in err, err


def _check_cli_row(
    case: Bad, tmp_path: Path, spec_mapping: Callable[[], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    valid = tmp_path / "valid.yaml"
    valid.write_text(yaml.safe_dump(spec_mapping(), sort_keys=False), encoding="utf-8")
    argv = [a.replace("{spec}", str(valid)).replace("{dir}", str(tmp_path)) for a in case.argv]
    code, _, err = _run_cli(argv, capsys)
    assert code == case.exit_code, err
    assert case.fragment in err, err
    if case.error is SystemExit:
        assert err.startswith("usage: graphbuf"), err
    elif issubclass(case.error, SpecError):
        assert err.startswith("graphbuf: spec error:\n"), err
    elif issubclass(case.error, (UsageError, DeviceUnavailableError)):
        assert err.startswith("graphbuf: usage error: "), err
    else:
        assert issubclass(case.error, GraphbufError)
        assert err.startswith("graphbuf: error:"), err


def _check_refresh_row(case: Bad, spec_mapping: Callable[[], dict[str, Any]]) -> None:
    buffers = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(spec_mapping()), strict=case.strict)
    # A previous valid batch in every buffer, so a stray write of any pad or source byte shows.
    assert buffers.refresh(8, {**good_batch(4), "scratch": [0.25, 0.5, 0.75]}) == 4
    before = buffers.slab.numpy().tobytes()
    assert isinstance(case.change, Mapping)
    sources: dict[str, Any] = {**good_batch(2), **case.change}
    for name in case.drop:
        del sources[name]
    with pytest.raises(RefreshError) as info:
        buffers.refresh(case.size, sources, num_reqs=case.num_reqs)
    assert type(info.value) is case.error
    assert case.fragment in str(info.value), str(info.value)
    assert buffers.slab.numpy().tobytes() == before
    assert buffers.refresh(4, good_batch(2)) == 2  # the buffers still take a valid batch


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_rejected_naming_the_place(
    case: Bad, tmp_path: Path, spec_mapping: Callable[[], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    if case.kind == "spec":
        _check_spec_row(case, tmp_path, spec_mapping, capsys)
    elif case.kind == "cli":
        _check_cli_row(case, tmp_path, spec_mapping, capsys)
    else:
        _check_refresh_row(case, spec_mapping)


def test_catalogue_has_at_least_30_distinct_rows() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    fragments = [(c.kind, c.fragment, c.argv) for c in CASES]
    assert len(fragments) == len(set(fragments)), "two rows expect the same message for the same kind"
    assert len(CASES) >= 30
    by_kind = {kind: sum(c.kind == kind for c in CASES) for kind in ("spec", "cli", "refresh")}
    assert by_kind["spec"] >= 10 and by_kind["cli"] >= 5 and by_kind["refresh"] >= 10, by_kind


def test_valid_baseline_inputs_are_accepted(
    spec_mapping: Callable[[], dict[str, Any]],
    write_yaml: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The inputs every row starts from are valid, so each row's rejection is due to its one change."""
    path = write_yaml(spec_mapping(), name="valid.yaml")
    assert graphbuf.plan(str(path)).capture_sizes == (2, 4, 8)
    code, out, err = _run_cli(["check", str(path)], capsys)
    assert (code, err) == (0, "") and out.startswith(f"{path}: ok: small")
    buffers = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(spec_mapping()), "cpu", strict=True)
    assert buffers.refresh(4, good_batch(2)) == 2
    assert buffers.view(4)["seq_lens"].tolist() == [3, 4]

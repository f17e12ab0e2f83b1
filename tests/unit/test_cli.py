"""The ``graphbuf`` command (plan, check, schema), in-process; plus one run each of ``python -m graphbuf`` and
the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import graphbuf
from graphbuf import GraphSpec
from graphbuf.cli import main

REPO = Path(__file__).resolve().parents[2]
GEMMA = "gemma4-31b-it-mtp"
Mapping = dict[str, Any]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_text_mentions_every_buffer(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "plan", GEMMA)
    assert (code, err) == (0, "")
    assert out.startswith(
        f"{GEMMA}: 6 buffers, 8192 bytes (8.0 KiB) in one slab (limit 1.0 GiB); 16 capture sizes"
    )
    for name in graphbuf.plan(GEMMA).names:
        assert name in out
    assert "max num_blocks - 1 (unset)" in out
    assert "verify_kv_dense" in out


def test_plan_json_has_totals_and_rows_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", GEMMA, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["total_bytes"] == 8192 and data["max_bytes"] == 1 << 30
    assert data["capture_sizes"] == list(range(4, 65, 4))
    assert len(data["buffers"]) == 6
    assert data["sizes"]["64"]["requests"] == 16
    assert data["sizes"]["64"]["rows"]["query_start_loc"] == 17
    assert data["sizes"]["8"]["rows"]["slot_mapping.full"] == 8
    assert data["constants"]["num_blocks"] is None
    assert data == json.loads(json.dumps(graphbuf.plan(GEMMA).to_dict()))


def test_set_overrides_flow_through(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "plan", GEMMA, "--json", "--set", "num_blocks=100", "--set", "max_model_len=1024"
    )
    assert code == 0
    data = json.loads(out)
    assert data["constants"]["num_blocks"] == 100
    assert data["constants"]["max_blocks_per_seq"] == 8
    bt = next(b for b in data["buffers"] if b["name"] == "block_table.full")
    assert (bt["shape"], bt["max"]) == ([16, 8], 99)
    code, out, _ = _run(capsys, "plan", GEMMA, "--set", " num_blocks = 100 ")
    assert code == 0 and "min 0, max 99" in out


@pytest.mark.parametrize(
    ("pair", "fragment"),
    [
        ("num_blocks", "--set 'num_blocks': expected NAME=VALUE with an integer VALUE"),
        ("=5", "--set '=5': expected NAME=VALUE"),
        ("num_blocks=many", "--set 'num_blocks=many': 'many' is not an integer"),
        ("num_blocks=1.5", "'1.5' is not an integer"),
        ("bogus=3", "overrides.bogus: unknown constant"),
        ("max_num_seqs=2", "capture.sizes: size 12 implies 3 requests, above max_num_seqs (2)"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "check"])
def test_bad_set_exits_2(capsys: pytest.CaptureFixture[str], command: str, pair: str, fragment: str) -> None:
    code, out, err = _run(capsys, command, GEMMA, "--set", pair)
    assert code == 2
    assert out == ""
    assert err.startswith("graphbuf: spec error:\n")
    assert fragment in err


def test_check_prints_a_one_line_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "check", GEMMA, "--set", "num_blocks=64")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{GEMMA}: ok: {GEMMA}, 6 buffers, 8192 bytes, capture sizes 4..64 (16)",
        "coverage: 16/16 batch sizes of 1..16 requests replay a graph (max padding waste 0.0%)",
    ]


def test_check_on_a_file(
    capsys: pytest.CaptureFixture[str], spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    path = write_yaml(spec_mapping())
    code, out, _ = _run(capsys, "check", str(path))
    assert code == 0
    assert out == (
        f"{path}: ok: small, 6 buffers, 3072 bytes, capture sizes 2..8 (3)\n"
        "coverage: no serving envelope declared (capture.max_requests); the capture sizes hold uniform "
        "batches of 1..4 requests\n"
    )


def test_check_bad_spec_exits_2_with_every_error_on_stderr(
    capsys: pytest.CaptureFixture[str], spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    d = spec_mapping()
    d["capture"]["sizes"] = [2, 3]
    d["buffers"]["seq_lens"]["dtype"] = "int4"
    d["buffers"]["block_table"]["pad"] = -1.5
    path = write_yaml(d)
    code, out, err = _run(capsys, "check", str(path))
    assert code == 2 and out == ""
    assert err.startswith("graphbuf: spec error:\n")
    assert f"{path}: buffers.seq_lens.dtype:" in err
    d["buffers"]["seq_lens"]["dtype"] = "int32"
    path = write_yaml(d)
    code, out, err = _run(capsys, "check", str(path))
    assert code == 2 and out == ""
    assert f"{path}: capture.sizes[1]: size 3 is not a multiple of tokens_per_request (2)" in err
    assert f"{path}: buffers.block_table.pad: -1.5 is not representable in int32" in err


def test_plan_too_large_exits_2(
    capsys: pytest.CaptureFixture[str], spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    d = spec_mapping()
    d["limits"] = {"max_bytes": 512}
    path = write_yaml(d)
    for command in ("plan", "check"):
        code, out, err = _run(capsys, command, str(path))
        assert code == 2 and out == ""
        assert err.startswith(f"graphbuf: spec error:\n{path}: limits.max_bytes: the plan needs 3072 bytes")


def test_bad_yaml_exits_2(capsys: pytest.CaptureFixture[str], write_yaml: Callable[..., Path]) -> None:
    path = write_yaml("version: 1\nname: !!python/object/apply:os.getpid []\n")
    code, _, err = _run(capsys, "plan", str(path))
    assert code == 2
    assert f"{path}: line 2" in err and "could not determine a constructor" in err


def test_schema_prints_the_model_schema_and_matches_the_committed_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(capsys, "schema")
    assert (code, err) == (0, "")
    printed = json.loads(out)
    assert printed == GraphSpec.model_json_schema()
    assert printed == json.loads((REPO / "specs" / "graphbuf.schema.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("command", ["plan", "check"])
def test_unknown_spec_name_exits_2(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, err = _run(capsys, command, "no-such-spec")
    assert code == 2 and out == ""
    assert "no-such-spec: no such spec file and no shipped spec of that name; shipped: " in err
    assert GEMMA in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["plan"],
        ["check"],
        ["plan", GEMMA, "--colour"],
        ["plan", GEMMA, "--set"],
        ["schema", "extra"],
        ["check", GEMMA, "--colour"],
        ["sizes", GEMMA, "--max-graphs", "many"],
    ],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    try:  # argparse's refusals exit through SystemExit (with the usage line); the commands' own return 2
        code, err = main(argv), capsys.readouterr().err
    except SystemExit as exc:
        code, err = exc.code, capsys.readouterr().err
        assert "usage: graphbuf" in err
    assert code == 2
    assert "graphbuf: usage error: " in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("plan", "check", "schema"))


def test_python_m_graphbuf_plan_exits_0() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "graphbuf", "plan", GEMMA],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{GEMMA}: 6 buffers")


def test_console_script_plan_exits_0() -> None:
    exe = shutil.which("graphbuf") or shutil.which("graphbuf", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the graphbuf console script is not on PATH")
    proc = subprocess.run(
        [exe, "plan", GEMMA, "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["name"] == GEMMA


def test_the_readme_states_the_required_spec_fields(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    """Issue 19 §5: the spec section says `version` and `name` are required, as the model and schema do."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### The spec") :]
    line = (
        "- **required**: `version` (`1`), `name` (a string), `capture` (at least its `sizes`) and `buffers`"
    )
    assert line in section
    assert set(GraphSpec.model_json_schema()["required"]) == {"version", "name", "capture", "buffers"}
    for field in ("version", "name"):
        doc = spec_mapping()
        del doc[field]
        with pytest.raises(graphbuf.SpecError, match=rf"<spec>: {field}: Field required"):
            GraphSpec.model_validate(doc)


def test_the_schema_ships_in_the_wheel_where_the_readme_says(tmp_path: Path) -> None:
    """Issue 19 §5: a built wheel holds graphbuf/specs/graphbuf.schema.json, the path the README gives."""
    import zipfile

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    where = "graphbuf/specs/graphbuf.schema.json"
    assert f"`{where}`" in readme
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("graphbuf", "adapters", "specs"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "CC": "false"},  # no kernel build
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("graphbuf-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = json.loads(zf.read(where))
        assert "graphbuf/specs/gemma4-31b-it-mtp.yaml" in zf.namelist()
    assert shipped == GraphSpec.model_json_schema()


# ----------------------------------------------------------------------------------------------------------
# Issue 33 §1: every exit 2 carries the README's label; argument errors come before torch; hints that work.

_HAS_CUDA_BUILD = __import__("torch").version.cuda is not None
SPEC_COMMANDS = ("check", "plan", "sizes", "drill")
#: (argv, fragment of the message): every CLI argument that can be out of range, and missing files. {d} is a
#: scratch directory. The README files each under `usage error`.
OUT_OF_RANGE = [
    (["sizes", GEMMA, "--max-waste", "-5"], "--max-waste -5: must be a percentage in [0, 100)"),
    (["sizes", GEMMA, "--max-waste", "1000"], "--max-waste 1000: must be a percentage in [0, 100)"),
    (["sizes", GEMMA, "--max-waste", "nan"], "--max-waste nan: must be a percentage"),
    (["sizes", GEMMA, "--max-waste", "inf"], "--max-waste inf: must be a percentage"),
    (["sizes", GEMMA, "--max-graphs", "0"], "--max-graphs 0: must be in 1..4096"),
    (["sizes", GEMMA, "--max-graphs", "4097"], "--max-graphs 4097: must be in 1..4096"),
    (["sizes", GEMMA, "--max-graphs", "4"], "needs 12 graphs, above --max-graphs 4"),
    (["sizes", GEMMA, "--force"], "--force accepts the waste --max-graphs N needs"),
    (["sizes", GEMMA, "--write"], "--write edits a spec file"),
    (["drill", GEMMA, "--replays", "-1"], "--replays -1: must be ≥ 0"),
    (["drill", GEMMA, "--seed", "-1"], "--seed -1: must be an integer in [0, 2**63 - 1]"),
    (["drill", GEMMA, "--seed", str(2**63)], "--seed 9223372036854775808: must be an integer"),
    (["drill", GEMMA, "--device", "npu"], "--device npu: torch_npu is not installed"),
    (["drill", GEMMA, "--replay", "{d}/absent.json"], "--replay {d}/absent.json: no such file"),
    (["drill", GEMMA, "--save", "{d}/no/dir/f.json"], "no such directory"),
    (["drill", GEMMA, "--model", "tiny", "--padding-contract"], "--model and --padding-contract are two"),
    (["drill", GEMMA, "--model", "tiny", "--staged"], "--staged does not apply to drill --model"),
    (["drill", GEMMA, "--model", "tiny", "--replays", "3"], "--replays does not apply to drill --model"),
    (["drill", GEMMA, "--model", "tiny", "--set", "num_blocks=9"], "--set does not apply to drill --model"),
    (["drill", GEMMA, "--padding-contract", "--replay", "x.json"], "--replay does not apply to drill --padd"),
    (["drill", GEMMA, "--padding-contract", "--save", "x.json"], "--save does not apply to drill --padd"),
    *[([cmd, "{d}/nonexistent.yaml"], "nonexistent.yaml: no such spec file") for cmd in SPEC_COMMANDS],
    *[([cmd, "{d}"], "is a directory; a spec is a YAML file") for cmd in SPEC_COMMANDS],
    *([] if _HAS_CUDA_BUILD else [(["drill", GEMMA, "--device", "cuda"], "--device cuda: this torch (")]),
]  # fmt: skip
#: argparse's own refusals (exit 2 through SystemExit): out-of-range or malformed values it parses.
ARGPARSE_REFUSALS = [
    ["plan", GEMMA, "--context", "-1"],
    ["plan", GEMMA, "--context", "many"],
    ["sizes", GEMMA, "--max-graphs", "many"],
    ["sizes", GEMMA, "--max-waste", "lots"],
    ["drill", GEMMA, "--replays", "many"],
    ["drill", GEMMA, "--seed", "1.5"],
    ["drill", GEMMA, "--device", "tpu"],
    ["drill", GEMMA, "--model", "huge"],
]

_PROBE = """
import contextlib, io, json, sys
from graphbuf.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out.append([code, err.getvalue(), "torch" in sys.modules])
print(json.dumps(out))
"""


REFUSALS = [(argv, fragment) for argv, fragment in OUT_OF_RANGE] + [(argv, "") for argv in ARGPARSE_REFUSALS]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[Any]]]:
    """Every refusal run once, in order, in one fresh interpreter: (scratch dir, [code, stderr, torch
    imported] per row of REFUSALS)."""
    scratch = tmp_path_factory.mktemp("refusals")
    argvs = [[a.replace("{d}", str(scratch)) for a in argv] for argv, _ in REFUSALS]
    env = {**os.environ, "GRAPHBUF_DRILL_REPLAYS": ""}
    probe = [sys.executable, "-c", _PROBE, json.dumps(argvs)]
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return scratch, json.loads(proc.stdout)


@pytest.mark.parametrize("row", range(len(REFUSALS)), ids=[" ".join(argv) for argv, _ in REFUSALS])
def test_an_out_of_range_argument_or_missing_file_is_a_usage_error_before_torch(
    refusals: tuple[Path, list[list[Any]]], row: int
) -> None:
    """Each refusal exits 2 labelled `usage error` (as the README's Commands section files them), and the
    interpreter has not imported torch when it refuses (the drill's refusals included)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "`graphbuf: usage error:` (an argument out of range, a missing file" in readme
    scratch, results = refusals
    argv, fragment = REFUSALS[row]
    code, err, torch_loaded = results[row]
    assert code == 2, (argv, err)
    assert "graphbuf: usage error: " in err and fragment.replace("{d}", str(scratch)) in err, (argv, err)
    assert "Traceback" not in err and "spec error" not in err, (argv, err)
    assert not torch_loaded, f"{argv}: torch was imported before the refusal"


def test_a_missing_model_extra_hints_the_pinned_extra_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the model extra were not installed
    code, _, err = _run(capsys, "drill", GEMMA, "--model", "tiny")
    assert code == 2, err
    assert err.startswith("graphbuf: usage error: missing dependency: the module 'transformers'"), err
    assert "pip install -c constraints.txt -e '.[model]'" in err, err
    assert "pip install transformers" not in err and "-e .)" not in err
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("transformers==") for req in extras["model"])  # the extra the hint names


def test_install_hints_name_the_extra_that_declares_the_module() -> None:
    from graphbuf.cli import install_hint

    assert install_hint("transformers").endswith("install -c constraints.txt -e '.[model]'")
    for core in ("hypothesis", "torch", "yaml", "numpy", "pydantic", "ruamel"):  # core dependencies
        assert install_hint(core).endswith("install -c constraints.txt -e ."), core
    assert "constraints" not in install_hint("torch_npu") and "'.[npu]'" in install_hint("torch_npu")
    assert "graphbuf does not require it" in install_hint("no_such_module_xyz")


def test_check_strict_points_to_a_command_that_accepts_the_spec(
    capsys: pytest.CaptureFixture[str], spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    """The advice names eager batches as ranges and a `graphbuf sizes` command; that command accepts the spec
    (with the same --set), and without an envelope the advice says what to add before it."""
    code, _, err = _run(capsys, "check", GEMMA, "--strict", "--set", "max_num_seqs=64")
    assert code == 1
    assert "requests 17..64 run eagerly" in err and ", 18, " not in err, err
    command = err.split("`")[1]
    assert command == f"graphbuf sizes {GEMMA} --set max_num_seqs=64"
    code, out, err = _run(capsys, *command.split()[1:])
    assert code == 0 and "64/64 batch sizes of 1..64 requests replay a graph" in out, err
    doc = spec_mapping()
    path = write_yaml(doc)
    code, _, err = _run(capsys, "check", str(path), "--strict")
    assert code == 1 and "no serving envelope declared (capture.max_requests); add it to the spec" in err
    assert _run(capsys, "sizes", str(path))[0] == 2  # refused until the envelope is declared, as advised
    doc["capture"]["max_requests"] = 4
    write_yaml(doc)
    assert _run(capsys, *err.split("`")[3].split()[1:])[0] == 0


def test_help_has_no_rest_markup(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["drill", "--help"], ["sizes", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "``" not in out and ":mod:" not in out, out


def test_plan_says_one_token_per_request(
    capsys: pytest.CaptureFixture[str], spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    doc = spec_mapping()
    doc["capture"].update(tokens_per_request=1, sizes=[2, 4])
    code, out, err = _run(capsys, "plan", str(write_yaml(doc)))
    assert code == 0, err
    assert "1 token per request" in out.splitlines()[0] and "1 tokens" not in out
    assert "4 tokens per request" in _run(capsys, "plan", GEMMA)[1].splitlines()[0]


def test_plan_totals_count_only_the_routes_the_options_select(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 33 §3: the workspace of a route the task options do not select is shown apart, not summed."""
    shipped = (REPO / "specs" / f"{GEMMA}.yaml").read_text(encoding="utf-8")
    blockwise, dense = 2 * 16 * 2 * 2 * 128 * 512 * 2, 2 * 16 * 2 * 43 * 128 * 512 * 2  # at size 64
    for mode, counted, apart in (("blockwise", blockwise, dense), ("dense", dense, blockwise)):
        path = tmp_path / f"{mode}.yaml"
        path.write_text(shipped.replace("verify_mode: blockwise", f"verify_mode: {mode}"), encoding="utf-8")
        code, out, err = _run(capsys, "plan", str(path), "--json")
        assert code == 0, err
        data = json.loads(out)
        assert data["sizes"]["64"]["memory"]["workspaces"] == counted
        assert data["memory_totals"]["workspace_peak_bytes"] == counted
        assert data["memory_totals"]["unselected_workspace_peak_bytes"] == apart
        other = "verify_kv_dense" if mode == "blockwise" else "verify_kv_blockwise"
        assert data["sizes"]["64"]["workspaces_selected"] == {other: False, f"verify_kv_{mode}": True}
        text = _run(capsys, "plan", str(path))[1]
        assert f"not counted (routes the task options do not select): {other}, " in text
    bad_routes = (
        ("verify.sparse", "task 'verify' has no mode 'sparse'; its modes: blockwise, dense"),
        ("dense", "workspaces.verify_kv_dense.route: expected '<task>.<mode>', got 'dense'"),
    )
    for route, fragment in bad_routes:
        path = tmp_path / "bad.yaml"
        path.write_text(shipped.replace("route: verify.dense", f"route: {route}"), encoding="utf-8")
        code, _, err = _run(capsys, "plan", str(path))
        assert code == 2 and err.startswith("graphbuf: spec error:") and fragment in err, err


# ----------------------------------------------------------------------------------------------------------
# Issue 33 §3: what the drill prints is what happened.

PLANTED = REPO / "examples" / "planted" / "planted.yaml"
ALLOW = ("--allow-factory", "planted_tasks")  # tests/conftest.py puts examples/planted on sys.path


def test_drill_replays_0_says_nothing_was_replayed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "drill", str(PLANTED), *ALLOW, "--replays", "0")
    assert code == 0, err
    assert "NOTHING REPLAYED (every size captured; no batch compared)" in out and "PASS" not in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"])]
    assert rows == [["1", "0", "-", "-", "-"], ["4", "0", "-", "-", "-"]], out  # no "yes" unreplayed
    code, out, _ = _run(capsys, "drill", str(PLANTED), *ALLOW, "--replays", "0", "--json")
    report = json.loads(out)
    assert report["compared"] == 0 and all(s["addresses_stable"] is None for s in report["sizes"])
    assert all(s["max_abs_error"] is None for s in report["sizes"])


def test_drill_report_says_whether_writes_were_staged(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cases = (
        ((), "writes: whole sources (refresh)", "sources"),
        (("--staged",), "writes: staged (changed cells, StaticBuffers.stage)", "staged"),
    )
    for flags, words, key in cases:
        argv = ("drill", str(PLANTED), *ALLOW, "--replays", "2", "--save", str(tmp_path / "f.json"), *flags)
        out = _run(capsys, *argv)[1]
        assert words in out.splitlines()[0], out
        assert json.loads(_run(capsys, *argv, "--json")[1])["writes"] == key


def test_padding_contract_json_keeps_the_spec_s_pad_types(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = PLANTED.read_text(encoding="utf-8")
    old = "scale: {dtype: int32, rows: requests, pad: 0"
    text = text.replace(old, "scale: {dtype: float32, rows: requests, pad: 1.5")
    spec = tmp_path / "pads.yaml"
    spec.write_text(text, encoding="utf-8")
    code, out, err = _run(capsys, "drill", str(spec), *ALLOW, "--padding-contract", "--json")
    assert code == 0, err
    pads = {b["buffer"]: b["pad"] for b in json.loads(out)["buffers"]}
    assert pads == {"lens": 7, "scale": 1.5, "table": 0}, pads  # numbers as the spec gives them, not "7"
    assert type(pads["lens"]) is int and type(pads["scale"]) is float


@pytest.mark.parametrize(
    ("mode", "unit"),
    [((), "replays"), (("--replay", "{saved}"), "replays"), (("--padding-contract",), "padding trials")],
    ids=["drill", "replay", "padding-contract"],
)
def test_every_drill_mode_prints_progress_off_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    mode: tuple[str, ...], unit: str,
) -> None:  # fmt: skip
    """Progress lines on stderr (not a terminal here) every INTERVAL seconds (5 in use; 10 ms here)."""
    import graphbuf.drill.progress

    saved = tmp_path / "failure.json"
    if "--replay" in mode:
        assert _run(capsys, "drill", str(PLANTED), *ALLOW, "--replays", "8", "--save", str(saved))[0] == 1
    monkeypatch.setattr(graphbuf.drill.progress, "INTERVAL", 0.01)
    argv = [a.replace("{saved}", str(saved)) for a in mode]
    code, _, err = _run(capsys, "drill", str(PLANTED), *ALLOW, *(argv or ["--replays", "4"]))
    assert code in (0, 1), err
    if "--padding-contract" not in mode:  # the contract captures its one size without the runner's sizes
        assert "drill: 2/2 sizes captured in " in err, err
    assert f" {unit}" in err and "\r" not in err, err


def test_the_whole_model_drill_prints_its_elapsed_time_off_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its loop is graphbuf/drill/model's; the CLI hands it ``args.progress`` and, meanwhile, the ticker
    prints the elapsed time every INTERVAL (a stand-in run of 0.3 s here, 10 ms interval)."""
    import time

    import graphbuf.drill.model
    import graphbuf.drill.progress

    seen = []

    def run(args: Any, overrides: Any) -> int:
        seen.append(args.progress)
        time.sleep(0.3)
        return 0

    monkeypatch.setattr(graphbuf.drill.progress, "INTERVAL", 0.01)
    monkeypatch.setattr(graphbuf.drill.model, "run_model_drill_cli", run)
    code, _, err = _run(capsys, "drill", GEMMA, "--model", "tiny")
    assert code == 0 and isinstance(seen[0], graphbuf.drill.progress.Progress)
    assert err.count("drill: 0/1 whole-model drill, ") >= 2 and " s so far" in err, err


def test_check_strict_on_a_vllm_configuration_labels_its_advice_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, "check", "--max-num-seqs", "256", "--num-speculative-tokens", "3",
                        "--capture-sizes", "4,8,16", "--strict")  # fmt: skip
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("graphbuf: check --strict: uniform decode batches of 5–256 requests"), line
    assert line.count("graphbuf:") == 1, line

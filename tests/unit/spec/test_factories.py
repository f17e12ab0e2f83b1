"""Issue 12 §4 (factories) and §5: task options are validated against each factory's declared schema; only
registered or explicitly allowed factories are imported; check/plan/schema/sizes never import torch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import graphbuf
from graphbuf.cli import main
from graphbuf.errors import SpecError
from graphbuf.spec.factories import registered_factories
from graphbuf.spec.models import GraphSpec, load_spec

REPO = Path(__file__).resolve().parents[3]
GEMMA = "gemma4-31b-it-mtp"
DECODE = "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:decode_task"
VERIFY = "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:verify_task"


def test_the_adapter_and_the_drill_register_their_factories_through_entry_points() -> None:
    registry = registered_factories()
    assert {DECODE, VERIFY, "graphbuf.drill.session:PagedDecodeAttention"} <= set(registry)
    assert "verify_mode" in registry[VERIFY].options.model_fields
    assert "verify_mode" not in registry[DECODE].options.model_fields
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert '[project.entry-points."graphbuf.tasks"]' in pyproject


def _gemma_with(tmp_path: Path, old: str, new: str) -> Path:
    text = graphbuf.spec.models.resolve_spec_path(GEMMA).read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "gemma.yaml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        (
            "      layers: drill_layers\n",
            "      layerz: drill_layers\n",
            "tasks[0].options.layerz: unknown option",
        ),
        (
            "verify_mode: blockwise",
            "verify_mode: blockwis",
            "tasks[1].options.verify_mode: Input should be 'dense' or",
        ),
        (
            "decode_mode: paged",
            "decode_mode: pagd",
            "tasks[0].options.decode_mode: Input should be 'paged' or",
        ),
        ("      layers: drill_layers\n", "      layers: drill_layerz\n", "tasks[0].options.layers:"),
        ("      num_heads: num_heads_per_rank\n", "", "tasks[0].options.num_heads: Field required"),
        (
            "      layers: drill_layers\n",
            "      layers: -1\n",
            "tasks[0].options.layers: Input should be greater",
        ),
        ("      layers: drill_layers\n", "      layers: true\n", "got True"),
    ],
)
def test_a_task_option_typo_is_a_spec_error_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, fragment: str
) -> None:
    path = _gemma_with(tmp_path, old, new)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {fragment}" in err or fragment in err
    with pytest.raises(SpecError):  # the drill refuses it the same way, before any capture
        from graphbuf.drill.session import run_drill

        run_drill(str(path), replays=1)


def test_an_option_needing_an_unset_constant_is_checked_once_set(tmp_path: Path) -> None:
    path = _gemma_with(tmp_path, "      layers: drill_layers\n", "      layers: num_blocks\n")
    load_spec(path)  # num_blocks is null: nothing to check yet
    with pytest.raises(SpecError, match=r"tasks\[0\]\.options\.layers: Input should be greater than 0"):
        load_spec(path, overrides={"num_blocks": 0})


def test_an_unregistered_factory_is_refused_before_any_import(
    spec_mapping: Callable[[], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = spec_mapping()
    d["tasks"] = [{"name": "t", "factory": "never_imported_factory:task"}]
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="f.yaml")
    msg = str(info.value)
    assert "f.yaml: tasks[0].factory: 'never_imported_factory:task' is neither registered" in msg
    assert "--allow-factory never_imported_factory" in msg
    assert "never_imported_factory" not in sys.modules
    d["tasks"] = [{"name": "t", "factory": "os:system", "options": {"command": "true"}}]
    path = tmp_path / "os.yaml"
    path.write_text(yaml.safe_dump(d), encoding="utf-8")
    assert main(["check", str(path)]) == 2
    assert "tasks[0].factory: 'os:system' is neither registered" in capsys.readouterr().err


def test_an_allowed_factory_is_imported_and_its_declared_schema_validates(
    spec_mapping: Callable[[], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = spec_mapping()
    d["tasks"] = [{"name": "w", "factory": "user_factories:widget_task", "options": {"width": "max_blocks"}}]
    with pytest.raises(SpecError, match="neither registered"):
        GraphSpec.model_validate(d)
    GraphSpec.model_validate(d, allow_factories=["user_factories"])
    d["tasks"][0]["options"] = {"widht": 3}
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="u.yaml", allow_factories=["user_factories"])
    assert "u.yaml: tasks[0].options.widht: unknown option; allowed: width, mode" in str(info.value)
    assert "u.yaml: tasks[0].options.width: Field required" in str(info.value)
    d["tasks"][0]["options"] = {"width": 3}
    path = tmp_path / "u.yaml"
    path.write_text(yaml.safe_dump(d), encoding="utf-8")
    assert main(["check", str(path)]) == 2
    assert main(["check", str(path), "--allow-factory", "user_factories"]) == 0
    assert main(["plan", str(path), "--allow-factory", "user_factories"]) == 0
    assert graphbuf.plan(str(path), allow_factories=("user_factories",)).spec.tasks[0].name == "w"
    d["tasks"][0]["factory"] = "user_factories:undeclared_task"
    with pytest.raises(SpecError, match="declares no options schema"):
        GraphSpec.model_validate(d, allow_factories=["user_factories"])
    capsys.readouterr()


_NO_TORCH = """
import sys
from graphbuf.cli import main
for argv in {argvs!r}:
    code = main(argv)
    assert code == 0, (argv, code)
    heavy = sorted(
        m for m in sys.modules if m == "torch" or m.startswith(("torch.", "graphbuf.drill.session"))
    )
    heavy += [m for m in ("graphbuf.adapters.vllm_ascend.bindings.attention_tasks",) if m in sys.modules]
    assert not heavy, (argv, heavy[:5])
print("NO_TORCH_OK")
"""


def test_check_plan_schema_and_sizes_never_import_torch(tmp_path: Path) -> None:
    spec = tmp_path / "g.yaml"
    text = graphbuf.spec.models.resolve_spec_path(GEMMA).read_text(encoding="utf-8")
    spec.write_text(text, encoding="utf-8")
    argvs = [
        ["check", GEMMA],
        ["check", GEMMA, "--coverage", "--strict", "--json"],
        ["plan", GEMMA],
        ["plan", GEMMA, "--json"],
        ["schema"],
        ["sizes", GEMMA],
        ["sizes", str(spec), "--write"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(argvs=argvs)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NO_TORCH_OK" in proc.stdout


def test_buffer_plan_keeps_a_lazy_torch_dtype() -> None:
    import torch

    b = graphbuf.plan(GEMMA)["slot_mapping.full"]
    assert (b.dtype_name, b.itemsize, b.dtype) == ("int64", 8, torch.int64)

"""The vLLM general plugin (plugin.py, upstream.py): it imports only the standard library, activation
is decided by the upstream surface (a miss: one warning, nothing patched), and vLLM discovers it through its
entry point (``load_general_plugins()`` in subprocesses, since vLLM loads plugins once per process)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_plugin_harness import ADAPTER_DIR, FAKE_ROOT, Runner, make_builder, original_calls

import graphbuf.adapters.vllm_ascend.glue.activation as activation
import graphbuf.adapters.vllm_ascend.glue.patch as patch
import graphbuf.adapters.vllm_ascend.glue.plugin as plugin
import graphbuf.adapters.vllm_ascend.glue.routing as routing
import graphbuf.adapters.vllm_ascend.glue.upstream as upstream

# ------------------------------------------------------------------------------ module import hygiene


STDLIB_ONLY = ("plugin.py", "patch.py", "routing.py", "upstream.py", "activation.py")
"""Adapter modules loaded by the plugin in every vLLM process: the standard library, each other and
``graphbuf.errors`` (itself standard-library only) only."""


@pytest.mark.parametrize("filename", STDLIB_ONLY)
def test_module_imports_only_the_standard_library(filename: str) -> None:
    tree = ast.parse((ADAPTER_DIR / filename).read_text())
    imported = set()
    for node in tree.body:  # module level only: imports inside functions are lazy by design
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                sibling = f"{(node.module or '').split('.')[0]}.py"
                names = [sibling] if node.module else [f"{a.name}.py" for a in node.names]
                assert all(n in STDLIB_ONLY for n in names), f"{filename}: relative import of {names}"
                continue
            if node.module != "graphbuf.errors":
                imported.add((node.module or "").split(".")[0])
    non_stdlib = sorted(
        name for name in imported if name not in sys.stdlib_module_names and name != "__future__"
    )
    assert non_stdlib == [], f"{filename} imports {non_stdlib} at module import time"


# ------------------------------------------------------------------------------ plugin activation


def test_activate_patches_with_fake_tree_and_npu(fake_tree: Any) -> None:
    decision = plugin.activate(npu_available=True)
    assert decision == "active: vllm-ascend 0.23.0; attention patch deferred" + plugin._DEFERRED
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.is_patched(module)
    again = plugin.activate(npu_available=True)
    assert again.startswith("active: vllm-ascend 0.23.0; attention patch already applied; update mechanism ")
    assert "update_graph_params" in again and "graphbuf routes the 512-dim" in again


def test_activate_without_npu_changes_nothing(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    decision = plugin.activate(npu_available=False)
    assert decision.startswith("inactive: no NPU available")
    assert not patch.is_patched(module)


def test_activation_ignores_the_version_string_and_logs_it(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A git checkout of main reports 0.19.1rc2.dev...: the surface decides, the version is only logged."""
    package = importlib.import_module("vllm_ascend")
    monkeypatch.setattr(package, "__version__", "0.19.1rc2.dev1637+g182b75ea8")
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    decision = plugin.activate(npu_available=True)
    assert decision.startswith(
        "active: vllm-ascend 0.19.1rc2.dev1637+g182b75ea8; attention patch applied; update mechanism "
        "update_graph_params (no vllm_ascend.compilation.updatable_graph"
    )
    assert patch.is_patched(module)


def _drop_update(m: Any) -> None:
    delattr(m.AscendAttentionBackendImpl, "update_graph_params")


def _drop_metadata_fields(m: Any) -> None:
    delattr(m.AscendMetadata, "__dataclass_fields__")


def _drop_fence(m: Any) -> None:
    delattr(m, "record_attention_compute_start")


def _unknown_update_form(m: Any) -> None:
    m.AscendAttentionBackendImpl.update_graph_params = staticmethod(
        lambda update_stream, forward_context, num_tokens: None
    )


@pytest.mark.parametrize(
    ("break_it", "named"),
    [
        (_drop_update, "AscendAttentionBackendImpl.update_graph_params is missing or not a staticmethod"),
        (_drop_metadata_fields, "AscendMetadata has no field attn_state"),
        (_drop_fence, "has no function record_attention_compute_start"),
        (
            _unknown_update_form,
            "takes (update_stream, forward_context, num_tokens), which is none of the forms graphbuf knows",
        ),
    ],
    ids=["update_graph_params", "metadata-fields", "fence", "update-form"],
)
def test_a_surface_miss_leaves_the_plugin_inactive_with_one_line_naming_it(
    fake_tree: Any, caplog: pytest.LogCaptureFixture, break_it: Any, named: str
) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    break_it(module)  # the fixture purges the fake modules afterwards
    with caplog.at_level(logging.DEBUG, logger=plugin.__package__):
        decision = plugin.activate(npu_available=True)
    assert decision.startswith("inactive: vllm-ascend 0.23.0: ") and named in decision
    [line] = caplog.records
    assert line.levelno == logging.WARNING and named in line.getMessage()
    assert not patch.is_patched(module)


def test_a_surface_miss_found_by_the_import_hook_makes_the_plugin_inactive(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "_decision", None)
    monkeypatch.setattr(plugin, "activate", lambda: "active: vllm-ascend 0.23.0; attention patch deferred")
    plugin.register()
    extra = importlib.import_module("vllm_ascend.ascend_forward_context")
    monkeypatch.setattr(type(extra._EXTRA_CTX), "extra_attrs", ())
    assert patch.install() == "deferred"
    with caplog.at_level(logging.WARNING):
        module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert not patch.is_patched(module)
    [line] = [r for r in caplog.records if r.name == patch.__name__]
    assert "_EXTRA_CTX does not list 'capturing'" in line.getMessage()
    assert plugin.decision().startswith("inactive: ") and "capturing" in plugin.decision()


def test_an_import_hook_failure_that_is_not_a_surface_miss_is_raised(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(module: Any) -> None:
        raise RuntimeError("patch broke")

    monkeypatch.setattr(patch, "apply", broken)
    assert patch.install() == "deferred"
    with pytest.raises(RuntimeError, match="patch broke"):
        importlib.import_module("vllm_ascend.attention.attention_v1")


def test_every_surface_entry_holds_on_the_fake_tree(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert upstream.first_miss(module) is None
    assert len(upstream.SURFACE) >= 15


def test_a_run_time_miss_raises_naming_the_entry(av1: Any, kernels: Any) -> None:
    """A field the activation check saw but a metadata object lacks at run time is never defaulted."""
    runner = Runner()
    common = runner.common(av1, [1, 1], "DecodeOnly")
    del common.num_input_tokens
    with pytest.raises(upstream.UpstreamError, match=r"no 'num_input_tokens' .*AscendCommonAttention"):
        make_builder(av1).build(0, common)


def test_capturing_raises_on_a_broken_forward_context_instead_of_saying_false(
    av1: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = importlib.import_module("vllm_ascend.ascend_forward_context")

    class Broken:
        @property
        def capturing(self) -> bool:
            raise AttributeError("capturing is not extra forward context attribute")

    monkeypatch.setattr(extra, "_EXTRA_CTX", Broken())
    with pytest.raises(AttributeError, match="capturing"):
        upstream.capturing()
    sys.modules["vllm.forward_context"].CONTEXT = None
    assert upstream.capturing() is False  # outside a forward context: not capturing, nothing read


def test_update_graph_params_raises_on_a_form_it_does_not_know(av1: Any) -> None:
    """The 0.23 7-positional call against a 6-parameter (0.25.1+/main) method: refused, nothing called."""
    context = SimpleNamespace(attn_metadata={})
    with pytest.raises(upstream.UpstreamError, match=r"7 positional arguments .*graphbuf knows the forms"):
        av1.AscendAttentionBackendImpl.update_graph_params("stream", context, 2, "cfg", None, None, None)
    with pytest.raises(upstream.UpstreamError, match=r"num_dcp_pcp_tokens"):
        av1.AscendAttentionBackendImpl.update_graph_params("stream", context, 2, "cfg", num_dcp_pcp_tokens=0)
    assert original_calls(av1, "update_graph_params") == []


def test_metadata_answering_the_route_attribute_is_not_routed(av1: Any) -> None:
    """vllm-ascend's own tests fill attn_metadata with MagicMock()s: they answer every attribute, but only
    graphbuf's ``Route`` marks a routed layer, so upstream's update loop still sees every layer."""
    from unittest.mock import MagicMock

    mocks = {"layers.0.attn": MagicMock(), "layers.1.attn": MagicMock()}
    assert all(routing.route_of(m) is None for m in mocks.values())
    assert routing.without_routed(mocks) is mocks
    context = SimpleNamespace(attn_metadata=mocks)
    av1.AscendAttentionBackendImpl.update_graph_params("stream", context, 2, "cfg", None)
    [call] = original_calls(av1, "update_graph_params")
    assert call["keys"] == ["layers.0.attn", "layers.1.attn"] and call["forward_context"] is context


def test_disable_variable_wins(fake_tree: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.DISABLE_ENV, "1")
    assert plugin.activate(npu_available=True).startswith(f"disabled by {plugin.DISABLE_ENV}=1")
    assert "vllm_ascend.attention.attention_v1" not in sys.modules
    assert not any(isinstance(finder, patch._PatchOnImport) for finder in sys.meta_path)


@pytest.fixture
def announced(monkeypatch: pytest.MonkeyPatch) -> list[logging.LogRecord]:
    """The activation line's records: announce() re-armed, its logger a plain one captured here (vLLM's
    own handler is checked by the discovery tests below, in subprocesses)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("graphbuf.tests.activation")
    logger.setLevel(logging.DEBUG)
    handler = Keep()
    logger.addHandler(handler)
    monkeypatch.setattr(activation, "_announced", False)
    monkeypatch.setattr(activation, "_logger", lambda: logger)
    yield records
    logger.removeHandler(handler)


def test_register_decides_once_and_logs_one_info_line(
    monkeypatch: pytest.MonkeyPatch, announced: list[logging.LogRecord]
) -> None:
    monkeypatch.setattr(plugin, "_decision", None)
    calls: list[None] = []
    monkeypatch.setattr(plugin, "activate", lambda: calls.append(None) or "inactive: stubbed")
    plugin.register()
    plugin.register()
    assert calls == [None]
    assert plugin.decision() == "inactive: stubbed"
    assert [(r.levelno, r.getMessage()) for r in announced] == [
        (logging.INFO, "graphbuf vllm-ascend plugin: inactive: stubbed")
    ]


def test_register_never_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, announced: list[logging.LogRecord]
) -> None:
    monkeypatch.setattr(plugin, "_decision", None)

    def broken() -> str:
        raise AttributeError("torch_npu is half installed")

    monkeypatch.setattr(plugin, "activate", broken)
    with caplog.at_level(logging.DEBUG, logger=plugin.__name__):
        plugin.register()
    assert plugin.decision() == "failed: AttributeError('torch_npu is half installed')"
    assert [r.levelno for r in caplog.records if r.name == plugin.__name__] == [logging.WARNING]
    assert [r.getMessage() for r in announced] == [f"graphbuf vllm-ascend plugin: {plugin.decision()}"]


def test_a_deferred_activation_logs_its_info_line_when_the_module_is_patched(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch, announced: list[logging.LogRecord]
) -> None:
    """Section 7: register() waits for the attention module; the one INFO line comes at its import and says
    active, the mechanism, what graphbuf routes and what upstream owns."""
    monkeypatch.setattr(plugin, "_decision", None)
    monkeypatch.setattr(plugin, "activate", lambda: _real_activate(npu_available=True))
    plugin.register()
    assert announced == []  # deferred: nothing decided about the mechanism yet
    importlib.import_module("vllm_ascend.attention.attention_v1")
    [line] = [r.getMessage() for r in announced]
    assert line.startswith("graphbuf vllm-ascend plugin: active: vllm_ascend.attention.attention_v1 patched")
    assert "update mechanism update_graph_params" in line
    assert "graphbuf routes the 512-dim full-attention layers" in line and "upstream owns every other" in line
    assert plugin.decision().startswith("active: vllm-ascend 0.23.0; attention patch applied at its import; ")
    assert "update mechanism update_graph_params" in plugin.decision()


_real_activate = plugin.activate


def test_activate_on_this_cpu_machine_does_not_touch_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("a vllm_ascend is importable in this environment")
    had_torch_npu = "torch_npu" in sys.modules
    assert plugin.activate() == "inactive: vllm_ascend is not importable; nothing patched"
    assert ("torch_npu" in sys.modules) == had_torch_npu


# ---------------------------------------------------------------------- real discovery through vLLM

DISCOVERY_SCRIPT = r"""
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="LOG|%(name)s|%(levelname)s|%(message)s")
try:
    import vllm.plugins
except Exception as exc:
    print("NO_VLLM", repr(exc))
    raise SystemExit(0)
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()
from graphbuf.adapters.vllm_ascend.glue import plugin
first = plugin.decision()
plugin.register()
print("RESULT " + json.dumps({
    "decision": first,
    "after_second_register": plugin.decision(),
    "torch_npu": "torch_npu" in sys.modules,
    "attention_v1": "vllm_ascend.attention.attention_v1" in sys.modules,
}))
"""

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def run_discovery(tmp_path: Path, **env_overrides: str) -> tuple[dict[str, Any], list[str]]:
    names = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if plugin.ENTRY_POINT_NAME not in names:
        pytest.fail(
            f"entry point {plugin.ENTRY_POINT_NAME} is not installed; run `pip install --no-deps -e .` "
            "in the repository root"
        )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (plugin.DISABLE_ENV, "VLLM_PLUGINS", "VLLM_LOGGING_LEVEL")
    }
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS=plugin.ENTRY_POINT_NAME, **env_overrides)
    proc = subprocess.run(
        [sys.executable, "-c", DISCOVERY_SCRIPT],
        cwd=tmp_path,  # not the checkout: graphbuf must come from the installed distribution
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if "NO_VLLM" in proc.stdout:
        pytest.skip(f"vllm is not importable: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result_line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    output = (proc.stdout + proc.stderr).splitlines()
    # an INFO record of vLLM's logger for the plugin (vLLM's own format: the new-user test below)
    prefix = f"LOG|{activation.LOGGER_NAME}|INFO|graphbuf vllm-ascend plugin:"  # the script's format
    decision_lines = [line for line in output if line.startswith(prefix)]
    return json.loads(result_line.removeprefix("RESULT ")), decision_lines


@pytest.mark.vllm
@needs_vllm
def test_vllm_discovers_and_runs_the_entry_point_once(tmp_path: Path) -> None:
    result, lines = run_discovery(tmp_path)
    assert result["decision"] is not None, "load_general_plugins() did not run graphbuf's register()"
    assert result["decision"].startswith("inactive:")
    assert result["after_second_register"] == result["decision"]
    assert len(lines) == 1 and result["decision"] in lines[0]
    assert result["torch_npu"] is False
    assert result["attention_v1"] is False


@pytest.mark.vllm
@needs_vllm
def test_vllm_discovery_with_fake_vllm_ascend_but_no_npu_stays_inert(tmp_path: Path) -> None:
    pythonpath = os.pathsep.join(filter(None, [str(FAKE_ROOT), os.environ.get("PYTHONPATH")]))
    result, lines = run_discovery(tmp_path, PYTHONPATH=pythonpath)
    assert result["decision"].startswith("inactive: no NPU available")
    assert len(lines) == 1
    if importlib.util.find_spec("torch_npu") is None:
        assert result["torch_npu"] is False
    assert result["attention_v1"] is False


@pytest.mark.vllm
@needs_vllm
def test_vllm_discovery_respects_the_disable_variable(tmp_path: Path) -> None:
    result, lines = run_discovery(tmp_path, **{plugin.DISABLE_ENV: "1"})
    assert result["decision"].startswith(f"disabled by {plugin.DISABLE_ENV}=1")
    assert len(lines) == 1 and f"disabled by {plugin.DISABLE_ENV}=1" in lines[0]
    assert result["torch_npu"] is False


NEW_USER_SCRIPT = r"""
import vllm.logger
vllm.logger._configure_vllm_root_logger()  # what vLLM's entry points do first (env config, no CLI flags)
import vllm.plugins
vllm.plugins.load_general_plugins()
"""


@pytest.mark.vllm
@needs_vllm
def test_a_new_user_sees_one_info_line_at_vllms_default_logging_level(tmp_path: Path) -> None:
    """Section 7, tried as a new user would: vLLM's own logging configuration at its default level (no
    VLLM_LOGGING_LEVEL), plugins loaded: exactly one INFO line from graphbuf, in vLLM's format, saying
    whether it is active and why."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (plugin.DISABLE_ENV, "VLLM_PLUGINS", "VLLM_LOGGING_LEVEL")
    }
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS=plugin.ENTRY_POINT_NAME)
    proc = subprocess.run([sys.executable, "-c", NEW_USER_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "graphbuf" in line]
    assert len(lines) == 1, lines
    assert " INFO " in lines[0] and "[activation.py:" in lines[0]
    assert "graphbuf vllm-ascend plugin: inactive: vllm_ascend is not importable" in lines[0]

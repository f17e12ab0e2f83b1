"""The architecture rules the code keeps (issue 9 §7): no import cycle among graphbuf's modules, no module
reading another graphbuf module's private names, production code never importing the tests or the drill's
test tasks."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"graphbuf": REPO / "graphbuf", "graphbuf.adapters.vllm_ascend": REPO / "adapters" / "vllm_ascend"}


def _modules() -> dict[str, Path]:
    """Dotted name → file of every graphbuf module (the adapter under its installed name)."""
    out: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for f in sorted(root.rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = f
    return out


MODULES = _modules()
TEST_MODULES = {"tests", "conftest", "planted_tasks", "user_factories", "npu_contract_standin"}


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _top_level_imports(name: str, path: Path) -> set[str]:
    """graphbuf modules ``name`` imports when it is imported (not under ``if TYPE_CHECKING:``, not inside
    functions): ``from pkg import x`` counts as ``pkg.x`` when that is a module, else ``pkg``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = _package(name, path).split(".")
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)

    visit(tree.body)
    return {m for m in found if m in MODULES and m != name}


def test_no_import_cycle() -> None:
    graph = {name: _top_level_imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                walk(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert graph["graphbuf.refresh.validate"] >= {"graphbuf.refresh.native", "graphbuf.refresh.layout"}


def test_no_module_reads_another_modules_private_names() -> None:
    """``name._x`` where ``name`` is bound by a graphbuf import in that file (a module or a symbol)."""
    bad = []
    for path in MODULES.values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(
                    (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("graphbuf")
                )
            elif isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("graphbuf")
            ):
                imported.update(a.asname or a.name for a in node.names)
                if any(a.name.startswith("_") for a in node.names):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: imports a private name")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in imported:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    # the one private import allowed: the native kernel's loader importing the compiled module itself
    bad = [b for b in bad if not b.startswith("graphbuf/refresh/native.py:")]
    assert not bad, "\n".join(bad)


def test_production_code_never_imports_tests() -> None:
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for m in mods:
                assert m.split(".")[0] not in {"tests", "conftest", "planted_tasks", "user_factories"}, (
                    name,
                    m,
                )

"""The architecture rules the code keeps (issue 9 §7, issue 19 §3): no import cycle among graphbuf's modules,
whether the imports run at import time, inside functions, under ``if TYPE_CHECKING:`` or through
``importlib.import_module`` (a sibling loaded by name); no module reading another graphbuf module's private
names (through an import statement or an ``importlib`` handle); production code never importing the tests or
the drill's test tasks.

The five cycles issue 19 listed (drill <-> padding_contract, refresh.bound -> buffers, emulator recording ->
replay and slots -> codegen, adapter patch <-> plugin) are gone; none is allowed, of any kind."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


#: Edge kinds of :func:`_all_imports`: at import time, inside a function or method, only for type checkers,
#: through ``importlib.import_module`` / ``__import__`` with a literal (or ``f"{__package__}.x"``) name.
KINDS = ("top", "function", "type", "importlib")


#: Compiled modules (``graphbuf/buffers/_native.c``, ``_staged.c``): ``from graphbuf.buffers import _native``
#: imports that module, not the package's ``__init__``.
EXTENSIONS = {
    ".".join(["graphbuf", *f.relative_to(ROOTS["graphbuf"]).with_suffix("").parts])
    for f in ROOTS["graphbuf"].rglob("*.c")
}


def _resolve(name: str, path: Path, base: str, level: int, names: list[str]) -> set[str]:
    if level:
        pkg = _package(name, path).split(".")
        base = ".".join(pkg[: len(pkg) - level + 1] + ([base] if base else []))
    return {f"{base}.{a}" if f"{base}.{a}" in MODULES or f"{base}.{a}" in EXTENSIONS else base for a in names}


def _literal_module(node: ast.expr, package: str) -> str | None:
    """The module named by an ``import_module`` argument: a string, or ``f"{__package__}.x"``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                text += part.value
            elif (
                isinstance(part, ast.FormattedValue)
                and isinstance(part.value, ast.Name)
                and part.value.id == "__package__"
            ):
                text += package
            else:
                return None
        return text
    return None


def _is_import_call(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
    )


def _all_imports(name: str, path: Path) -> dict[tuple[str, str], int]:
    """Every graphbuf module ``name`` imports, by kind: ``{(module, kind): first line}``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _package(name, path)
    found: dict[tuple[str, str], int] = {}

    def add(mods: set[str], kind: str, line: int) -> None:
        for m in mods:
            if m in MODULES and m != name:
                found.setdefault((m, kind), line)

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, "type")
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "type" if kind == "type" else "function"
        if isinstance(node, ast.Import):
            add({a.name for a in node.names}, kind, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            add(_resolve(name, path, node.module or "", node.level, [a.name for a in node.names]), kind,
                node.lineno)  # fmt: skip
        elif isinstance(node, ast.Call) and _is_import_call(node) and node.args:
            target = _literal_module(node.args[0], package)
            if target is not None:
                add({target}, "importlib", node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    visit(tree, "top")
    return found


IMPORTS = {name: _all_imports(name, path) for name, path in MODULES.items()}
EDGES: dict[tuple[str, str], tuple[str, int]] = {}  # (importer, imported) -> (kind, line) of the first
for _importer, _found in IMPORTS.items():
    for (_imported, _kind), _line in sorted(_found.items(), key=lambda kv: KINDS.index(kv[0][1])):
        EDGES.setdefault((_importer, _imported), (_kind, _line))


def _reaches(start: str, goal: str, edges: set[tuple[str, str]]) -> list[str] | None:
    """A path ``start -> ... -> goal`` over ``edges`` (None if there is none)."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
    prev: dict[str, str] = {start: start}
    todo = [start]
    while todo:
        m = todo.pop()
        for n in succ.get(m, []):
            if n not in prev:
                prev[n] = m
                if n == goal:
                    path = [n]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1]
                todo.append(n)
    return None


def _describe(path: list[str]) -> str:
    hops = []
    for a, b in itertools.pairwise(path):
        kind, line = EDGES[(a, b)]
        hops.append(f"{a} -[{kind}, line {line}]-> ")
    return "".join(hops) + path[-1]


def _unknown_cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """A cycle over ``edges`` (None if none)."""
    for a, b in sorted(edges):
        back = _reaches(b, a, edges)
        if back is not None:
            return [a, *back]
    return None


def test_no_import_cycle_of_any_kind() -> None:
    """No cycle over every import kind (top, function, TYPE_CHECKING, importlib)."""
    cycle = _unknown_cycle(set(EDGES))
    assert cycle is None, f"import cycle: {_describe(cycle)}"


def test_a_new_function_level_cycle_is_caught() -> None:
    """A lazy import closing a cycle (errors -> spec, spec importing errors at top level) fails the check."""
    assert _unknown_cycle({*EDGES, ("graphbuf.errors", "graphbuf.spec.models")}) is not None


def test_the_import_graph_sees_every_kind(tmp_path: Path) -> None:
    """The collector finds each kind (guards the checks above against going blind): the tree's own edges for
    top, function and TYPE_CHECKING imports; a planted module for importlib (the tree has none left)."""
    kinds = {kind for kind, _ in EDGES.values()}
    assert {"top", "function", "type"} <= kinds, kinds
    assert EDGES[("graphbuf.graphs.runner", "graphbuf.buffers.slab")][0] == "top"
    planted = tmp_path / "planted.py"
    planted.write_text(
        'import importlib\n\n\ndef f():\n    importlib.import_module(f"{__package__}.buffers")\n'
        '    return __import__("graphbuf.errors")\n'
    )
    found = _all_imports("graphbuf.planted", planted)
    assert {("graphbuf.buffers", "importlib"), ("graphbuf.errors", "importlib")} <= set(found), found
    assert {"graphbuf.buffers._native", "graphbuf.buffers._staged"} == EXTENSIONS
    assert "graphbuf.buffers" not in {m for m, _ in IMPORTS["graphbuf.buffers.native"]}


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
    assert graph["graphbuf.buffers.validate"] >= {"graphbuf.buffers.layout"}
    readers = {m for m, deps in graph.items() if "graphbuf.buffers.native" in deps}
    assert readers == {"graphbuf.buffers.backend"}  # the backend is chosen in one place


def _private_reads(name: str, path: Path) -> list[str]:
    """``x._y`` and ``getattr(x, "_y")`` where ``x`` is bound by a graphbuf import in that file (a module or
    a symbol; ``import``, ``from ... import`` or ``x = importlib.import_module("graphbuf...")``), and
    private names imported."""
    bad = []
    package = _package(name, path)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and _is_import_call(node.value)
            and node.value.args
        ):
            target = _literal_module(node.value.args[0], package) or ""
            if target.startswith("graphbuf"):
                imported.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("graphbuf")
            )
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("graphbuf")):
            imported.update(a.asname or a.name for a in node.names)
            if any(a.name.startswith("_") for a in node.names):
                bad.append(f"{shown}:{node.lineno}: imports a private name")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                bad.append(f"{shown}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
        ):
            root = node.args[0]
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                bad.append(f"{shown}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_module_reads_another_modules_private_names() -> None:
    bad = [b for name, path in MODULES.items() for b in _private_reads(name, path)]
    # the one private import allowed: the native kernel's loader importing the compiled module itself
    bad = [b for b in bad if not b.startswith("graphbuf/buffers/native.py:")]
    assert not bad, "\n".join(bad)


def test_private_reads_are_seen_through_importlib_and_getattr(tmp_path: Path) -> None:
    """The check above sees a private read through an ``importlib`` handle and through ``getattr``."""
    f = tmp_path / "mod.py"
    f.write_text(
        "import importlib\n"
        "from graphbuf import buffers\n"
        "def f():\n"
        "    sib = importlib.import_module(f'{__package__}.patch')\n"
        "    errs = importlib.import_module('graphbuf.errors')\n"
        "    other = importlib.import_module('json')\n"
        "    return sib._state, errs._x, getattr(buffers, '_hidden'), other._y, sib.public\n",
        encoding="utf-8",
    )
    found = [b.split(": ", 1)[1] for b in _private_reads("graphbuf.adapters.vllm_ascend.mod", f)]
    assert found == ["sib._state", "errs._x", "getattr(buffers, '_hidden')"], found


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


#: Modules whose tests live in a file not named for them (issue 19 §4): the file, the name it must use, why.
TESTED_IN: dict[str, tuple[str, str, str]] = {
    "graphbuf/__main__.py": ("tests/unit/test_cli.py", "python -m graphbuf", "it is `cli.main`"),
    "graphbuf/testing_steps.py": (
        "tests/unit/buffers/test_staged_state_machine.py",
        "from graphbuf.testing import DecodeBatch, next_step, stage_writes",
        "`graphbuf.testing`'s step sequences; the staged state machine draws and checks them",
    ),
    "adapters/vllm_ascend/kernels/attention.py": (
        "tests/unit/adapters/bindings/test_large_head.py",
        "from graphbuf.adapters.vllm_ascend.kernels import attention as kernels",
        "the kernels the large-head attention calls, tested through it and alone",
    ),
    "adapters/vllm_ascend/glue/resolve.py": (
        "tests/unit/adapters/glue/test_routing.py",
        "import graphbuf.adapters.vllm_ascend.glue.resolve as resolve",
        "what a routed call resolves, tested with the routing",
    ),
    "adapters/vllm_ascend/spec/strategies.py": (
        "tests/unit/test_testing.py",
        "from graphbuf.adapters.vllm_ascend.spec.strategies import vllm_decode_batch",
        "a `graphbuf.testing` strategy, tested with the others",
    ),
    "adapters/vllm_ascend/glue/upstream.py": (
        "tests/unit/adapters/glue/test_plugin.py",
        "upstream.py",
        "the upstream surface the plugin checks at activation",
    ),
    "adapters/vllm_ascend/glue/activation.py": (
        "tests/unit/adapters/glue/test_updatable.py",
        "import graphbuf.adapters.vllm_ascend.glue.activation as activation",
        "the activation decision (mechanism, large-head owner, its log line), tested with the mechanisms",
    ),
}
TEST_ROOTS = {
    REPO / "graphbuf": REPO / "tests" / "unit",
    REPO / "adapters" / "vllm_ascend": REPO / "tests" / "unit" / "adapters",
}


def _test_file(root: Path, tests: Path, f: Path) -> Path | None:
    """The test file named for module ``f``: ``test_<module>.py`` (or ``test_<module>_*.py``) in the mirrored
    folder, or ``test_<package>.py`` one folder up for a subpackage tested as a whole."""
    rel = f.relative_to(root)
    here = tests / rel.parent
    found = sorted([*here.glob(f"test_{rel.stem}.py"), *here.glob(f"test_{rel.stem}_*.py")])
    if not found and rel.parent != Path("."):
        found = sorted((tests / rel.parent.parent).glob(f"test_{rel.parent.name}.py"))
    return found[0] if found else None


def test_every_module_has_a_test_file_named_for_it() -> None:
    missing = []
    for root, tests in TEST_ROOTS.items():
        for f in sorted(root.rglob("*.py")):
            key = str(f.relative_to(REPO))
            if f.name != "__init__.py" and key not in TESTED_IN and _test_file(root, tests, f) is None:
                missing.append(key)
    assert not missing, f"modules without tests/unit/<package>/test_<module>.py: {missing}"


def test_the_mirror_rule_finds_module_package_and_missing_tests(tmp_path: Path) -> None:
    root, tests = tmp_path / "pkg", tmp_path / "tests"
    for f in ("pkg/a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/other/d.py", "tests/test_a_pins.py",
              "tests/test_sub.py", "tests/other/test_x.py"):  # fmt: skip
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    assert _test_file(root, tests, root / "a.py") == tests / "test_a_pins.py"
    assert _test_file(root, tests, root / "b.py") is None
    assert _test_file(root, tests, root / "sub" / "c.py") == tests / "test_sub.py"
    assert _test_file(root, tests, root / "other" / "d.py") is None


def test_each_module_tested_elsewhere_is_used_by_that_file_and_has_no_own_file() -> None:
    for module, (test, uses, why) in TESTED_IN.items():
        assert (REPO / module).is_file(), f"{module} is gone; drop it from TESTED_IN"
        assert why and uses in (REPO / test).read_text(encoding="utf-8"), (module, test, uses)
        root = next(r for r in TEST_ROOTS if (REPO / module).is_relative_to(r))
        own = _test_file(root, TEST_ROOTS[root], REPO / module)
        assert own is None, f"{module} has its own test file {own}; drop it from TESTED_IN"


ADAPTER_ROLES = {"glue", "bindings", "kernels", "spec"}
#: Roles a role may import (issue 23 §5): metadata and kernels depend on no glue or binding.
ROLE_IMPORTS = {
    "glue": {"glue", "bindings", "spec"},
    "bindings": {"bindings", "kernels", "spec", "glue"},
    "kernels": {"kernels"},
    "spec": {"spec"},
}


def test_the_adapter_s_modules_sit_in_role_folders_that_import_only_what_their_role_may() -> None:
    prefix = "graphbuf.adapters.vllm_ascend"
    for name, path in MODULES.items():
        if not name.startswith(prefix + "."):
            continue
        role = name[len(prefix) + 1 :].split(".")[0]
        assert role in ADAPTER_ROLES, f"{path}: outside the role folders {sorted(ADAPTER_ROLES)}"
        if path.name == "__init__.py":
            assert not IMPORTS[name], f"{path}: a role package imports nothing"
            continue
        for target, _kind in IMPORTS[name]:
            if target.startswith(prefix + "."):
                other = target[len(prefix) + 1 :].split(".")[0]
                assert other in ROLE_IMPORTS[role], f"{name} ({role}) imports {target} ({other})"


def test_test_files_have_unique_names() -> None:
    """pytest imports test files by their base name (no ``__init__.py`` in tests/): two files of one name in
    different folders stop the whole collection."""
    seen: dict[str, Path] = {}
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        assert f.name not in seen, f"{f.relative_to(REPO)} and {seen[f.name].relative_to(REPO)} share a name"
        seen[f.name] = f

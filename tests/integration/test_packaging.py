"""The distribution: every package of the source tree is declared, so a wheel holds the whole library."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _declared() -> tuple[list[str], dict[str, str]]:
    """[tool.setuptools] packages and package-dir (by pattern: tomllib is 3.11+, we support 3.10)."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    listed = re.search(r"^packages = \[(.*?)\]$", text, re.M | re.S)
    assert listed, "pyproject.toml: [tool.setuptools] packages = [...] not found"
    packages = re.findall(r'"([^"]+)"', listed.group(1))
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:\n\[|\Z)", text, re.M | re.S)
    package_dir = dict(re.findall(r'^"([^"]+)" = "([^"]+)"$', section.group(1), re.M)) if section else {}
    return packages, package_dir


def _source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools finds ``package``: the longest package-dir prefix, then the dotted rest."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return REPO.joinpath(package_dir[prefix], *parts[n:])
    return REPO.joinpath(*parts)


def test_every_package_directory_is_declared() -> None:
    packages, package_dir = _declared()
    declared_dirs = {_source_dir(p, package_dir).resolve() for p in packages}
    for p in packages:
        assert (_source_dir(p, package_dir) / "__init__.py").is_file() or p == "graphbuf.specs", p
    roots = {_source_dir(p, package_dir).resolve() for p in packages if "." not in p}
    roots |= {(REPO / d).resolve() for d in package_dir.values()}
    found = {
        init.parent.resolve()
        for root in roots
        for init in root.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = sorted(str(d.relative_to(REPO)) for d in found - declared_dirs)
    assert not missing, f"package directories not in pyproject's [tool.setuptools] packages: {missing}"

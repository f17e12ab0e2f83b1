"""The planted-bug spec (``examples/planted/``) written with one task factory, for the drill's tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from planted_tasks import PLANTED_SPEC

#: The ``--allow-factory`` module of the planted tasks.
ALLOW = ("planted_tasks",)


def planted(tmp_path: Path, factory: str) -> Path:
    """``planted.yaml`` under ``tmp_path`` whose one task is ``planted_tasks:<factory>``."""
    doc: dict[str, Any] = copy.deepcopy(PLANTED_SPEC)
    doc["tasks"] = [{"name": "planted", "factory": f"planted_tasks:{factory}"}]
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path

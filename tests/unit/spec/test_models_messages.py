"""Issue 33 §2: a spec error names the field, the value and the allowed forms in one line, for every field
whose type is a union (nullable included) or a constrained string; found by walking the schema's models."""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from graphbuf import GraphSpec, SpecError
from graphbuf.spec.models import load_spec

BASE: dict[str, Any] = {
    "version": 1,
    "name": "messages",
    "constants": {"n": 4},
    "capture": {"tokens_per_request": 1, "sizes": [2, 4], "max_requests": "n"},
    "buffers": {"lens": {"dtype": "int32", "rows": "requests", "cols": 2, "pad": 0, "min": 0, "max": 9}},
    "workspaces": {"ws": {"dtype": "float32", "shape": ["requests", 8]}},
    "tasks": [{"name": "t", "factory": "no_such_module:factory", "group": None}],
}
BAD_VALUES = (1.5, "no-such-form", {"no_such_key": 1})


def _arms(ann: Any) -> tuple[Any, ...]:
    if get_origin(ann) in (Union, types.UnionType):
        return get_args(ann)
    return (ann,)


def _base(ann: Any) -> Any:
    return get_args(ann)[0] if hasattr(ann, "__metadata__") else ann


def _choice(ann: Any) -> bool:
    """A union (a nullable one included) or a literal: the fields §2 is about."""
    return len(_arms(ann)) > 1 or get_origin(_base(ann)) is Literal


def _fields(model: type[BaseModel], doc: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    """Every path in ``doc`` (an instance of ``model``'s shape) whose annotation is a choice."""
    for name, info in model.model_fields.items():
        yield from _walk(info.annotation, doc.get(name) if isinstance(doc, dict) else None, (*path, name))


def _walk(ann: Any, doc: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    if _choice(ann):
        yield path
    for arm in map(_base, _arms(ann)):
        if isinstance(arm, type) and issubclass(arm, BaseModel) and isinstance(doc, dict):
            yield from _fields(arm, doc, path)
        elif get_origin(arm) is dict and isinstance(doc, dict) and doc:
            key = next(iter(doc))
            yield from _walk(get_args(arm)[1], doc[key], (*path, key))
        elif get_origin(arm) is list and isinstance(doc, list) and doc:
            yield from _walk(get_args(arm)[0], doc[0], (*path, 0))


def _shown(path: tuple[str | int, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


CHOICE_FIELDS = sorted(set(_fields(GraphSpec, BASE, ())), key=str)


def test_the_walk_finds_every_union_and_literal_field() -> None:
    shown = {_shown(p) for p in CHOICE_FIELDS}
    assert {"version", "constants.n", "capture.tokens_per_request", "capture.sizes", "capture.max_requests",
            "buffers.lens.dtype", "buffers.lens.rows", "buffers.lens.cols", "buffers.lens.pad",
            "buffers.lens.overflow", "buffers.lens.min", "buffers.lens.max", "workspaces.ws.dtype",
            "workspaces.ws.shape[0]", "tasks[0].group"} <= shown, shown  # fmt: skip


@pytest.mark.parametrize("path", CHOICE_FIELDS, ids=_shown)
def test_a_wrong_value_is_one_line_naming_the_field_the_value_and_the_allowed_forms(
    path: tuple[str | int, ...],
) -> None:
    for bad in BAD_VALUES:
        doc = copy.deepcopy(BASE)
        target: Any = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = bad
        with pytest.raises(SpecError) as info:  # the task's factory is unregistered: never a valid spec
            GraphSpec.model_validate(doc, source="s.yaml")
        lines = str(info.value).splitlines()
        if any(f"s.yaml: {_shown(path)}." in line for line in lines):
            continue  # a mapping picked a model arm: its own fields are named, one line each
        if not any(f"got {bad!r}; allowed: " in line for line in lines):
            continue  # the schema accepts this value here (a later check may not): try the next
        assert len(lines) == 1, lines  # one line, and only the schema stage ran
        assert lines[0].startswith(f"s.yaml: {_shown(path)}: got {bad!r}; allowed: "), lines
        return
    pytest.fail(f"{_shown(path)}: no bad value was refused on its own line")


def test_the_reported_cases(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["buffers"]["lens"]["pad"] = "zero"
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(doc, source="s.yaml")
    assert str(info.value) == (
        "s.yaml: buffers.lens.pad: got 'zero'; allowed: true or false, an integer, a number or 'repeat_last'"
    )
    path = tmp_path / "huge.yaml"
    path.write_text("version: 1\nname: x\nconstants: {n: 12345678901234567890123456}\ncapture: {sizes: [1]}\n"
                    "buffers: {a: {dtype: int32, rows: 1}}\n")  # fmt: skip
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (line,) = str(info.value).splitlines()
    assert "constants.n: " in line and "12345678901234567890123456" in line, line
    assert "allowed: an integer within ±(2**63 - 1), an expression over constants (a string) or null" in line
    assert "valid string" not in line

"""``graphbuf drill SPEC --model tiny --replay FILE``: the scenario file is checked like the attention drill's
batch files (issue 35 §5): bounded (file size, nesting, a step budget, limits.max_bytes), every field typed,
and every error a BatchFileError naming the file, the field and the value as given. One case per class of
the hostile files that ended in a traceback, ran without bound, or blamed the command line."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from graphbuf.drill.model.replay_file import MAX_FILE_BYTES, load_model_replay
from graphbuf.errors import BatchFileError
from graphbuf.spec.models import GraphSpec, load_spec

FORMAT = "graphbuf-model-drill/2"
MODELS = {"tiny": "gemma4-tiny-model"}
FAULTS = ("scale", "stale_seq_len")
DTYPES = ("float32", "bfloat16")


def served(spec: str, model: str) -> GraphSpec:
    load_spec(spec)  # the file's spec must load
    return load_spec(MODELS[model])


VALID: dict[str, Any] = {
    "format": FORMAT,
    "spec": "gemma4-31b-it-mtp",
    "model": "tiny",
    "device": "cpu",
    "model_seed": 0,
    "faults": [],
    "dtype": "float32",
    "scenario": {
        "requests": [
            {"prompt": [1, 2, 3, 4], "arrival": 0, "max_new": 16},
            {"prompt": [5, 6], "arrival": 2, "max_new": 20},
        ],
        "mtp_off_every": 4,
        "dp_pad_every": 3,
    },
    "failure": {"what": "anything"},
}


def load(path: Path) -> dict[str, Any]:
    return load_model_replay(
        path, format_name=FORMAT, models=MODELS, served=served, dtypes=DTYPES, faults=FAULTS
    )


def write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "scenario.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return path


def edited(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(VALID)
    for dotted, value in changes.items():
        *where, last = dotted.split("__")
        node = doc
        for key in where:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value
    return doc


_DELETE = object()
_REQ = "scenario__requests__0"


def test_a_valid_file_loads_with_its_fields_as_given(tmp_path: Path) -> None:
    doc = load(write(tmp_path, VALID))
    assert doc["scenario"]["requests"][1] == {"prompt": [5, 6], "arrival": 2, "max_new": 20}
    assert (doc["model"], doc["device"], doc["dtype"], doc["model_seed"]) == ("tiny", "cpu", "float32", 0)


HOSTILE = [
    (
        "model_seed 2**80",
        edited(model_seed=2**80),
        r"model_seed: <integer of 81 bits>: allowed: an integer in",
    ),
    ("model_seed true", edited(model_seed=True), r"model_seed: true: allowed"),
    (
        "token 10**30",
        edited(**{f"{_REQ}__prompt__1": 10**30}),
        r"requests\[0\]\.prompt\[1\]: <integer of 100 bits>",
    ),
    (
        "token -5",
        edited(**{f"{_REQ}__prompt__2": -5}),
        r"requests\[0\]\.prompt\[2\]: -5: allowed: an integer in \[0, 511\]",
    ),
    ("token 1.5", edited(**{f"{_REQ}__prompt__0": 1.5}), r"requests\[0\]\.prompt\[0\]: 1\.5: allowed"),
    ("faults [[1]]", edited(faults=[[1]]), r"faults\[0\]: \[1\]: allowed: a string"),
    (
        "unknown fault",
        edited(faults=["nope"]),
        r"faults\[0\]: \"nope\": unknown; allowed: scale, stale_seq_len",
    ),
    ("device shell", edited(device="cpu; rm -rf /"), r"device: \"cpu; rm -rf /\": "),
    (
        "request without arrival",
        edited(**{f"{_REQ}__arrival": _DELETE}),
        r"requests\[0\]\.arrival: null: missing",
    ),
    (
        "empty prompt",
        edited(**{f"{_REQ}__prompt": []}),
        r"requests\[0\]\.prompt: \"0 tokens\": allowed: a list of 1 to",
    ),
    ("100k-token prompt", edited(**{f"{_REQ}__prompt": [1] * 100_000}), r"prompt: \"100000 tokens\""),
    (
        "max_new -3",
        edited(**{f"{_REQ}__max_new": -3}),
        r"requests\[0\]\.max_new: -3: allowed: an integer in \[1, ",
    ),
    ("max_new 1e9", edited(**{f"{_REQ}__max_new": 10**9}), r"max_new: 1000000000: allowed"),
    ("max_new 1e9 float", edited(**{f"{_REQ}__max_new": 1e9}), r"max_new: 1000000000\.0: allowed"),
    (
        "1000 requests",
        edited(scenario__requests=[VALID["scenario"]["requests"][0]] * 1000),
        r"scenario\.requests: \"1000 requests\": allowed: 1 to 64",
    ),
    ("arrival 1e9", edited(**{f"{_REQ}__arrival": 10**9}), r"arrival: 1000000000: allowed"),
    ("model huge", edited(model="huge"), r"model: \"huge\": unknown; allowed: tiny"),
    ("dtype", edited(dtype="float64"), r"dtype: \"float64\": unknown; allowed: bfloat16, float32"),
    (
        "spec missing",
        edited(spec="/nowhere/gemma4-tiny-model.yaml"),
        r"spec: \"/nowhere/gemma4-tiny-model.yaml\": cannot be served",
    ),
    ("scenario list", edited(scenario=[]), r"scenario: \[\]: allowed"),
    ("unknown request field", edited(**{f"{_REQ}__tokens": 3}), r"requests\[0\]\.tokens: 3: unknown field"),
    ("format", edited(format="graphbuf-model-drill/0"), r"format: \"graphbuf-model-drill/0\": not a saved"),
    ("mtp_off_every -1", edited(scenario__mtp_off_every=-1), r"scenario\.mtp_off_every: -1: allowed"),
]


@pytest.mark.parametrize(("doc", "match"), [pytest.param(d, m, id=i) for i, d, m in HOSTILE])
def test_a_hostile_scenario_file_is_a_batch_file_error_naming_file_field_and_value(
    tmp_path: Path, doc: dict[str, Any], match: str
) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(BatchFileError, match=match) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: ")


def test_device_cuda_without_cuda_names_the_file(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = write(tmp_path, edited(device="cuda"))
    with pytest.raises(BatchFileError, match=rf"^{path}: device: \"cuda\": .*(cuda|CUDA)"):
        load(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, r"JSON nested too deep"),
        ('{"model_seed": NaN}', r"NaN is not a number a scenario file may hold"),
        ("[1, 2]", r"a JSON object expected"),
        ("{", r"not a saved model-drill scenario"),
    ],
    ids=["100k-deep", "nan", "list", "truncated"],
)
def test_unreadable_json_is_a_batch_file_error(tmp_path: Path, text: str, match: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(BatchFileError, match=match):
        load(path)


def test_a_file_over_the_size_bound_is_not_read(tmp_path: Path) -> None:
    path = write(tmp_path, " " * (MAX_FILE_BYTES + 1))
    with pytest.raises(BatchFileError, match=rf"{MAX_FILE_BYTES + 1} bytes, above"):
        load(path)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError, match=r"--replay .*absent\.json: no such file"):
        load(tmp_path / "absent.json")


def test_the_step_budget_bounds_a_scenario_of_allowed_requests(tmp_path: Path) -> None:
    many = [{"prompt": [1], "arrival": 2000, "max_new": 50}] * 64
    path = write(tmp_path, edited(scenario__requests=many))
    with pytest.raises(BatchFileError, match=r"serving steps .* above the budget of 2048"):
        load(path)

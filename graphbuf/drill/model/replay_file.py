"""A saved model-drill scenario (``graphbuf drill SPEC --model tiny --replay FILE``), read and checked before
anything is built, as the attention drill checks its batch files.

Every field is typed and bounded: the file's size (:data:`MAX_FILE_BYTES`) and nesting, the model and dtype
by name, the device by what this machine has, the seeds, the planted faults, and the scenario against the
served spec (tokens in ``[0, vocab_size)``, a non-empty prompt that leaves room for ``max_new`` tokens and
the speculative ones within ``max_model_len``), against a step budget (:data:`STEP_BUDGET`, and at most
:data:`MAX_REQUESTS` requests) and against ``limits.max_bytes`` (the logits rows the serving keeps per
generated token). Every error is a :class:`~graphbuf.errors.BatchFileError` naming the file, the field and
the value as given.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from graphbuf.devices import resolve_device
from graphbuf.errors import BatchFileError, GraphbufError
from graphbuf.planning.planner import plan
from graphbuf.spec.models import GraphSpec

__all__ = ["MAX_FILE_BYTES", "MAX_REQUESTS", "SEED_MAX", "STEP_BUDGET", "load_model_replay"]

#: The largest file read: a scenario the drill can serve is a few kilobytes.
MAX_FILE_BYTES = 1 << 20
#: Serving steps a scenario may take at most, counted as if every step generated one token: the latest
#: arrival, one prefill per request, and every token it generates (the drill's own scenarios take < 250).
STEP_BUDGET = 2048
#: Requests a scenario may hold.
MAX_REQUESTS = 64
#: The largest model seed (the assistant's weights come from ``model_seed + 1``).
SEED_MAX = 2**63 - 2
#: Bytes per logits value the serving keeps for each generated token (float32).
_LOGIT_BYTES = 4


def _shown(value: Any, limit: int = 60) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<integer of {value.bit_length()} bits>"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class _File:
    """One replay file's errors: ``path: field: value: problem``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, field: str, value: Any, problem: str) -> BatchFileError:
        return BatchFileError(f"{self.path}: {field}: {_shown(value)}: {problem}")

    def integer(self, field: str, value: Any, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.error(field, value, f"allowed: an integer in [{lo}, {hi}]")
        return value

    def text(self, field: str, value: Any, allowed: Collection[str] | None = None) -> str:
        if not isinstance(value, str) or len(value) > 4096:
            raise self.error(field, value, "allowed: a string (at most 4096 characters)")
        if allowed is not None and value not in allowed:
            raise self.error(field, value, f"unknown; allowed: {', '.join(sorted(allowed))}")
        return value


def _read(f: _File) -> dict[str, Any]:
    try:
        size = f.path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BatchFileError(
                f"{f.path}: {size} bytes, above the {MAX_FILE_BYTES} a scenario file may hold"
            )
        text = f.path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BatchFileError(f"--replay {f.path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"{f.path}: cannot read a saved model-drill scenario: {exc}") from None
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise BatchFileError(f"{f.path}: not a saved model-drill scenario: JSON nested too deep") from None
    except ValueError as exc:
        raise BatchFileError(f"{f.path}: not a saved model-drill scenario: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise BatchFileError(f"{f.path}: not a saved model-drill scenario: a JSON object expected")
    return doc


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a scenario file may hold")


def load_model_replay(
    path: str | Path,
    *,
    format_name: str,
    models: Mapping[str, str],
    served: Callable[[str, str], GraphSpec],
    dtypes: Collection[str],
    faults: Collection[str],
) -> dict[str, Any]:
    """The scenario file at ``path``, checked (module docstring): its fields as the drill reads them.

    ``format_name``: the ``format`` it must declare; ``models``: the ``--model`` names; ``served(spec,
    model)``: the spec the drill serves for the file's spec and model (its errors become the file's);
    ``dtypes`` / ``faults``: the names a file may give. Raises :class:`BatchFileError` only."""
    f = _File(Path(path))
    doc = _read(f)
    if doc.get("format") != format_name:
        raise f.error(
            "format", doc.get("format"), f"not a saved model-drill scenario; expected {format_name!r}"
        )
    model = f.text("model", doc.get("model"), models)
    spec_name = f.text("spec", doc.get("spec"))
    try:
        spec = served(spec_name, model)
        constants = plan(spec, overrides={"num_blocks": 2})
    except GraphbufError as exc:
        raise f.error("spec", spec_name, f"cannot be served with model {model!r}: {exc}") from None
    device = f.text("device", doc.get("device"))
    try:
        resolve_device(device, "the drill")
    except GraphbufError as exc:
        raise f.error("device", device, str(exc)) from None
    fault_list = doc.get("faults")
    if not isinstance(fault_list, list) or len(fault_list) > len(faults):
        raise f.error("faults", fault_list, f"allowed: a list of distinct names from {sorted(faults)}")
    for i, name in enumerate(fault_list):
        f.text(f"faults[{i}]", name, faults)
    if len(set(fault_list)) != len(fault_list):
        raise f.error("faults", fault_list, "a fault is named twice")
    return {
        "format": format_name,
        "spec": spec_name,
        "model": model,
        "device": device,
        "model_seed": f.integer("model_seed", doc.get("model_seed"), 0, SEED_MAX),
        "faults": list(fault_list),
        "dtype": f.text("dtype", doc.get("dtype"), dtypes),
        "scenario": _scenario(f, doc.get("scenario"), constants.constants, constants.max_bytes),
    }


def _scenario(f: _File, doc: Any, constants: Mapping[str, Any], max_bytes: int) -> dict[str, Any]:
    """The scenario checked against the served spec, the step budget and ``limits.max_bytes``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise f.error("scenario", doc, 'allowed: {"requests": [...], "mtp_off_every": n, "dp_pad_every": n}')
    unknown = sorted(set(doc) - {"requests", "mtp_off_every", "dp_pad_every"})
    if unknown:
        raise f.error(f"scenario.{unknown[0]}", doc[unknown[0]], "unknown field")
    requests = doc["requests"]
    if not 1 <= len(requests) <= MAX_REQUESTS:
        raise f.error("scenario.requests", f"{len(requests)} requests", f"allowed: 1 to {MAX_REQUESTS}")
    vocab, top = int(constants["vocab_size"]), int(constants["max_model_len"])
    k = int(constants.get("num_speculative_tokens", 0))
    checked = [_request(f, i, r, vocab, top, k) for i, r in enumerate(requests)]
    steps = max(r["arrival"] for r in checked) + sum(1 + r["max_new"] for r in checked)
    if steps > STEP_BUDGET:
        raise f.error(
            "scenario.requests", f"{len(checked)} requests",
            f"up to {steps} serving steps (latest arrival + one prefill and max_new tokens per request), "
            f"above the budget of {STEP_BUDGET}",
        )  # fmt: skip
    kept = sum(r["max_new"] * (1 + k) for r in checked) * vocab * _LOGIT_BYTES
    if kept > max_bytes:
        raise f.error(
            "scenario.requests", f"{len(checked)} requests",
            f"the serving would keep {kept} bytes of logits rows, above limits.max_bytes ({max_bytes})",
        )  # fmt: skip
    out: dict[str, Any] = {"requests": checked}
    for name, default in (("mtp_off_every", 4), ("dp_pad_every", 3)):
        out[name] = f.integer(f"scenario.{name}", doc.get(name, default), 0, STEP_BUDGET)
    return out


def _request(f: _File, i: int, doc: Any, vocab: int, top: int, k: int) -> dict[str, Any]:
    where = f"scenario.requests[{i}]"
    if not isinstance(doc, dict):
        raise f.error(where, doc, 'allowed: {"prompt": [token, ...], "arrival": step, "max_new": n}')
    for name in ("prompt", "arrival", "max_new"):
        if name not in doc:
            raise f.error(f"{where}.{name}", None, "missing")
    unknown = sorted(set(doc) - {"prompt", "arrival", "max_new"})
    if unknown:
        raise f.error(f"{where}.{unknown[0]}", doc[unknown[0]], "unknown field")
    prompt = doc["prompt"]
    longest = top - k - 1  # room for at least one generated token and the speculative ones
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= longest:
        shown = f"{len(prompt)} tokens" if isinstance(prompt, list) else prompt
        raise f.error(
            f"{where}.prompt", shown, f"allowed: a list of 1 to {longest} token ids (max_model_len {top})"
        )
    for j, token in enumerate(prompt):
        f.integer(f"{where}.prompt[{j}]", token, 0, vocab - 1)
    arrival = f.integer(f"{where}.arrival", doc["arrival"], 0, STEP_BUDGET)
    room = top - len(prompt) - k
    max_new = f.integer(f"{where}.max_new", doc["max_new"], 1, max(1, room))
    return {"prompt": list(prompt), "arrival": arrival, "max_new": max_new}

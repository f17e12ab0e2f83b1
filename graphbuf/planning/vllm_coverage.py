"""The coverage certificate of a vLLM serving configuration: every reachable uniform decode batch → the FULL
decode graph it replays, or eager.

The capture sizes are derived the way vLLM derives them (``VllmConfig._set_cudagraph_sizes`` of vLLM 0.32,
then ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``):

* the ceiling ``max_cudagraph_capture_size``: as configured; else on vllm-ascend (``platform="ascend"``,
  ``apply_config_platform_defaults``) ``min(max_num_seqs × q, 512)`` with ``q = 1 + num_speculative_tokens``;
  else vLLM's own ``min(max_num_seqs × q × 2, 512)`` plus the uniform decode sizes it appends;
* the list: as configured (deduplicated, at most ``max_num_batched_tokens``), else 1, 2, 4, multiples of 8
  below 256 and of 16 from 256 up to the ceiling (and ``max_num_batched_tokens`` when it fits under it);
* the ceiling is then truncated to the largest listed size (vLLM's "Truncating max_cudagraph_capture_size"
  warning), and with ``q > 1`` every size is rounded up to a multiple of ``q``, dropping those that pass the
  truncated ceiling.

A batch of ``r`` requests (``r × q`` tokens, ``r ≤ max_num_seqs``) is padded to the smallest capture size
that holds it (``CudagraphDispatcher``); it replays a FULL graph only when that size is a decode key, i.e. at
most ``max_num_seqs × q``. With data parallelism every rank pads to the busiest rank's size, and when one
rank's batch runs eagerly all ranks do. Pure arithmetic: no torch, no vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from graphbuf.errors import GraphbufError, SpecError
from graphbuf.planning.coverage import Batch, Coverage
from graphbuf.planning.sizes import propose_sizes

__all__ = [
    "ASCEND_MAX_CAPTURE_SIZE",
    "DecodeCertificate",
    "VllmServing",
    "certify",
    "certify_vllm_config",
    "derive_capture_sizes",
    "serving_from_compilation_config",
    "warn_uncovered",
]

ASCEND_MAX_CAPTURE_SIZE = 512
"""The cap of vllm-ascend's (and vLLM's) default ``max_cudagraph_capture_size``."""

PLATFORMS = ("ascend", "vllm")


@dataclass(frozen=True)
class VllmServing:
    """The vLLM settings that decide which uniform decode batches replay a FULL decode graph.

    ``capture_sizes`` / ``max_capture_size``: ``compilation_config.cudagraph_capture_sizes`` and
    ``max_cudagraph_capture_size`` as the user gave them (None: vLLM's default). ``max_num_batched_tokens``
    None: no token cap. ``platform``: ``"ascend"`` (vllm-ascend's default ceiling) or ``"vllm"``.
    """

    max_num_seqs: int
    num_speculative_tokens: int = 0
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_size: int = 1
    platform: str = "ascend"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "data_parallel_size"):
            _check_int(name, getattr(self, name), 1)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        for name in ("max_capture_size", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.capture_sizes is not None:
            if not self.capture_sizes:
                raise SpecError(
                    "cudagraph_capture_sizes: empty; vLLM needs at least one size with cuda graphs"
                )
            for i, size in enumerate(self.capture_sizes):
                _check_int(f"cudagraph_capture_sizes[{i}]", size, 1)
        if self.platform not in PLATFORMS:
            raise SpecError(f"platform {self.platform!r}: expected one of {', '.join(PLATFORMS)}")

    @property
    def query_len(self) -> int:
        """Tokens per request in a uniform decode batch: ``1 + num_speculative_tokens``."""
        return 1 + self.num_speculative_tokens

    def describe(self) -> str:
        parts = [f"max_num_seqs={self.max_num_seqs}", f"num_speculative_tokens={self.num_speculative_tokens}"]
        if self.capture_sizes is not None:
            parts.append(f"cudagraph_capture_sizes={list(self.capture_sizes)}")
        if self.max_capture_size is not None:
            parts.append(f"max_cudagraph_capture_size={self.max_capture_size}")
        if self.max_num_batched_tokens is not None:
            parts.append(f"max_num_batched_tokens={self.max_num_batched_tokens}")
        if self.data_parallel_size > 1:
            parts.append(f"data_parallel_size={self.data_parallel_size}")
        return ", ".join(parts) + f" ({self.platform})"


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecError(f"{name} = {value!r}: expected an integer >= {low}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _default_grid(ceiling: int) -> list[int]:
    sizes = [i for i in (1, 2, 4) if i <= ceiling]
    if ceiling >= 8:
        sizes += range(8, min(ceiling + 1, 256), 8)
    if ceiling >= 256:
        sizes += range(256, ceiling + 1, 16)
    return sizes


def _uniform_decode_sizes(serving: VllmServing, ceiling: int) -> list[int]:
    """vLLM's own default (no platform ceiling): the decode sizes it appends to the grid."""
    q, seqs = serving.query_len, serving.max_num_seqs
    if q == 1:
        return [seqs] if seqs <= ceiling else []
    top = min(seqs, ASCEND_MAX_CAPTURE_SIZE)
    counts = [n for n in (1, 2, 4) if n <= top] + list(range(8, min(top + 1, 256), 8))
    counts += list(range(256, top + 1, 16))
    return sorted({n * q for n in [*counts, top] if n * q <= ceiling})


def derive_capture_sizes(serving: VllmServing) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The capture sizes vLLM ends with for ``serving`` (ascending) and notes on what changed them.

    SpecError where vLLM itself raises: a configured ceiling that disagrees with configured sizes, or no
    size left after rounding to multiples of ``q``."""
    q, seqs, notes = serving.query_len, serving.max_num_seqs, []
    cap = serving.max_num_batched_tokens
    configured = serving.max_capture_size
    if configured is None and serving.capture_sizes is None and serving.platform == "ascend":
        configured = min(seqs * q, ASCEND_MAX_CAPTURE_SIZE)
        notes.append(
            f"vllm-ascend sets max_cudagraph_capture_size = min(max_num_seqs × {q}, 512) = {configured}"
        )
    ceiling, uniform = configured, []
    if ceiling is None:
        ceiling = min(seqs * q * 2, ASCEND_MAX_CAPTURE_SIZE)
        uniform = _uniform_decode_sizes(serving, ceiling)
    if cap is not None:
        ceiling = min(cap, ceiling)
    if serving.capture_sizes is not None:
        sizes = sorted({s for s in serving.capture_sizes if cap is None or s <= cap})
        if len(sizes) < len(set(serving.capture_sizes)):
            notes.append(f"sizes above max_num_batched_tokens={cap} dropped")
    else:
        sizes = _default_grid(ceiling)
        if cap is not None and cap <= ceiling:
            sizes.append(cap)
        sizes = sorted({*sizes, *(s for s in uniform if cap is None or s <= cap)})
    valid_max = sizes[-1] if sizes else 0
    if configured is not None and configured != valid_max:
        if serving.capture_sizes is not None:
            raise SpecError(
                f"max_cudagraph_capture_size={configured} disagrees with the largest cudagraph_capture_sizes "
                f"entry {valid_max} (vLLM raises on this)"
            )
        notes.append(f"vLLM truncates max_cudagraph_capture_size {configured} → {valid_max}")
    if q > 1 and sizes:
        rounded = sorted({_round_up(s, q) for s in sizes if _round_up(s, q) <= valid_max})
        if not rounded and q <= valid_max:
            rounded = [q]
        if not rounded:
            raise SpecError(
                f"no capture size is left after rounding to multiples of {q} (1 + num_speculative_tokens) "
                f"under max_cudagraph_capture_size {valid_max} (vLLM raises on this)"
            )
        if rounded != sizes:
            notes.append(f"sizes rounded up to multiples of {q}, those above {valid_max} dropped")
        sizes = rounded
    return tuple(sizes), tuple(notes)


@dataclass(frozen=True)
class DecodeCertificate:
    """Where every reachable uniform decode batch of ``serving`` runs; ``fix``: the
    ``cudagraph_capture_sizes`` that cover every batch (``graphbuf sizes``' answer), when some run eagerly."""

    serving: VllmServing
    capture_sizes: tuple[int, ...]
    notes: tuple[str, ...]
    coverage: Coverage
    fix: tuple[int, ...] | None

    @property
    def ok(self) -> bool:
        return not self.coverage.uncovered

    @property
    def eager_requests(self) -> tuple[int, ...]:
        return tuple(b.requests for b in self.coverage.uncovered)

    def warning(self) -> str | None:
        """One line naming the eager batch sizes and the capture sizes that would cover them; None if none."""
        if self.ok:
            return None
        q, eager = self.serving.query_len, self.coverage.uncovered
        largest = max((b.capture_size or 0 for b in self.coverage.batches), default=0)
        text = (
            f"graphbuf: uniform decode batches of {_ranges(self.eager_requests)} requests "
            f"({_ranges(tuple(b.tokens for b in eager), q)} tokens at {q} per request) run EAGERLY: the "
            f"largest FULL decode graph holds {largest} tokens "
            f"(cudagraph_capture_sizes {list(self.capture_sizes)}"
        )
        text += f"; {'; '.join(self.notes)})" if self.notes else ")"
        if self.serving.data_parallel_size > 1:
            text += "; with data parallelism every rank runs eagerly in a step where one rank's batch does"
        if self.fix is not None:
            text += f". cudagraph_capture_sizes={list(self.fix)} covers every batch (as `graphbuf sizes`)"
        return text

    def render(self) -> str:
        """The certificate as text: configuration, derived sizes, each run of batches → its graph."""
        lines = [f"vLLM configuration: {self.serving.describe()}"]
        lines.append(f"capture sizes: {list(self.capture_sizes)}")
        lines += [f"  note: {n}" for n in self.notes]
        q = self.serving.query_len
        for first, last, size in _runs(self.coverage.batches):
            where = "EAGER" if size is None else f"graph {size}"
            if first == last:
                span = f"{first} request{'s' if first > 1 else ''} ({first * q} tokens)"
            else:
                span = f"{first}–{last} requests ({first * q}–{last * q} tokens)"
            lines.append(f"  {span} → {where}")
        if self.serving.data_parallel_size > 1:
            lines.append(
                f"  data_parallel_size {self.serving.data_parallel_size}: a rank pads to the busiest rank's "
                "graph; if any rank runs eagerly, all do"
            )
        lines.append(self.coverage.summary())
        warning = self.warning()
        if warning is not None:
            lines.append(warning)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        s = self.serving
        return {
            "serving": {
                "max_num_seqs": s.max_num_seqs, "num_speculative_tokens": s.num_speculative_tokens,
                "capture_sizes": None if s.capture_sizes is None else list(s.capture_sizes),
                "max_capture_size": s.max_capture_size, "max_num_batched_tokens": s.max_num_batched_tokens,
                "data_parallel_size": s.data_parallel_size, "platform": s.platform,
            },
            "capture_sizes": list(self.capture_sizes),
            "notes": list(self.notes),
            "ok": self.ok,
            "eager_requests": list(self.eager_requests),
            "fix": None if self.fix is None else list(self.fix),
            "coverage": self.coverage.to_dict(),
        }  # fmt: skip


def _runs(batches: tuple[Batch, ...]) -> list[tuple[int, int, int | None]]:
    runs: list[tuple[int, int, int | None]] = []
    for b in batches:
        if runs and runs[-1][2] == b.capture_size:
            runs[-1] = (runs[-1][0], b.requests, b.capture_size)
        else:
            runs.append((b.requests, b.requests, b.capture_size))
    return runs


def _ranges(values: tuple[int, ...], step: int = 1) -> str:
    """Runs of ``values`` that go up by ``step`` as ``a–b``, joined by commas."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + step:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs)


def certify(serving: VllmServing, capture_sizes: tuple[int, ...] | None = None) -> DecodeCertificate:
    """The certificate of ``serving``. ``capture_sizes``: the final sizes of a running configuration (then
    nothing is derived); None derives them as vLLM does (:func:`derive_capture_sizes`)."""
    if capture_sizes is None:
        sizes, notes = derive_capture_sizes(serving)
    else:
        sizes, notes = tuple(sorted(set(capture_sizes))), ()
    q, seqs, cap = serving.query_len, serving.max_num_seqs, serving.max_num_batched_tokens
    top = seqs if cap is None else min(seqs, cap // q)
    batches = []
    for r in range(1, top + 1):
        tokens = r * q
        padded = next((s for s in sizes if s >= tokens), None)
        batches.append(Batch(r, tokens, padded if padded is not None and padded <= seqs * q else None))
    decode_sizes = tuple(s for s in sizes if q <= s <= seqs * q)
    cov = Coverage(q, decode_sizes, top, tuple(batches))  # reachable: max_num_seqs, token-capped
    fix = None
    if cov.uncovered and top >= 1:
        try:
            fix = propose_sizes(q, seqs, max_tokens=cap).sizes
        except GraphbufError:
            fix = None
    return DecodeCertificate(serving, sizes, notes, cov, fix)


def _read(obj: Any, name: str, default: Any = None) -> Any:
    return default if obj is None else getattr(obj, name, default)


def certify_vllm_config(vllm_config: Any) -> DecodeCertificate | None:
    """The certificate of a running ``VllmConfig`` (its final ``cudagraph_capture_sizes``), or None when its
    ``cudagraph_mode`` captures no FULL decode graph (then no decode batch replays one)."""
    cc = _read(vllm_config, "compilation_config")
    mode = _read(cc, "cudagraph_mode")
    decode_mode = mode.decode_mode() if hasattr(mode, "decode_mode") else mode
    if decode_mode is None or getattr(decode_mode, "name", str(decode_mode)) != "FULL":
        return None
    scheduler = _read(vllm_config, "scheduler_config")
    speculative = _read(vllm_config, "speculative_config")
    sizes = tuple(_read(cc, "cudagraph_capture_sizes", None) or ())
    serving = VllmServing(
        max_num_seqs=int(_read(scheduler, "max_num_seqs")),
        num_speculative_tokens=int(_read(speculative, "num_speculative_tokens", 0) or 0),
        max_num_batched_tokens=_read(scheduler, "max_num_batched_tokens"),
        data_parallel_size=int(_read(_read(vllm_config, "parallel_config"), "data_parallel_size", 1) or 1),
    )
    return certify(serving, sizes)


_certified: dict[tuple[Any, ...], DecodeCertificate | None] = {}


def _config_key(vllm_config: Any) -> tuple[Any, ...]:
    """The object and what the certificate reads of it (an id alone could be reused by a new object)."""
    cc, scheduler = _read(vllm_config, "compilation_config"), _read(vllm_config, "scheduler_config")
    return (
        id(vllm_config), repr(_read(cc, "cudagraph_mode")), repr(_read(cc, "cudagraph_capture_sizes")),
        _read(scheduler, "max_num_seqs"), _read(scheduler, "max_num_batched_tokens"),
        repr(_read(_read(vllm_config, "speculative_config"), "num_speculative_tokens")),
    )  # fmt: skip


def warn_uncovered(vllm_config: Any, logger: logging.Logger) -> DecodeCertificate | None:
    """The running configuration's certificate, computed once per configuration object; the first time,
    when a reachable decode batch runs eagerly, one warning on ``logger``. None: no FULL decode graphs, or a
    configuration it cannot read (then nothing is logged but one debug line: vLLM itself validates it)."""
    key = _config_key(vllm_config)
    if key in _certified:
        return _certified[key]
    try:
        cert = certify_vllm_config(vllm_config)
    except (GraphbufError, TypeError, ValueError) as exc:
        logger.debug("graphbuf: no coverage certificate for this vLLM configuration: %s", exc)
        cert = None
    _certified[key] = cert
    if cert is not None and not cert.ok:
        logger.warning("%s", cert.warning())
    return cert


def serving_from_compilation_config(text: str, **fields: Any) -> VllmServing:
    """A :class:`VllmServing` from vLLM's ``CompilationConfig`` as JSON (``cudagraph_capture_sizes``,
    ``max_cudagraph_capture_size``; other keys ignored) and the remaining ``fields``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"--compilation-config: invalid JSON at character {exc.pos}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise SpecError(f"--compilation-config: expected a JSON object, got {type(data).__name__}")
    sizes = data.get("cudagraph_capture_sizes")
    if sizes is not None and not isinstance(sizes, list):
        raise SpecError(f"--compilation-config: cudagraph_capture_sizes = {sizes!r}: expected a list")
    return VllmServing(
        capture_sizes=None if sizes is None else tuple(sizes),
        max_capture_size=data.get("max_cudagraph_capture_size"),
        **fields,
    )

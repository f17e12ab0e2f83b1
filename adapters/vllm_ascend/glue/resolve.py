"""The graphbuf-buffer side of the vllm-ascend patch: one ``StaticBuffers`` per routed KV group.

A routed group's attention reads its block table and KV lengths from graphbuf's slab, never from the
runner's tensors. The slab is planned from a variant of the shipped spec ``gemma4-31b-it-mtp``:

* only the buffers routed attention reads, ``block_table.full`` and ``seq_lens`` (group ``full``); the
  builder of one KV group sees neither the other group's tables nor a use for ``query_start_loc`` or the
  slot mappings, which vllm-ascend's own kernels keep reading from the runner;
* ``capture.sizes`` = ``compilation_config.cudagraph_capture_sizes``, the token counts vLLM captures;
* constants overridden from the vLLM config where it has them: ``max_model_len``, ``max_num_seqs``,
  ``max_num_batched_tokens``, ``num_speculative_tokens`` (0 without a speculative config), ``tp_size`` and
  the group's ``block_size``.

The variant is validated with those overrides, so an envelope the spec cannot hold (a capture size that is
not a multiple of ``1 + num_speculative_tokens``, or implies more requests than ``max_num_seqs``) raises
:class:`graphbuf.SpecError` before anything is allocated.

The routes a group's attention takes come from the same spec's task options (:func:`route_modes`): the
``decode_mode`` of its ``decode_task`` and the ``verify_mode`` / ``chunk_blocks`` of its ``verify_task``,
validated by the models of ``task_options`` (their defaults where the spec has no such task).

Invariants of :meth:`GroupBuffers.resolve`: it returns the views of one capture size, whose addresses never
change; after it, rows ``[:num_reqs]`` equal the runner's rows, every later row is 0 (``seq_lens`` 0: the
kernels return zeros for those rows and read no cache block past column 0), and a runner table wider than
the allocation raises :class:`graphbuf.WidthError` with no byte of the slab changed.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphbuf.buffers.slab import StaticBuffers
from graphbuf.errors import SpecError
from graphbuf.planning.vllm_coverage import warn_uncovered
from graphbuf.spec.factories import resolve_options
from graphbuf.spec.models import GraphSpec, load_spec

from ..bindings.routed_decode import RoutedDecodes
from ..spec.task_options import DECODE_TASK, VERIFY_TASK, DecodeTaskOptions, VerifyTaskOptions
from . import activation
from .upstream import Mechanism, read

logger = logging.getLogger(__name__)

__all__ = [
    "BLOCK_TABLE",
    "GROUP",
    "ROUTED_BUFFERS",
    "SEQ_LENS",
    "SPEC_NAME",
    "GroupBuffers",
    "RouteModes",
    "capture_sizes",
    "envelope_sizes",
    "group_buffers",
    "route_modes",
    "routed_spec",
    "spec_overrides",
]

SPEC_NAME = "gemma4-31b-it-mtp"
"""The shipped spec the routed groups' buffers are planned from."""

GROUP = "full"
"""The spec's KV group a routed vLLM KV group stands for."""

BLOCK_TABLE = f"block_table.{GROUP}"
SEQ_LENS = "seq_lens"
ROUTED_BUFFERS = (BLOCK_TABLE, SEQ_LENS)
"""The buffers routed attention reads: the only ones the variant spec declares."""

_CACHE_ATTR = "_graphbuf_group_buffers"

# spec constant -> (vLLM config section, attribute)
_CONFIG_CONSTANTS = (
    ("max_model_len", "model_config", "max_model_len"),
    ("max_num_seqs", "scheduler_config", "max_num_seqs"),
    ("max_num_batched_tokens", "scheduler_config", "max_num_batched_tokens"),
    ("tp_size", "parallel_config", "tensor_parallel_size"),
)


@functools.lru_cache(maxsize=1)
def _base_spec() -> GraphSpec:
    return load_spec(SPEC_NAME)  # a GraphSpec is immutable: one copy serves every builder


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_CONFIG = "vLLM config fields"
_BUILDER = "AscendAttentionMetadataBuilder instance fields"


def spec_overrides(vllm_config: Any, kv_cache_spec: Any) -> dict[str, int]:
    """Spec constants the vLLM config and the group's KV spec determine; non-int values are left to the
    spec, an absent field raises ``upstream.UpstreamError``. No speculative config means
    ``num_speculative_tokens`` 0."""
    overrides: dict[str, int] = {}
    for constant, section, attr in _CONFIG_CONSTANTS:
        value = _as_int(read(read(vllm_config, section, _CONFIG), attr, _CONFIG))
        if value is not None:
            overrides[constant] = value
    speculative = read(vllm_config, "speculative_config", _CONFIG)
    tokens = 0 if speculative is None else _as_int(read(speculative, "num_speculative_tokens", _CONFIG))
    if tokens is not None:
        overrides["num_speculative_tokens"] = tokens
    block_size = _as_int(read(kv_cache_spec, "block_size", "AttentionSpec fields"))
    if block_size is not None:
        overrides["block_size"] = block_size
    return overrides


def capture_sizes(vllm_config: Any) -> list[Any]:
    """``compilation_config.cudagraph_capture_sizes``; SpecError if it is missing or empty."""
    sizes = read(read(vllm_config, "compilation_config", _CONFIG), "cudagraph_capture_sizes", _CONFIG)
    if not sizes:
        raise SpecError(
            f"{SPEC_NAME}: capture.sizes: compilation_config.cudagraph_capture_sizes is {sizes!r}; routed "
            "large-head attention needs the token counts vLLM captures (a non-empty list of ints)"
        )
    return list(sizes)


def envelope_sizes(
    sizes: list[Any], tokens_per_request: int, constants: Mapping[str, Any]
) -> tuple[list[int], list[int]]:
    """Split vLLM's capture sizes into ``(routed, not_routed)``: a size is routed when it is a positive
    multiple of ``tokens_per_request`` holding at most ``max_num_seqs`` requests and at most
    ``max_num_batched_tokens`` tokens (the spec's envelope); every other size is left to upstream's path."""
    max_seqs = _as_int(constants.get("max_num_seqs"))
    max_tokens = _as_int(constants.get("max_num_batched_tokens"))
    routed: list[int] = []
    not_routed: list[int] = []
    for s in sizes:
        ok = (
            _as_int(s) is not None
            and s > 0
            and s % tokens_per_request == 0
            and (max_seqs is None or s // tokens_per_request <= max_seqs)
            and (max_tokens is None or s <= max_tokens)
        )
        (routed if ok else not_routed).append(s)
    return sorted(set(routed)), sorted(set(not_routed), key=str)


@dataclass(frozen=True)
class RouteModes:
    """The routes of a group's attention: ``decode`` (``"paged"`` or ``"dense"``), ``verify``
    (``"blockwise"`` or ``"dense"``) and the blockwise verify's ``chunk_blocks``."""

    decode: str
    verify: str
    chunk_blocks: int


def route_modes(spec: GraphSpec, overrides: Mapping[str, int] | None = None) -> RouteModes:
    """The routes ``spec``'s task options select: the options of its first ``decode_task`` and first
    ``verify_task`` (expressions over constants resolved with ``overrides``), validated by the task options
    models. SpecError naming the task when an option is invalid."""
    constants = spec.constants_with(overrides, spec.name)
    chosen: dict[str, Any] = {}
    for decl, model in ((DECODE_TASK, DecodeTaskOptions), (VERIFY_TASK, VerifyTaskOptions)):
        task = next((t for t in spec.tasks if t.factory == decl.factory), None)
        values: dict[str, Any] = {}
        problems: list[tuple[str, str]] = []
        if task is not None:
            values, problems = resolve_options(decl.factory, task.options, constants)
        if problems:
            name = task.name if task is not None else decl.factory
            raise SpecError(f"{spec.name}: " + "; ".join(f"tasks[{name}].{f}: {m}" for f, m in problems))
        defaults = {name: f.default for name, f in model.model_fields.items() if not f.is_required()}
        chosen.update({k: values.get(k, v) for k, v in defaults.items()})
    return RouteModes(chosen["decode_mode"], chosen["verify_mode"], int(chosen["chunk_blocks"]))


def routed_spec(
    vllm_config: Any, kv_cache_spec: Any, q_len: int | None = None, kernel_block_size: int | None = None
) -> tuple[GraphSpec, dict[str, int], list[int]] | None:
    """The validated variant spec of a routed group (see the module docstring), its overrides, and the
    capture sizes vLLM lists that it does not route.

    Only the sizes inside the spec's envelope are planned (:func:`envelope_sizes`); the others stay with
    upstream's path. ``q_len``: plan for requests of this many query tokens instead of
    ``1 + num_speculative_tokens`` (a 1-token decode batch of a group whose verify batches carry MTP
    tokens). ``kernel_block_size``: the block size of the runner's block table (vllm-ascend's attention
    kernels use 128-token blocks under a larger manager block); default the KV spec's block size. Returns
    None when no listed size is routable. Raises :class:`SpecError` naming the field when the rest of the
    envelope is invalid.
    """
    base = _base_spec()
    overrides = spec_overrides(vllm_config, kv_cache_spec)
    if kernel_block_size is not None:
        overrides["block_size"] = kernel_block_size
    if q_len is not None:
        overrides["num_speculative_tokens"] = q_len - 1
    constants = {**base.constants, **overrides}
    tpr = 1 + int(constants.get("num_speculative_tokens", 0) or 0)
    sizes, not_routed = envelope_sizes(capture_sizes(vllm_config), tpr, constants)
    if not sizes:
        return None
    variant = base.model_copy(
        update={
            "groups": [GROUP],
            "buffers": {name: base.buffers[name] for name in ("block_table", "seq_lens")},
            "capture": base.capture.model_copy(update={"sizes": sizes}),
            "tasks": [],  # the drill's tasks; nothing here runs them
            "workspaces": {},  # theirs too (a workspace may name its task's route): never allocated here
        }
    )
    shown = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "none"
    source = (
        f"{SPEC_NAME} for vllm-ascend (capture.sizes from compilation_config.cudagraph_capture_sizes; "
        f"overrides from the vLLM config: {shown})"
    )
    spec = GraphSpec.model_validate(variant.model_dump(), source=source, overrides=overrides)
    return spec, overrides, not_routed


class GroupBuffers:
    """The graphbuf buffers of one routed KV group: one slab on ``device``, allocated once.

    Args:
        spec: the validated variant spec (:func:`routed_spec`).
        overrides: its constant overrides.
        device: the runner's device.
    """

    def __init__(
        self,
        spec: GraphSpec,
        overrides: Mapping[str, int],
        device: str | torch.device,
        modes: RouteModes | None = None,
    ) -> None:
        self.buffers = StaticBuffers(spec, device, overrides=overrides)
        self.modes: RouteModes = modes if modes is not None else route_modes(spec, overrides)
        """The routes the spec's task options select (:func:`route_modes`)."""
        self.decodes = RoutedDecodes(owned=(self.buffers.slab,))
        """The group's captured paged-decode tasks (decode route ``paged``)."""
        self.tokens_per_request: int = self.buffers.plan.tokens_per_request
        self.capture_sizes: tuple[int, ...] = self.buffers.capture_sizes
        self.not_routed: tuple[int, ...] = ()
        """vLLM's capture sizes outside the spec's envelope (upstream's path runs them)."""
        self.fallbacks: dict[int, str] = {}
        """Capture sizes whose capture fell back to upstream's path, with the reason; never routed again."""
        self.layers: tuple[str, ...] = ()
        """The KV group's layer names (its builder's ``layer_names``)."""
        self.steps_per_update = 1
        """Planned steps that may share one replay and one update: ``1 + num_speculative_tokens`` (a drafter
        builds each draft step's metadata before the draft graph's one replay)."""
        self._steps = itertools.count(1)
        self._applied = 0

    def next_step(self) -> int:
        """A new serial number for a planned step (``Route.step``)."""
        return next(self._steps)

    def apply(self, step: int, size: int, block_table: Any, seq_lens: Any, num_reqs: int) -> bool:
        """:meth:`resolve` for planned step ``step`` unless that step was applied already (a staged route is
        applied by whichever comes first: its forward, or the first provider resolved for its replay).
        Returns True if it refreshed now; errors as :meth:`resolve`, with nothing written."""
        if step == self._applied:
            return False
        self.decodes.check(size)  # the size's captured tensors unmoved, before a byte is written
        self.resolve(size, block_table, seq_lens, num_reqs)
        self._applied = step
        return True

    def check_capacity(self, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> None:
        """At activation (vllm-ascend #14024): every routed capture size fits graphbuf's tables and the
        runner's per-token buffers. The largest size must need at most ``max_num_seqs`` rows of
        ``tokens_per_request`` tokens (rows = size // (1 + k) for MTP groups), hold at most
        ``max_num_batched_tokens`` tokens (the runner's slot mapping), and the allocated block-table and
        ``seq_lens`` rows must cover it. SpecError with the arithmetic otherwise."""
        largest = max(self.capture_sizes)
        tpr = self.tokens_per_request
        rows = largest // tpr
        problems = []
        if max_num_seqs is not None and rows > max_num_seqs:
            problems.append(f"{largest} tokens // {tpr} tokens per request = {rows} rows > max_num_seqs "
                            f"{max_num_seqs}")  # fmt: skip
        if max_num_batched_tokens is not None and largest > max_num_batched_tokens:
            problems.append(f"{largest} tokens > max_num_batched_tokens {max_num_batched_tokens} (the "
                            "runner's slot mapping holds one slot per token)")  # fmt: skip
        views = self.buffers.view(largest)
        for name in ROUTED_BUFFERS:
            have = int(views[name].shape[0])
            if have < rows:
                problems.append(f"graphbuf's {name} has {have} rows at size {largest}, needs {rows}")
        if problems:
            raise SpecError(
                f"{SPEC_NAME}: capacity at the largest routed capture size {largest} "
                f"(max_num_seqs {max_num_seqs} x (1 + k = {tpr})): " + "; ".join(problems)
            )

    def capture_size(self, num_tokens: int) -> int | None:
        """The smallest capture size holding ``num_tokens`` tokens; None above the largest (not captured)."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def resolve(
        self, size: int, block_table: Any, seq_lens: Any, num_reqs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refresh the buffers of capture ``size`` from the runner's ``block_table`` ``[>= num_reqs, W]`` and
        ``seq_lens`` ``[>= num_reqs]`` (their first ``num_reqs`` rows are the live requests); return the
        ``(block_table, seq_lens)`` views of ``size``, ``[size // tokens_per_request, ...]``.

        Sources on the slab's device are copied device to device. Raises :class:`graphbuf.RefreshError`
        (``WidthError``: a table wider than the allocation; ``RowsError``: more live requests than ``size``
        holds) with nothing written.
        """
        self.buffers.refresh(
            size, {BLOCK_TABLE: block_table[:num_reqs], SEQ_LENS: seq_lens[:num_reqs]}, num_reqs=num_reqs
        )
        views = self.buffers.view(size)
        return views[BLOCK_TABLE], views[SEQ_LENS]


def group_buffers(
    builder: Any,
    device: str | torch.device | None = None,
    q_len: int | None = None,
    kernel_block_size: int | None = None,
) -> GroupBuffers | None:
    """The builder's :class:`GroupBuffers` for requests of ``q_len`` query tokens (default: the spec's
    ``1 + num_speculative_tokens``), created on first use from ``builder.vllm_config`` and
    ``builder.kv_cache_spec`` on ``device`` (default ``builder.device``), with tables in
    ``kernel_block_size`` blocks, then kept on the builder.

    None when the group is not routed: no listed capture size can hold a batch of ``q_len``-token requests,
    or the vLLM config is outside what the spec can plan (a ``SpecError``, logged once as a warning). Never
    raises for a config vLLM accepts: such groups keep upstream's path.
    """
    cache = builder.__dict__.setdefault(_CACHE_ATTR, {})
    if q_len not in cache:
        warn_uncovered(read(builder, "vllm_config", _BUILDER), logger)  # eager decode batches: one warning
        where = device if device is not None else read(builder, "device", _BUILDER)
        try:
            planned = routed_spec(read(builder, "vllm_config", _BUILDER), builder.kv_cache_spec, q_len,
                                  kernel_block_size)  # fmt: skip
            modes = None if planned is None else route_modes(_base_spec(), planned[1])
        except SpecError as exc:
            logger.warning("graphbuf: KV group left on vllm-ascend's path (not routed): %s", exc)
            planned = None
        if planned is None:
            cache[q_len] = None
        else:
            spec, overrides, not_routed = planned
            buffers = GroupBuffers(spec, overrides, where if where is not None else "cpu", modes)
            buffers.check_capacity(overrides.get("max_num_seqs"), overrides.get("max_num_batched_tokens"))
            buffers.not_routed = tuple(not_routed)
            buffers.steps_per_update = 1 + _speculative_tokens(read(builder, "vllm_config", _BUILDER))
            if _provides():  # the UpdatableGraph providers find the group's metadata by these names
                buffers.layers = tuple(map(str, read(builder, "layer_names", _BUILDER)))
            _log_not_routed(builder, buffers)
            cache[q_len] = buffers
    return cache[q_len]


# (id of the vLLM config, query length, sizes) → the config itself: held, so that its id cannot be reused by a
# later config (a freed config's address taken by a new one hid the new one's line).
_logged: dict[tuple[Any, ...], Any] = {}


def _speculative_tokens(vllm_config: Any) -> int:
    speculative = read(vllm_config, "speculative_config", _CONFIG)
    tokens = None if speculative is None else _as_int(read(speculative, "num_speculative_tokens", _CONFIG))
    return tokens or 0


def _provides() -> bool:
    decided = activation.current()
    return decided is not None and decided.mechanism is Mechanism.UPDATABLE


def _log_not_routed(builder: Any, buffers: GroupBuffers) -> None:
    """One info line per vLLM config and query length naming the capture sizes left to upstream's path."""
    config = read(builder, "vllm_config", _BUILDER)
    key = (id(config), buffers.tokens_per_request, buffers.not_routed)
    if not buffers.not_routed or key in _logged:
        return
    _logged[key] = config
    logger.info(
        "graphbuf: capture sizes %s are beyond the spec's envelope for %d-token requests and are not routed "
        "(vllm-ascend's own path captures them); routed sizes: %s",
        ", ".join(map(str, buffers.not_routed)),
        buffers.tokens_per_request,
        ", ".join(map(str, buffers.capture_sizes)),
    )

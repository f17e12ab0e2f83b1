"""The routing policy of the vllm-ascend patch: which KV groups, batches and calls graphbuf takes over.

``patch.py`` installs the wrappers; this module decides what they do. Rules:

1. Groups. A KV group is routed exactly when its builder is the base ``AscendAttentionMetadataBuilder`` (not
   the PCP/DCP subclasses), ``compilation_config.cudagraph_mode`` is FULL_DECODE_ONLY, the group's KV spec has
   head_size ``LARGE_HEAD_SIZE`` and no sliding window, C8 KV quantization is off, attention is causal, and
   the spec can plan the vLLM config (otherwise one warning and upstream's path). This depends on the group
   only, never on the batch.
2. Capture sizes. Of vLLM's capture sizes, those inside the spec's envelope are routed (multiples of the
   request's query length holding at most ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens);
   the rest run upstream's path, named in one log line. Nothing a valid vLLM config holds fails startup.
3. Batches: routes key on the batch the runner replays. The runner passes the padded request count
   (``num_reqs``, DP padding or padding to the next capture size) with the unpadded token count
   (``num_actual_tokens``) and the replayed token count (``num_input_tokens``). The route's capture size is
   the smallest routed size holding ``num_input_tokens`` (a size vLLM lists but does not route: no route).
   The live rows are the real requests (``num_actual_tokens // q_len``); every other row of the size is a
   pad (``seq_len`` 0, block row 0). ``Route.q_len`` is the query length of a pure uniform decode batch: 1
   (decode) or ``1 + num_speculative_tokens`` (MTP verify); otherwise None with ``Route.reason``. 1-token
   batches of an MTP group use buffers of their own.
4. Block sizes. The runner's block table counts kernel blocks (vllm-ascend's attention kernels take 128-token
   blocks); vLLM's page-size unification may give the group a larger manager block (256 for Gemma4's
   512-dim group at TP=2). Captured tables are planned in the kernel block size, chosen as vLLM's runner
   chooses it (the manager block if the backend supports it, else the largest supported size dividing it).
5. Calls. ``forward_impl`` goes to graphbuf when its metadata carries a ``Route`` with a ``q_len`` and the
   forward runs inside a full ACL graph (vllm-ascend's forward context says ``capturing``, or vLLM's
   ``cudagraph_runtime_mode`` is FULL). A routed call graphbuf cannot run (a layer with sliding window,
   sinks or ALiBi, more query tokens than the route's rows, no KV cache) falls back to upstream's path with
   a logged reason, and the group's capture size is marked so every later batch of that size keeps
   upstream's path too (capture and replay agree). Every other call runs the original method.
6. Routes. The spec's task options choose them (``resolve.route_modes``): decode ``paged`` (default: the
   paged kernel over the host KV lengths, one captured task per layer and size, ``routed_decode.py``) or
   ``dense`` (the whole allocation gathered, device lengths); verify ``blockwise`` (default: chunked online
   softmax, workspace bounded by ``chunk_blocks``) or ``dense``. A ``Route`` without a group (not planned
   by :func:`plan_route`, so no task registry) decodes with device lengths, the dense route: nothing could
   re-issue the host KV lengths a capture bakes, and a graph that replays the lengths of its capture
   batch would be silently wrong at every later step. Its verify is blockwise.
7. Replay updates. ``update_graph_params`` is called without routed groups' metadata (a ``Route`` with a
   ``q_len``): vllm-ascend pairs its captured task parameters with the layers it is given, and graphbuf's
   tasks are not among them. Then :func:`update_routed` re-issues the paged decode tasks of every routed
   group in the step's metadata with the route's host KV lengths (``Route.seq_lens_host``), before replay,
   re-issuing only the tasks whose lengths changed. Before a routed size's buffers are refreshed (``build``)
   and before its tasks are re-issued, the size's watch check runs (``RoutedDecodes.check``): a moved,
   resized or freed tensor of a captured task raises ``AddressChangedError`` / ``LivenessError`` naming the
   layer and the tensor, before any byte is written. This is the legacy mechanism
   (``upstream.Mechanism.LEGACY``: vllm-ascend up to 0.29).
8. UpdatableGraph (``upstream.Mechanism.UPDATABLE``, vllm-ascend 0.30+). ``update_graph_params`` is never
   called, so nothing wraps it. A routed paged decode is captured through upstream's ``register_task`` with a
   :class:`DecodeParamProvider` (one per layer and route, equal by value: the KV group's layer names and the
   layer's index among the group's tasks); upstream resolves it before each replay, and its
   ``resolve(attn_metadata)`` refreshes the group's buffers for that replay from the sources the build
   staged (``Route.staged``; once per step: validated, padded rows cleared, a too-wide table rejected,
   nothing written on error) and returns only ``seq_lens_kv``, the host argument that changes. The build
   refreshes them as well (so an eager or capturing forward reads this step's rows). A draft graph
   (``_EXTRA_CTX.is_draft_model``) resolves its tasks from upstream's own draft parameter list, never from
   a provider, so graphbuf registers nothing there: such a capture size keeps upstream's path.
9. Per replay accounting (both mechanisms, ``RoutedDecodes.expect``): a planned step at a size holding
   graphbuf tasks expects an update; its forward running (capture, eager) or an update clears it; a step
   that replayed graphbuf tasks with no update raises ``UpstreamError`` naming the mechanism and the layers
   at the next build, instead of a silent wait.
10. Owner. ``activation.current().owner`` (``GRAPHBUF_LARGE_HEAD_OWNER``) ``upstream`` routes nothing: the
   large-head layers stay on vllm-ascend's path (its own large-head provider, where it has one). Which of the
   two owns a group's layers is logged once per group.

Tensors handed to graphbuf's kernels are graphbuf's own captured buffers (``resolve.py``), never the
runner's. Every upstream field is read through ``upstream.read`` (a miss raises, naming the surface entry);
a route is recognised only as a :class:`Route` instance (:func:`route_of`). This module imports only the
standard library and ``upstream`` at import time.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from typing import Any

from graphbuf.errors import RefreshError

from . import activation, upstream
from .upstream import Mechanism, read

__all__ = [
    "LARGE_HEAD_SIZE",
    "ROUTED_ATTN_STATES",
    "ROUTED_GRAPH_MODES",
    "ROUTE_ATTR",
    "DecodeParamProvider",
    "ForwardContextView",
    "Route",
    "forward",
    "kernel_block_size",
    "plan_route",
    "route_of",
    "update_routed",
    "without_routed",
]

logger = logging.getLogger(__name__)

LARGE_HEAD_SIZE = 512
"""Head size of the layers graphbuf takes over (Gemma4's full-attention ``global_head_dim``)."""

ROUTED_GRAPH_MODES = frozenset({"FULL_DECODE_ONLY"})
"""``CUDAGraphMode`` names under which routing is allowed."""

ROUTED_ATTN_STATES = frozenset({"DecodeOnly", "SpecDecoding", "ChunkedPrefill"})
"""``AscendAttentionState`` names a routed forward may carry. ChunkedPrefill is listed because vllm-ascend
labels its non-MLA MTP capture dummy runs that way; routing also needs ``Route.q_len``, which is None for
any batch with a prefill request."""

_BUILDER = "AscendAttentionMetadataBuilder instance fields"
_IMPL = "AscendAttentionBackendImpl instance fields"
_COMMON = "AscendCommonAttentionMetadata fields"
_METADATA = "AscendMetadata fields"
_SPEC = "AttentionSpec fields"
_CONFIG = "vLLM config fields"

ROUTE_ATTR = "graphbuf_route"
"""Attribute of the attention metadata that holds the ``Route`` (absent or None: not routed)."""


@dataclass(frozen=True)
class Route:
    """Marks a batch of a routed KV group, with what graphbuf's kernels read for it.

    ``q_len``: query tokens per request of a pure uniform decode batch (1: decode, > 1: MTP verify), None
    for any other batch (then ``reason`` says why and nothing else is set). ``block_table``
    (``[size // q_len, W]`` int32, ``W`` in kernel blocks) and ``seq_lens`` (``[size // q_len]`` int32) are
    views of the group's graphbuf buffers at capture size ``size``: fixed addresses, refreshed by ``build``,
    rows from ``num_reqs`` (the live requests) on cleared to 0. ``seq_lens_host``: the same lengths as host
    ints (the paged decode's ``actual_seq_lengths_kv``). ``group``: the group's ``GroupBuffers``. ``step``:
    the group's serial number of this planned step. ``staged``: under UpdatableGraph, the runner's
    ``(block_table, seq_lens, num_reqs)`` the provider refreshes the views from at the replay (rule 8).
    """

    q_len: int | None
    block_table: Any = None
    seq_lens: Any = None
    size: int | None = None
    num_reqs: int = 0
    reason: str | None = None
    group: Any = None
    seq_lens_host: tuple[int, ...] = ()
    step: int = 0
    staged: tuple[Any, Any, int] | None = None

    def apply(self) -> None:
        """Write the staged sources into the group's buffers (once per step; nothing when not staged)."""
        if self.staged is not None and self.group is not None:
            self.group.apply(self.step, self.size, *self.staged)


def route_of(metadata: Any) -> Route | None:
    """The :class:`Route` graphbuf put on ``metadata`` (``ROUTE_ATTR``), or None. Only a ``Route`` counts:
    an object that merely answers ``graphbuf_route`` (a ``MagicMock``) is not routed."""
    route = getattr(metadata, ROUTE_ATTR, None)  # graphbuf's own attribute, absent on unrouted metadata
    return route if isinstance(route, Route) else None


def kernel_block_size(builder: Any, manager_block_size: int) -> int:
    """The block size of the runner's block table for this group: the manager block size if the backend's
    ``get_supported_kernel_block_sizes()`` lists it (or lists no int), else the largest listed size dividing
    it (vLLM's ``select_common_block_size`` rule; vllm-ascend's attention backend lists 128). Entries that
    are not ints (``MultipleOf`` rules) are not sizes and are skipped."""
    module = sys.modules[upstream.ATTENTION_MODULE]
    entry = "AscendAttentionBackend.get_supported_kernel_block_sizes"
    backend = read(module, "AscendAttentionBackend", entry)
    listed = backend.get_supported_kernel_block_sizes()
    supported = [s for s in listed if isinstance(s, int) and not isinstance(s, bool)]
    if not supported or manager_block_size in supported:
        return manager_block_size
    dividing = [s for s in supported if s > 0 and manager_block_size % s == 0]
    return max(dividing) if dividing else manager_block_size


def plan_route(builder: Any, common_attn_metadata: Any, attn_metadata: Any) -> Route | None:
    """The ``Route`` of one built batch of one KV group, or None when the batch keeps vllm-ascend's path.

    Rules 1-4 of the module docstring. For a routed uniform batch it refreshes the group's graphbuf buffers
    (created on the group's first routed build) and returns their views; a ``graphbuf.RefreshError``
    (``WidthError`` for a table wider than the allocation; host KV lengths past the table's capacity)
    propagates with the buffers unchanged.
    """
    if _enum_name(_graph_mode(builder)) not in ROUTED_GRAPH_MODES:
        return None
    spec = read(builder, "kv_cache_spec", _BUILDER)
    if read(spec, "head_size", _SPEC) != LARGE_HEAD_SIZE or read(spec, "sliding_window", _SPEC) is not None:
        return None
    decided = activation.current()
    _log_owner(builder, decided)
    if decided is not None and not decided.graphbuf_routes:
        return None
    quant_config = read(read(builder, "vllm_config", _BUILDER), "quant_config", _CONFIG)
    # upstream itself reads enable_c8_quant with a default (quant configs other than ModelSlim's lack it)
    if quant_config is not None and getattr(quant_config, "enable_c8_quant", False):
        return None
    if not read(common_attn_metadata, "causal", _COMMON):
        return None
    block_table = read(common_attn_metadata, "block_table_tensor", _COMMON)
    seq_lens = read(common_attn_metadata, "seq_lens", _COMMON)
    if block_table is None or seq_lens is None:
        return None
    from . import resolve  # lazily: importing this module stays standard-library only

    device = read(builder, "device", _BUILDER)
    device = block_table.device if device is None else device
    kernel_block = kernel_block_size(builder, int(spec.block_size))
    buffers = resolve.group_buffers(builder, device, kernel_block_size=kernel_block)
    if buffers is None:
        return None
    num_tokens = int(read(common_attn_metadata, "num_actual_tokens", _COMMON))
    replayed = max(num_tokens, int(read(common_attn_metadata, "num_input_tokens", _COMMON) or 0))
    if replayed in buffers.not_routed:
        return None  # vLLM captures this size on upstream's path
    size = buffers.capture_size(replayed)
    if size is None:
        return None  # above every routed capture size: this batch is never replayed by graphbuf
    q_len = _uniform_decode_query_len(builder, common_attn_metadata, attn_metadata)
    tpr = buffers.tokens_per_request
    if q_len is None:
        return Route(
            q_len=None,
            reason=f"the batch is not a pure uniform decode batch of query length 1 or {tpr} "
            "(1 + num_speculative_tokens)",
        )
    if q_len != tpr:  # a 1-token decode batch of an MTP group: buffers planned for 1-token requests
        buffers = resolve.group_buffers(builder, device, q_len, kernel_block_size=kernel_block)
        if buffers is None or replayed in buffers.not_routed:
            return Route(
                q_len=None, reason=f"no routed capture size holds {replayed} tokens of {q_len}-token requests"
            )
        size = buffers.capture_size(replayed)
        if size is None:
            return Route(
                q_len=None, reason=f"no routed capture size holds {replayed} tokens of {q_len}-token requests"
            )
    if size in buffers.fallbacks:
        return Route(q_len=None, reason=buffers.fallbacks[size])
    mechanism = _mechanism()
    buffers.decodes.expect(size, mechanism.value, buffers.steps_per_update)  # earlier replays updated
    buffers.decodes.check(size)  # the size's captured tensors unmoved, before this step writes a byte
    return _planned(buffers, size, q_len, num_tokens // q_len, kernel_block, attn_metadata, block_table,
                    seq_lens, mechanism)  # fmt: skip


def _planned(buffers: Any, size: int, q_len: int, live: int, kernel_block: int, attn_metadata: Any,
             block_table: Any, seq_lens: Any, mechanism: Mechanism) -> Route:  # fmt: skip
    """The routed batch's :class:`Route`: host lengths checked, buffers refreshed (and staged, rule 8)."""
    from . import resolve  # lazily: importing this module stays standard-library only

    host = _host_ints(read(attn_metadata, "seq_lens_list", _METADATA), live)
    staged = None
    if mechanism is Mechanism.UPDATABLE and q_len == 1 and buffers.modes.decode == "paged":
        staged = (block_table, seq_lens, live)
        host = _host_ints(seq_lens, live) if host is None else host
    capacity = kernel_block * int(buffers.buffers.plan[resolve.BLOCK_TABLE].shape[1])
    if host is not None and any(n < 0 or n > capacity for n in host):
        raise RefreshError(
            f"{resolve.SEQ_LENS}: host KV lengths {host} of capture size {size} must lie in [0, {capacity}] "
            f"(the captured block table's {capacity // kernel_block} blocks of {kernel_block}); the paged "
            "kernel would read past the table. Nothing was refreshed."
        )
    views = buffers.resolve(size, block_table, seq_lens, live)
    if host is None:
        host = [int(n) for n in views[1][:live].tolist()]  # the refreshed buffer (a device read)
    rows = int(views[1].shape[0])
    return Route(
        q_len=q_len, block_table=views[0], seq_lens=views[1], size=size, num_reqs=live, group=buffers,
        seq_lens_host=tuple(host) + (0,) * (rows - live), step=buffers.next_step(), staged=staged,
    )  # fmt: skip


def forward(original: Any, impl: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
            output: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    """``forward_impl`` under rule 5: graphbuf's kernels for a routed batch inside a full graph, else
    ``original`` (also, with a logged reason, for a routed call graphbuf cannot run)."""
    route = route_of(attn_metadata)
    if route is None or route.q_len is None or not _under_full_graph():
        return original(impl, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    if route.group is not None and route.size in route.group.fallbacks:
        return original(impl, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    problems, key_cache, value_cache = _problems(impl, query, kv_cache, attn_metadata, route)
    register = None
    if not problems and route.group is not None:
        register, problem = _registrar(route)
        problems += [problem] if problem else []
    if problems:
        reason = f"{type(impl).__name__}.forward_impl cannot run on graphbuf: {'; '.join(problems)}"
        if route.group is not None:
            route.group.fallbacks[route.size] = reason
        logger.warning("graphbuf: capture size %s keeps vllm-ascend's path: %s", route.size, reason)
        return original(impl, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    read(sys.modules[upstream.ATTENTION_MODULE], "record_attention_compute_start",
         "record_attention_compute_start")()  # fmt: skip
    from ..bindings import large_head  # lazily: it imports torch

    if route.group is not None:
        route.group.decodes.ran_in_python()  # this step runs here: no replay waits for an update
    num_tokens = int(query.shape[0])
    batch = num_tokens // route.q_len
    # Under a full graph the query holds the padded batch (route.size tokens): the views as they are, whose
    # padded rows have seq_len 0 and give zeros. A shorter query reads a row prefix at the same addresses.
    block_table, seq_lens = route.block_table, route.seq_lens
    if int(block_table.shape[0]) != batch:
        block_table, seq_lens = block_table[:batch], seq_lens[:batch]
    modes = route.group.modes if route.group is not None else None
    if route.q_len == 1 and modes is not None and modes.decode == "paged":
        return _paged_decode(impl, route, query, key_cache, value_cache, block_table, seq_lens, output,
                             register)  # fmt: skip
    if route.q_len == 1:
        result = large_head.decode_attention(query, key_cache, value_cache, block_table, seq_lens, impl.scale)
    elif modes is None or modes.verify == "blockwise":
        chunk_blocks = modes.chunk_blocks if modes is not None else large_head.DEFAULT_CHUNK_BLOCKS
        result = large_head.verify_attention_blockwise(
            query, key_cache, value_cache, block_table, seq_lens, route.q_len, impl.scale, chunk_blocks
        )
    else:
        result = large_head.verify_attention(
            query, key_cache, value_cache, block_table, seq_lens, route.q_len, impl.scale
        )
    return _store(output, result, num_tokens)


def _paged_decode(impl: Any, route: Route, query: Any, key_cache: Any, value_cache: Any, block_table: Any,
                  seq_lens: Any, output: Any, register: Any) -> Any:  # fmt: skip
    """Decode through the group's paged tasks (rule 6; ``route.group`` is set), written into ``output``'s
    rows when they are contiguous (a captured copy writes a fixed address), else into a buffer copied out."""
    batch = int(query.shape[0])
    lens = list(route.seq_lens_host[:batch]) + [0] * max(0, batch - len(route.seq_lens_host))
    target = None if output is None else (output if int(output.shape[0]) == batch else output[:batch])
    direct = target is not None and tuple(target.shape) == tuple(query.shape) and target.is_contiguous()
    out = target if direct else query.new_empty(query.shape)
    name = None if register is None else ", ".join(route.group.layers)
    route.group.decodes.run(impl, route.size, upstream.capturing(), query, key_cache, value_cache,
                            block_table, seq_lens, lens, impl.scale, out, register, name)  # fmt: skip
    return output if direct else _store(output, out, batch)


def update_routed(update_stream: Any, num_tokens: int, *containers: Any) -> int:
    """Rule 7: re-issue the paged decode tasks of every routed group whose metadata is in ``containers``
    (layer-name dicts, or lists of them) with its route's host KV lengths, then arm the events of the tasks
    of that size. Returns the number of tasks re-issued."""
    done: set[int] = set()
    count = 0
    for route in _routes(containers):
        group = route.group
        if route.q_len != 1 or group is None or id(group) in done or group.modes.decode != "paged":
            continue
        done.add(id(group))
        size = route.size if route.size is not None else num_tokens
        with group.decodes.exclusive("update_graph_params"):
            group.decodes.check(size)
            count += group.decodes.update(size, route.seq_lens_host, update_stream)
            group.decodes.arm(size, update_stream)
            group.decodes.saw_update()
    return count


@dataclass(frozen=True)
class DecodeParamProvider:
    """graphbuf's parameter provider for one routed layer's paged decode task under UpdatableGraph (rule
    8): hashable and equal by value, so upstream keeps one slot per layer and route.

    ``layers``: the layer names of the layer's KV group (its builder's ``layer_names``: the keys of the
    group's metadata in ``forward_context.attn_metadata``); ``index``: the layer's place among the group's
    routed tasks, in capture order; ``route``: which of graphbuf's routes the task belongs to.
    """

    layers: tuple[str, ...]
    index: int
    route: str = "paged_decode"

    def resolve(self, attn_metadata: Any) -> dict[str, Any]:
        """Refresh graphbuf's buffers for this replay (once per step for the layer's group: validated,
        padded rows cleared, a too-wide table rejected, nothing written on error) and return the one host
        argument that changes, ``seq_lens_kv``. UpstreamError naming the group when its metadata is not a
        routed decode batch (the graph holds graphbuf's task: the replayed batch must be graphbuf's)."""
        found = (
            [attn_metadata[n] for n in self.layers if n in attn_metadata]
            if isinstance(attn_metadata, dict)
            else []
        )
        route = route_of(found[0]) if found else None
        if route is None or route.q_len != 1 or route.group is None or route.group.layers != self.layers:
            keys = sorted(attn_metadata) if isinstance(attn_metadata, dict) else type(attn_metadata).__name__
            raise upstream.UpstreamError(
                f"UpdatableGraph replay: graphbuf's provider for layer #{self.index} of KV group "
                f"{list(self.layers)} ({self.route}) found no routed decode batch for that group in "
                f"forward_context.attn_metadata (keys: {keys}; route: {route!r}); the graph holds graphbuf's "
                "task for the layer, so the group's batch must be routed"
            )
        decodes = route.group.decodes
        with decodes.exclusive(f"UpdatableGraph resolve of layer #{self.index} of {list(self.layers)}"):
            route.apply()
            decodes.record_issued(route.size, route.seq_lens_host, route.step)
            decodes.saw_update()
        return {"seq_lens_kv": list(route.seq_lens_host)}


def _registrar(route: Route) -> tuple[Any, str | None]:
    """Under UpdatableGraph while capturing a paged decode: ``register(operation, kwargs, index)``, upstream's
    ``register_task`` with the layer's provider, or a reason it cannot be (rule 8). ``(None, None)``
    elsewhere (graphbuf's own task group)."""
    modes = route.group.modes
    if (_mechanism() is not Mechanism.UPDATABLE or route.q_len != 1 or modes.decode != "paged"
            or not upstream.capturing()):  # fmt: skip
        return None, None
    if upstream.is_draft_model():
        return None, (
            "a draft graph resolves its tasks from upstream's own draft parameter list "
            "(SharedSource(draft_model_metadata)), never from graphbuf's provider"
        )
    register_task = read(sys.modules[upstream.UPDATABLE_MODULE], "register_task", "register_task")
    return functools.partial(_register, register_task, route.group.layers), None


def _register(register_task: Any, layers: tuple[str, ...], operation: Any, kwargs: dict[str, Any],
              index: int) -> None:  # fmt: skip
    register_task(operation, kwargs, DecodeParamProvider(layers, index))


def _mechanism() -> Mechanism:
    decided = activation.current()
    return Mechanism.LEGACY if decided is None else decided.mechanism


# id of a builder → the builder itself: held, so that its id cannot be reused by a later builder (whose line a
# freed builder's recycled address would hide).
_owners_logged: dict[int, Any] = {}


def _log_owner(builder: Any, decided: activation.Activation | None) -> None:
    """One INFO line per large-head KV group: which layers, and whether graphbuf or upstream owns them."""
    if decided is None or id(builder) in _owners_logged:
        return
    _owners_logged[id(builder)] = builder
    layers = read(builder, "layer_names", _BUILDER)
    logger.info(
        "graphbuf: large-head layers %s are routed by %s (%s; update mechanism %s)",
        ", ".join(map(str, layers)) or "(none)",
        decided.owner,
        decided.owner_reason,
        decided.mechanism.value,
    )


def _routes(containers: Any) -> list[Route]:
    found: list[Route] = []
    for container in containers:
        if isinstance(container, dict):
            found += [r for r in map(route_of, container.values()) if r is not None]
        elif isinstance(container, (list, tuple)):
            found += _routes(container)
    return [r for r in found if r.q_len is not None]


def _problems(
    impl: Any, query: Any, kv_cache: Any, attn_metadata: Any, route: Route
) -> tuple[list[str], Any, Any]:
    num_tokens = int(query.shape[0])
    problems = []
    batch, remainder = divmod(num_tokens, route.q_len)
    head_size = read(impl, "head_size", _IMPL)
    if head_size != LARGE_HEAD_SIZE:
        problems.append(f"head_size is {head_size}, graphbuf takes only {LARGE_HEAD_SIZE}")
    state = _enum_name(read(attn_metadata, "attn_state", _METADATA))
    if state not in ROUTED_ATTN_STATES:
        problems.append(f"attn_state is {state}, allowed: {', '.join(sorted(ROUTED_ATTN_STATES))}")
    for attr in ("sliding_window", "sinks", "alibi_slopes"):
        if read(impl, attr, _IMPL) is not None:
            problems.append(f"{attr} is set, graphbuf supports only plain causal attention")
    attn_type = read(impl, "attn_type", _IMPL)
    if attn_type != "decoder":
        problems.append(f"attn_type is {attn_type}, allowed: decoder")
    if remainder:
        problems.append(f"{num_tokens} query tokens is not a multiple of q_len {route.q_len}")
    for name, tensor in (("block_table", route.block_table), ("seq_lens", route.seq_lens)):
        if int(tensor.shape[0]) < batch:
            problems.append(
                f"graphbuf's {name} at capture size {route.size} has {int(tensor.shape[0])} rows, the batch "
                f"needs {batch}"
            )
    key_cache, value_cache = read(impl, "key_cache", _IMPL), read(impl, "value_cache", _IMPL)
    if key_cache is None and kv_cache is not None and len(kv_cache) >= 2:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        impl.key_cache, impl.value_cache = key_cache, value_cache
    if key_cache is None or value_cache is None:
        problems.append("the layer has no KV cache")
    return problems, key_cache, value_cache


def _uniform_decode_query_len(builder: Any, common_attn_metadata: Any, attn_metadata: Any) -> int | None:
    if read(attn_metadata, "num_prefills", _METADATA):
        return None
    q_len = read(common_attn_metadata, "max_query_len", _COMMON)
    decode_threshold = int(read(builder, "decode_threshold", _BUILDER))
    if not isinstance(q_len, int) or q_len not in (1, decode_threshold):
        return None
    num_tokens = int(read(common_attn_metadata, "num_actual_tokens", _COMMON))
    if num_tokens <= 0 or num_tokens % q_len:
        return None
    live = num_tokens // q_len  # the real requests; padded requests after them are not looked at
    starts = _host_ints(read(common_attn_metadata, "query_start_loc_cpu", _COMMON), live + 1)
    if starts is None or any(starts[i + 1] - starts[i] != q_len for i in range(live)):
        return None
    return q_len


def _store(output: Any, result: Any, num_tokens: int) -> Any:
    """Write ``result`` into ``output[:num_tokens]`` unless it already lives there; return ``output``."""
    if output is None:
        return result
    if result is output:
        return output
    target = output if int(output.shape[0]) == num_tokens else output[:num_tokens]
    if result.data_ptr() == target.data_ptr() and result.numel() == target.numel():
        return output
    target.copy_(result.reshape(target.shape))
    return output


class ForwardContextView:
    """The forward context with a replaced ``attn_metadata``; every other attribute is the context's own."""

    __slots__ = ("_context", "attn_metadata")

    def __init__(self, context: Any, attn_metadata: Any) -> None:
        object.__setattr__(self, "_context", context)
        object.__setattr__(self, "attn_metadata", attn_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_context"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_context"), name, value)


def _is_routed(metadata: Any) -> bool:
    route = route_of(metadata)
    return route is not None and route.q_len is not None


def without_routed(container: Any) -> Any:
    """``container`` (a layer-name dict, or a list/tuple of them) without routed metadata entries (rule 6).

    Returns the same object when nothing is routed, so callers can test identity.
    """
    if isinstance(container, dict):
        kept = {k: v for k, v in container.items() if not _is_routed(v)}
        return container if len(kept) == len(container) else kept
    if isinstance(container, (list, tuple)):
        items = [without_routed(item) for item in container]
        if all(new is old for new, old in zip(items, container, strict=True)):
            return container
        return type(container)(items)
    return container


def _under_full_graph() -> bool:
    if upstream.capturing():
        return True
    context = upstream.forward_context()
    if context is None:
        return False
    return _enum_name(read(context, "cudagraph_runtime_mode", "ForwardContext fields")) == "FULL"


def _graph_mode(builder: Any) -> Any:
    config = read(builder, "compilation_config", _BUILDER)
    return read(config, "cudagraph_mode", _CONFIG)


def _enum_name(value: Any) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value)


def _host_ints(values: Any, count: int) -> list[int] | None:
    if values is None:
        return None
    head = values[:count]
    items = head.tolist() if hasattr(head, "tolist") else list(head)
    return [int(x) for x in items] if len(items) == count else None

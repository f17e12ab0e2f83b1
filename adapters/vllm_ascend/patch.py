"""Idempotent, reversible, version-checked patch of ``vllm_ascend.attention.attention_v1``.

Routing rule.

1. Groups. The patched ``AscendAttentionMetadataBuilder.build`` routes a KV group exactly when the builder is
   the base class itself (not the PCP/DCP subclasses), ``compilation_config.cudagraph_mode`` is
   FULL_DECODE_ONLY, the group's KV spec has head_size ``LARGE_HEAD_SIZE`` and no sliding window, C8 KV
   quantization is off and attention is causal. This depends on the group only, never on the batch.
2. Batches. A batch of a routed group larger than every capture size is never graph-captured: it gets no
   ``Route``. Any other batch gets one. ``Route.q_len`` is the query length of a pure uniform decode batch:
   no prefill request and every real request with the same query length, 1 (decode) or the group's
   graphbuf ``tokens_per_request`` (1 + num_speculative_tokens, MTP verify); otherwise None, with
   ``Route.reason`` saying why. With MTP on, 1-token decode batches use buffers of their own, planned for
   1-token requests at the capture sizes that can hold them (at most ``max_num_seqs`` requests); if none
   can, the route has q_len None.
3. Calls. ``AscendAttentionBackendImpl.forward_impl`` goes to graphbuf (``large_head.decode_attention`` for
   q_len 1, ``large_head.verify_attention`` for q_len > 1) when its metadata carries a ``Route`` and the
   forward runs inside a full ACL graph (vllm-ascend's forward context says ``capturing`` or vLLM's
   ``cudagraph_runtime_mode`` is FULL). Every other call (other head sizes, other graph modes such as
   PIECEWISE, NONE or FULL_AND_PIECEWISE, eager prefill/mixed/decode batches) runs the original method.
4. Replay updates. The patched ``update_graph_params`` hides routed groups from vllm-ascend's task update,
   since their captured work is graphbuf's, not a fused-attention task. Because of this, a routed call
   that graphbuf cannot run (q_len None, a layer with sliding window/sinks/ALiBi, more query tokens than
   the route's rows) raises ``CaptureError`` instead of falling back: a fallback task would never be
   updated.

Tensors handed to graphbuf's kernels are graphbuf's own captured buffers, never the runner's. Each routed
builder owns a ``graphbuf.StaticBuffers`` per query length (``resolve.py``: the shipped
``gemma4-31b-it-mtp`` spec reduced to ``block_table.full`` and ``seq_lens``, capture sizes from
``compilation_config.cudagraph_capture_sizes``,
constants from the vLLM config; a bad envelope raises ``SpecError`` on the group's first build). For a
routed uniform batch, ``build`` picks the smallest capture size holding ``num_actual_tokens`` and refreshes
that size's buffers from the runner's ``block_table_tensor`` and device ``seq_lens`` (the first
``num_reqs`` rows, copied device to device): padded rows are cleared to 0, and a table wider than the
allocation raises ``WidthError`` with nothing written (never truncated). The ``Route`` carries the views of
that size, whose addresses never change, so a graph captured on one build reads the next build's values
on replay.

The import of ``vllm_ascend`` is deferred: ``install()`` patches at once if the attention module is already
imported, and otherwise right after its first import (a ``sys.meta_path`` hook), so the plugin never
imports torch_npu or vllm-ascend's attention stack before vllm-ascend has set itself up. This module
imports only the standard library at import time.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILDER_CLASS",
    "IMPL_CLASS",
    "LARGE_HEAD_SIZE",
    "ROUTED_ATTN_STATES",
    "ROUTED_GRAPH_MODES",
    "ROUTE_ATTR",
    "TARGET_MODULE",
    "Route",
    "apply",
    "install",
    "is_patched",
    "plan_route",
    "unpatch",
]

logger = logging.getLogger(__name__)

TARGET_MODULE = "vllm_ascend.attention.attention_v1"
IMPL_CLASS = "AscendAttentionBackendImpl"
BUILDER_CLASS = "AscendAttentionMetadataBuilder"

LARGE_HEAD_SIZE = 512
"""Head size of the layers graphbuf takes over (Gemma4's full-attention ``global_head_dim``)."""

ROUTED_GRAPH_MODES = frozenset({"FULL_DECODE_ONLY"})
"""``CUDAGraphMode`` names under which routing is allowed."""

ROUTED_ATTN_STATES = frozenset({"DecodeOnly", "SpecDecoding", "ChunkedPrefill"})
"""``AscendAttentionState`` names a routed forward may carry. ChunkedPrefill is listed because vllm-ascend
labels its non-MLA MTP capture dummy runs that way; routing also needs ``Route.q_len``, which is None for
any batch with a prefill request."""

ROUTE_ATTR = "graphbuf_route"
"""Attribute of the attention metadata that holds the ``Route`` (absent or None: not routed)."""

_ORIGINALS_ATTR = "_graphbuf_originals"
_FORWARD_IMPL_PARAMS = ("self", "query", "key", "value", "kv_cache", "attn_metadata", "output")

_lock = threading.RLock()
_patched_classes: list[type] = []
_hook: _PatchOnImport | None = None


@dataclass(frozen=True)
class Route:
    """Marks a batch of a routed KV group, with what graphbuf's kernels read for it.

    ``q_len``: query tokens per request of a pure uniform decode batch (1: decode, > 1: MTP verify), None
    for any other batch (then ``reason`` says why and nothing else is set). ``block_table``
    (``[size // q_len, W]`` int32) and ``seq_lens`` (``[size // q_len]`` int32) are views of the group's
    graphbuf buffers at capture size ``size``: fixed addresses, refreshed by ``build``, rows from
    ``num_reqs`` on cleared to 0.
    """

    q_len: int | None
    block_table: Any = None
    seq_lens: Any = None
    size: int | None = None
    num_reqs: int = 0
    reason: str | None = None


def install(check_version: bool = True) -> str:
    """Patch ``TARGET_MODULE`` now if it is imported, else right after its first import. Idempotent.

    ``check_version``: refuse (``GraphbufError``, nothing changed) unless the installed vllm-ascend version
    is in ``plugin.SUPPORTED_VLLM_ASCEND_VERSIONS``. Returns "applied", "already applied" or "deferred".
    """
    global _hook
    with _lock:
        if check_version:
            _check_version()
        module = sys.modules.get(TARGET_MODULE)
        if module is not None:
            return "applied" if apply(module, check_version=False) else "already applied"
        if _hook is None:
            _hook = _PatchOnImport()
            sys.meta_path.insert(0, _hook)
        return "deferred"


def apply(module: Any = None, check_version: bool = True) -> bool:
    """Wrap ``forward_impl``, ``update_graph_params`` and ``build`` of the attention module's classes.

    ``module``: the imported ``TARGET_MODULE`` (None: import it). Returns True if it patched now, False if
    the classes were already patched (wrapping happens once). Checks every target before changing any, and
    raises ``GraphbufError`` naming what is missing or unsupported; then nothing is changed.
    """
    with _lock:
        if check_version:
            _check_version()
        if module is None:
            module = importlib.import_module(TARGET_MODULE)
        impl_cls, builder_cls = _check_structure(module)
        if _ORIGINALS_ATTR in impl_cls.__dict__ or _ORIGINALS_ATTR in builder_cls.__dict__:
            return False
        impl_raw = {name: impl_cls.__dict__[name] for name in ("forward_impl", "update_graph_params")}
        builder_raw = {"build": builder_cls.__dict__["build"]}
        impl_cls.forward_impl = _wrap_forward_impl(impl_raw["forward_impl"], module)
        impl_cls.update_graph_params = staticmethod(
            _wrap_update_graph_params(impl_raw["update_graph_params"].__func__)
        )
        builder_cls.build = _wrap_build(builder_raw["build"], builder_cls)
        setattr(impl_cls, _ORIGINALS_ATTR, impl_raw)
        setattr(builder_cls, _ORIGINALS_ATTR, builder_raw)
        _patched_classes.extend((impl_cls, builder_cls))
        logger.debug(
            "graphbuf: patched %s.%s and %s.%s for head_size %d under %s",
            TARGET_MODULE,
            IMPL_CLASS,
            TARGET_MODULE,
            BUILDER_CLASS,
            LARGE_HEAD_SIZE,
            ", ".join(sorted(ROUTED_GRAPH_MODES)),
        )
        return True


def unpatch() -> bool:
    """Restore the original methods and remove the import hook. Returns True if anything was undone."""
    global _hook
    with _lock:
        undone = False
        if _hook is not None:
            if _hook in sys.meta_path:
                sys.meta_path.remove(_hook)
            _hook = None
            undone = True
        for cls in _patched_classes:
            originals = cls.__dict__.get(_ORIGINALS_ATTR)
            if originals is None:
                continue
            for name, raw in originals.items():
                setattr(cls, name, raw)
            delattr(cls, _ORIGINALS_ATTR)
            undone = True
        _patched_classes.clear()
        return undone


def is_patched(module: Any = None) -> bool:
    """True if the attention classes of ``module`` (None: the imported ``TARGET_MODULE``) are patched."""
    module = sys.modules.get(TARGET_MODULE) if module is None else module
    impl_cls = getattr(module, IMPL_CLASS, None)
    return isinstance(impl_cls, type) and _ORIGINALS_ATTR in impl_cls.__dict__


def plan_route(builder: Any, common_attn_metadata: Any, attn_metadata: Any) -> Route | None:
    """The ``Route`` of one built batch of one KV group, or None when the batch keeps vllm-ascend's path.

    Rules 1 and 2 of the module docstring. For a routed uniform batch it refreshes the group's graphbuf
    buffers (created on the group's first routed build; ``SpecError`` for a bad envelope) and returns their
    views; a ``graphbuf.RefreshError`` (``WidthError`` for a table wider than the allocation) propagates
    with the buffers unchanged.
    """
    if _enum_name(_graph_mode(builder)) not in ROUTED_GRAPH_MODES:
        return None
    spec = getattr(builder, "kv_cache_spec", None)
    if (
        getattr(spec, "head_size", None) != LARGE_HEAD_SIZE
        or getattr(spec, "sliding_window", None) is not None
    ):
        return None
    quant_config = getattr(getattr(builder, "vllm_config", None), "quant_config", None)
    if getattr(quant_config, "enable_c8_quant", False) or not getattr(common_attn_metadata, "causal", True):
        return None
    block_table = getattr(common_attn_metadata, "block_table_tensor", None)
    seq_lens = getattr(common_attn_metadata, "seq_lens", None)
    if block_table is None or seq_lens is None:
        return None
    resolve = importlib.import_module(f"{__package__}.resolve")
    device = getattr(builder, "device", None)
    buffers = resolve.group_buffers(builder, block_table.device if device is None else device)
    num_tokens = int(getattr(common_attn_metadata, "num_actual_tokens", 0))
    size = buffers.capture_size(num_tokens)
    if size is None:
        return None  # above every capture size: this batch always runs eagerly
    q_len = _uniform_decode_query_len(builder, common_attn_metadata, attn_metadata)
    tpr = buffers.tokens_per_request
    if q_len is None:
        return Route(
            q_len=None,
            reason=f"the batch is not a pure uniform decode batch of query length 1 or {tpr} "
            "(1 + num_speculative_tokens)",
        )
    if q_len != tpr:  # a 1-token decode batch of an MTP group: buffers planned for 1-token requests
        buffers = resolve.group_buffers(builder, block_table.device if device is None else device, q_len)
        size = None if buffers is None else buffers.capture_size(num_tokens)
        if size is None:
            return Route(
                q_len=None,
                reason=f"no capture size holds {num_tokens} tokens of {q_len}-token requests within "
                "max_num_seqs",
            )
    num_reqs = getattr(common_attn_metadata, "num_reqs", None)
    num_reqs = num_tokens // q_len if num_reqs is None else int(num_reqs)
    views = buffers.resolve(size, block_table, seq_lens, num_reqs)
    return Route(q_len=q_len, block_table=views[0], seq_lens=views[1], size=size, num_reqs=num_reqs)


def _uniform_decode_query_len(builder: Any, common_attn_metadata: Any, attn_metadata: Any) -> int | None:
    if getattr(attn_metadata, "num_prefills", 0):
        return None
    q_len = getattr(common_attn_metadata, "max_query_len", None)
    decode_threshold = int(getattr(builder, "decode_threshold", 1))
    if not isinstance(q_len, int) or q_len not in (1, decode_threshold):
        return None
    num_tokens = int(getattr(common_attn_metadata, "num_actual_tokens", 0))
    if num_tokens <= 0 or num_tokens % q_len:
        return None
    num_reqs = num_tokens // q_len
    starts = _host_ints(getattr(common_attn_metadata, "query_start_loc_cpu", None), num_reqs + 1)
    if starts is None or any(starts[i + 1] - starts[i] != q_len for i in range(num_reqs)):
        return None
    return q_len


# --------------------------------------------------------------------------------------------- wrappers


def _wrap_forward_impl(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_impl(
        self: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        route = getattr(attn_metadata, ROUTE_ATTR, None)
        if route is None or not _under_full_graph():
            return original(self, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        fence = getattr(module, "record_attention_compute_start", None)
        if callable(fence):
            fence()
        return _graphbuf_forward(self, query, kv_cache, attn_metadata, output, route)

    return forward_impl


def _wrap_update_graph_params(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def update_graph_params(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        changed = False
        forward_context = bound.arguments.get("forward_context")
        if forward_context is not None:
            attn_metadata = getattr(forward_context, "attn_metadata", None)
            kept = _without_routed(attn_metadata)
            if kept is not attn_metadata:
                bound.arguments["forward_context"] = _ForwardContextView(forward_context, kept)
                changed = True
        drafts = bound.arguments.get("draft_attn_metadatas")
        kept_drafts = _without_routed(drafts)
        if kept_drafts is not drafts:
            bound.arguments["draft_attn_metadatas"] = kept_drafts
            changed = True
        if not changed:
            return original(*args, **kwargs)
        return original(*bound.args, **bound.kwargs)

    return update_graph_params


def _wrap_build(original: Callable[..., Any], builder_cls: type) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = original(self, *args, **kwargs)
        # Subclasses (PCP, DCP) have their own layouts and forward paths: never routed.
        if type(self) is not builder_cls or metadata is None:
            return metadata
        common = signature.bind(self, *args, **kwargs).arguments.get("common_attn_metadata")
        route = plan_route(self, common, metadata)
        if route is not None or getattr(metadata, ROUTE_ATTR, None) is not None:
            setattr(metadata, ROUTE_ATTR, route)
        return metadata

    return build


def _graphbuf_forward(
    impl: Any, query: Any, kv_cache: Any, attn_metadata: Any, output: Any, route: Route
) -> Any:
    num_tokens = int(query.shape[0])
    problems = []
    q_len = route.q_len
    if q_len is None:
        problems.append(route.reason or "the batch is not a pure uniform decode batch")
        q_len = 1
    batch, remainder = divmod(num_tokens, q_len)
    if getattr(impl, "head_size", None) != LARGE_HEAD_SIZE:
        problems.append(
            f"head_size is {getattr(impl, 'head_size', None)}, graphbuf takes only {LARGE_HEAD_SIZE}"
        )
    state = _enum_name(getattr(attn_metadata, "attn_state", None))
    if state not in ROUTED_ATTN_STATES:
        problems.append(f"attn_state is {state}, allowed: {', '.join(sorted(ROUTED_ATTN_STATES))}")
    for attr in ("sliding_window", "sinks", "alibi_slopes"):
        if getattr(impl, attr, None) is not None:
            problems.append(f"{attr} is set, graphbuf supports only plain causal attention")
    if getattr(impl, "attn_type", "decoder") != "decoder":
        problems.append(f"attn_type is {getattr(impl, 'attn_type', None)}, allowed: decoder")
    if remainder:
        problems.append(f"{num_tokens} query tokens is not a multiple of q_len {q_len}")
    if route.q_len is not None:
        for name, tensor in (("block_table", route.block_table), ("seq_lens", route.seq_lens)):
            if int(tensor.shape[0]) < batch:
                problems.append(
                    f"graphbuf's {name} at capture size {route.size} has {int(tensor.shape[0])} rows, "
                    f"the batch needs {batch}"
                )
    key_cache, value_cache = getattr(impl, "key_cache", None), getattr(impl, "value_cache", None)
    if key_cache is None and kv_cache is not None and len(kv_cache) >= 2:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        impl.key_cache, impl.value_cache = key_cache, value_cache
    if key_cache is None or value_cache is None:
        problems.append("the layer has no KV cache")
    if problems:
        from graphbuf.errors import CaptureError

        raise CaptureError(
            f"{type(impl).__name__}.forward_impl: this KV group is routed to graphbuf under a full graph, "
            f"but graphbuf cannot run it: {'; '.join(problems)}. vllm-ascend's replay update skips routed "
            "groups, so the original path cannot be used instead."
        )

    large_head = importlib.import_module(f"{__package__}.large_head")
    # Under a full graph the query holds the padded batch (route.size tokens): the views as they are, whose
    # padded rows have seq_len 0 and give zeros. A shorter query reads a row prefix at the same addresses.
    block_table, seq_lens = route.block_table, route.seq_lens
    if int(block_table.shape[0]) != batch:
        block_table, seq_lens = block_table[:batch], seq_lens[:batch]
    if q_len == 1:
        result = large_head.decode_attention(query, key_cache, value_cache, block_table, seq_lens, impl.scale)
    else:
        result = large_head.verify_attention(
            query, key_cache, value_cache, block_table, seq_lens, q_len, impl.scale
        )
    return _store(output, result, num_tokens)


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


# -------------------------------------------------------------------------------------------- helpers


class _ForwardContextView:
    """The forward context with a replaced ``attn_metadata``; every other attribute is the context's own."""

    __slots__ = ("_context", "attn_metadata")

    def __init__(self, context: Any, attn_metadata: Any) -> None:
        object.__setattr__(self, "_context", context)
        object.__setattr__(self, "attn_metadata", attn_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_context"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_context"), name, value)


def _without_routed(container: Any) -> Any:
    """``container`` (a layer-name dict, or a list/tuple of them) without routed metadata entries.

    Returns the same object when nothing is routed, so callers can test identity.
    """
    if isinstance(container, dict):
        kept = {k: v for k, v in container.items() if getattr(v, ROUTE_ATTR, None) is None}
        return container if len(kept) == len(container) else kept
    if isinstance(container, (list, tuple)):
        items = [_without_routed(item) for item in container]
        if all(new is old for new, old in zip(items, container, strict=True)):
            return container
        return type(container)(items)
    return container


def _under_full_graph() -> bool:
    try:
        extra = importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX
        if getattr(extra, "capturing", False):
            return True
    except Exception:  # no forward context set, or an older vllm-ascend layout
        pass
    context = _forward_context()
    return context is not None and _enum_name(getattr(context, "cudagraph_runtime_mode", None)) == "FULL"


def _forward_context() -> Any:
    module = _forward_context_module()
    if module is None:
        return None
    try:
        return module.get_forward_context() if module.is_forward_context_available() else None
    except Exception:
        return None


@functools.lru_cache(maxsize=1)
def _forward_context_module() -> Any:
    try:
        return importlib.import_module("vllm.forward_context")
    except Exception:
        return None


def _graph_mode(builder: Any) -> Any:
    config = getattr(builder, "compilation_config", None)
    if config is None:
        config = getattr(getattr(builder, "vllm_config", None), "compilation_config", None)
    return getattr(config, "cudagraph_mode", None)


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


def _check_version() -> None:
    plugin = importlib.import_module(f"{__package__}.plugin")
    version = plugin.vllm_ascend_version()
    if version is None or not plugin.is_supported_version(version):
        from graphbuf.errors import GraphbufError

        raise GraphbufError(
            f"vllm-ascend {version or 'unknown'} is not supported by graphbuf's attention patch; supported: "
            f"{', '.join(plugin.SUPPORTED_VLLM_ASCEND_VERSIONS)}. Nothing was patched."
        )


def _check_structure(module: Any) -> tuple[type, type]:
    problems = []
    impl_cls = getattr(module, IMPL_CLASS, None)
    builder_cls = getattr(module, BUILDER_CLASS, None)
    if not isinstance(impl_cls, type):
        problems.append(f"class {IMPL_CLASS} is missing")
    if not isinstance(builder_cls, type):
        problems.append(f"class {BUILDER_CLASS} is missing")
    if problems:
        _raise_structure(module, problems)
    assert isinstance(impl_cls, type) and isinstance(builder_cls, type)
    if _ORIGINALS_ATTR in impl_cls.__dict__:
        return impl_cls, builder_cls
    forward_impl = impl_cls.__dict__.get("forward_impl")
    if not callable(forward_impl) or tuple(_params(forward_impl)[: len(_FORWARD_IMPL_PARAMS)]) != (
        _FORWARD_IMPL_PARAMS
    ):
        problems.append(f"{IMPL_CLASS}.forward_impl must take ({', '.join(_FORWARD_IMPL_PARAMS)})")
    update = impl_cls.__dict__.get("update_graph_params")
    if not isinstance(update, staticmethod) or "forward_context" not in _params(update.__func__):
        problems.append(f"{IMPL_CLASS}.update_graph_params must be a staticmethod taking forward_context")
    build = builder_cls.__dict__.get("build")
    if not callable(build) or _params(build)[:3] != ["self", "common_prefix_len", "common_attn_metadata"]:
        problems.append(
            f"{BUILDER_CLASS}.build must take (self, common_prefix_len, common_attn_metadata, ...)"
        )
    if problems:
        _raise_structure(module, problems)
    return impl_cls, builder_cls


def _params(func: Any) -> list[str]:
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return []


def _raise_structure(module: Any, problems: list[str]) -> None:
    from graphbuf.errors import GraphbufError

    raise GraphbufError(
        f"{getattr(module, '__name__', TARGET_MODULE)} does not have the layout graphbuf's patch expects: "
        f"{'; '.join(problems)}. Nothing was patched."
    )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET_MODULE`` through the other finders and patches it right after it executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch; a failing patch is logged and leaves the module untouched."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        if _hook is None:  # unpatch() ran since this spec was found (e.g. a later importlib.reload)
            return
        try:
            apply(module, check_version=False)
        except Exception as exc:
            logger.warning("graphbuf: left %s unpatched: %s", TARGET_MODULE, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

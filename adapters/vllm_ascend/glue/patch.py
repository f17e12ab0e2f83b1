"""The patch mechanism: idempotent, reversible, surface-checked wrapping of
``vllm_ascend.attention.attention_v1``.

Public: :func:`install` (patch now, or right after the module's first import through a ``sys.meta_path``
hook), :func:`apply`, :func:`unpatch`, :func:`is_patched`. It wraps
``AscendAttentionBackendImpl.forward_impl``, ``AscendAttentionMetadataBuilder.build`` and, under the legacy
update mechanism only, ``AscendAttentionBackendImpl.update_graph_params`` (a staticmethod whose signature is
one of ``upstream.UPDATE_FORMS``; the wrapper binds each call to it, hides routed metadata from it, then lets
the routing policy re-issue graphbuf's own tasks; a call that does not bind raises). Under the UpdatableGraph
mechanism upstream never calls ``update_graph_params`` for its attention backends, so it is left alone:
graphbuf's tasks are registered with the graph (``routing.py`` rule 7). The mechanism is decided once per
apply from the surface (``upstream.detect_mechanism``) and kept with the large-head owner in
``activation``. What the wrappers do with a call is the routing policy's (``routing.py``); this module only
installs, checks and removes them.

The whole upstream surface (``upstream.SURFACE``) is checked before anything is changed; a miss raises
``upstream.UpstreamError`` naming the first miss, with nothing changed. Through the import hook a miss
leaves the module unpatched with one warning naming it (:func:`inactive_reason`); any other failure of the
hook's patch propagates out of the import. The originals are kept on the classes and restored by
:func:`unpatch`. The plugin never imports torch_npu or vllm-ascend's attention stack before vllm-ascend
has set itself up: this module imports only the standard library, ``routing`` and ``upstream`` at import
time.
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
from typing import Any

from . import activation, routing, upstream
from .routing import ROUTE_ATTR, Route

__all__ = [
    "BUILDER_CLASS",
    "IMPL_CLASS",
    "ROUTE_ATTR",
    "TARGET_MODULE",
    "Route",
    "apply",
    "inactive_reason",
    "install",
    "is_patched",
    "unpatch",
]

logger = logging.getLogger(__name__)

TARGET_MODULE = "vllm_ascend.attention.attention_v1"
IMPL_CLASS = "AscendAttentionBackendImpl"
BUILDER_CLASS = "AscendAttentionMetadataBuilder"

_ORIGINALS_ATTR = "_graphbuf_originals"

_lock = threading.RLock()
_patched_classes: list[type] = []
_hook: _PatchOnImport | None = None
_inactive: str | None = None


def install() -> str:
    """Patch ``TARGET_MODULE`` now if it is imported, else right after its first import. Idempotent.

    Returns "applied", "already applied" or "deferred". A surface miss raises ``upstream.UpstreamError``
    (now) or leaves the module unpatched with one warning (deferred; :func:`inactive_reason`).
    """
    global _hook
    with _lock:
        module = sys.modules.get(TARGET_MODULE)
        if module is not None:
            return "applied" if apply(module) else "already applied"
        if _hook is None:
            _hook = _PatchOnImport()
            sys.meta_path.insert(0, _hook)
        return "deferred"


def inactive_reason() -> str | None:
    """Why the import hook left ``TARGET_MODULE`` unpatched (the first surface miss), or None."""
    return _inactive


def apply(module: Any = None) -> bool:
    """Wrap ``forward_impl`` and ``build`` of the attention module's classes, and ``update_graph_params``
    under the legacy update mechanism.

    ``module``: the imported ``TARGET_MODULE`` (None: import it). Returns True if it patched now, False if
    the classes were already patched (wrapping happens once). Decides the update mechanism and the
    large-head owner and checks the upstream surface for that mechanism before changing anything; raises
    ``upstream.UpstreamError`` naming the first miss (a half-present mechanism included), then nothing is
    changed.
    """
    with _lock:
        if module is None:
            module = importlib.import_module(TARGET_MODULE)
        impl_cls, builder_cls, decided = _check_structure(module)
        if _ORIGINALS_ATTR in impl_cls.__dict__ or _ORIGINALS_ATTR in builder_cls.__dict__:
            return False
        assert decided is not None
        legacy = decided.mechanism is upstream.Mechanism.LEGACY
        wrapped = ("forward_impl", "update_graph_params") if legacy else ("forward_impl",)
        impl_raw = {name: impl_cls.__dict__[name] for name in wrapped}
        builder_raw = {"build": builder_cls.__dict__["build"]}
        activation.set_current(decided)
        impl_cls.forward_impl = _wrap_forward_impl(impl_raw["forward_impl"])
        if "update_graph_params" in impl_raw:
            impl_cls.update_graph_params = staticmethod(
                _wrap_update_graph_params(impl_raw["update_graph_params"].__func__)
            )
        builder_cls.build = _wrap_build(builder_raw["build"], builder_cls)
        setattr(impl_cls, _ORIGINALS_ATTR, impl_raw)
        setattr(builder_cls, _ORIGINALS_ATTR, builder_raw)
        _patched_classes.extend((impl_cls, builder_cls))
        logger.debug(
            "graphbuf: patched %s.%s and %s.%s", TARGET_MODULE, IMPL_CLASS, TARGET_MODULE, BUILDER_CLASS
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
        activation.clear()
        return undone


def is_patched(module: Any = None) -> bool:
    """True if the attention classes of ``module`` (None: the imported ``TARGET_MODULE``) are patched."""
    module = sys.modules.get(TARGET_MODULE) if module is None else module
    impl_cls = getattr(module, IMPL_CLASS, None)
    return isinstance(impl_cls, type) and _ORIGINALS_ATTR in impl_cls.__dict__


# --------------------------------------------------------------------------------------------- wrappers


def _wrap_forward_impl(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_impl(
        self: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, output: Any,
        *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        return routing.forward(
            original, self, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
        )

    return forward_impl


def _wrap_update_graph_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper accepts every call that binds to the original's signature, which the surface check
    (``upstream.UPDATE_FORMS``) requires to be one of:

    * 0.23/0.24: ``(update_stream, forward_context, num_tokens, vllm_config, speculative_config,
      num_dcp_pcp_tokens, draft_attn_metadatas)``, called with 7 positional arguments;
    * 0.25.1+ and main 182b75ea: ``(update_stream, forward_context, num_tokens, vllm_config,
      speculative_config, draft_attn_metadatas)``, called with 5 positional arguments and
      ``draft_attn_metadatas=``;

    any mix of positional and keyword arguments binding to that signature included. Anything else (the
    7-positional form against a 6-parameter original, an unknown keyword) raises
    ``upstream.UpstreamError`` naming the call, instead of calling through with routed metadata visible.
    """
    signature = inspect.signature(original)
    known = tuple(signature.parameters)

    @functools.wraps(original)
    def update_graph_params(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise upstream.UpstreamError(
                f"{IMPL_CLASS}.update_graph_params called with {len(args)} positional arguments and keywords "
                f"{sorted(kwargs)}, which does not bind to its signature ({', '.join(known)}): {exc}. "
                f"graphbuf knows the forms {'; '.join(upstream.UPDATE_FORMS)}; nothing was updated"
            ) from exc
        changed = False
        forward_context = bound.arguments.get("forward_context")
        attn_metadata = None
        if forward_context is not None:
            attn_metadata = upstream.read(forward_context, "attn_metadata", "ForwardContext fields")
            kept = routing.without_routed(attn_metadata)
            if kept is not attn_metadata:
                bound.arguments["forward_context"] = routing.ForwardContextView(forward_context, kept)
                changed = True
        drafts = bound.arguments.get("draft_attn_metadatas")
        kept_drafts = routing.without_routed(drafts)
        if kept_drafts is not drafts:
            bound.arguments["draft_attn_metadatas"] = kept_drafts
            changed = True
        result = original(*bound.args, **bound.kwargs) if changed else original(*args, **kwargs)
        if changed:  # routed metadata present: re-issue graphbuf's own tasks with its host KV lengths
            routing.update_routed(
                bound.arguments.get("update_stream"), bound.arguments.get("num_tokens"), attn_metadata, drafts
            )
        return result

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
        route = routing.plan_route(self, common, metadata)
        if route is not None or routing.route_of(metadata) is not None:
            setattr(metadata, ROUTE_ATTR, route)
        return metadata

    return build


# -------------------------------------------------------------------------------------------- helpers


def _check_structure(module: Any) -> tuple[type, type, activation.Activation | None]:
    """The classes to wrap and the decision (None when they are wrapped already); UpstreamError on a miss."""
    impl_cls = module.__dict__.get(IMPL_CLASS)
    builder_cls = module.__dict__.get(BUILDER_CLASS)
    if isinstance(impl_cls, type) and _ORIGINALS_ATTR in impl_cls.__dict__:
        assert isinstance(builder_cls, type)
        return impl_cls, builder_cls, None
    where = getattr(module, "__name__", TARGET_MODULE)
    try:
        mechanism, evidence = upstream.detect_mechanism()
    except upstream.UpstreamError as exc:
        raise upstream.UpstreamError(f"{where}: {exc}. Nothing was patched.") from None
    miss = upstream.first_miss(module, mechanism)
    if miss is not None:
        raise upstream.UpstreamError(
            f"{where} does not have the layout graphbuf's patch expects ({mechanism.value} mechanism): "
            f"{miss}. Nothing was patched."
        )
    assert isinstance(impl_cls, type) and isinstance(builder_cls, type)
    large_head = upstream.upstream_large_head(module)
    owner, reason = activation.large_head_owner(large_head)
    return impl_cls, builder_cls, activation.Activation(mechanism, evidence, large_head, owner, reason)


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
    """Runs the real loader, then the patch. A surface miss leaves the module untouched with one warning
    naming it (the plugin is then inactive); any other failure propagates out of the import."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        if _hook is None:  # unpatch() ran since this spec was found (e.g. a later importlib.reload)
            return
        global _inactive
        try:
            apply(module)
        except upstream.UpstreamError as exc:
            _inactive = str(exc)
            logger.warning("graphbuf vllm-ascend plugin inactive, %s left unpatched: %s", TARGET_MODULE, exc)
            activation.announce(f"inactive: {TARGET_MODULE} left unpatched: {exc}")
            return
        decided = activation.current()
        if decided is not None:
            activation.announce(f"active: {TARGET_MODULE} patched at its import; {decided.describe()}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

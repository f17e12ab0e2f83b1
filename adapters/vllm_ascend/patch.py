"""The patch mechanism: idempotent, reversible, version- and structure-checked wrapping of
``vllm_ascend.attention.attention_v1``.

Public: :func:`install` (patch now, or right after the module's first import through a ``sys.meta_path``
hook), :func:`apply`, :func:`unpatch`, :func:`is_patched`. It wraps
``AscendAttentionBackendImpl.forward_impl``,
``AscendAttentionBackendImpl.update_graph_params`` (a staticmethod: 0.23/0.24 call it with 7 positional
arguments, 0.25.1+ pass ``draft_attn_metadatas`` by keyword; the wrapper binds either form to the original
signature, hides routed metadata from it, then lets the routing policy re-issue graphbuf's own tasks) and
``AscendAttentionMetadataBuilder.build``. What the wrappers do with a call is the routing policy's
(``routing.py``); this module only installs, checks and removes them.

Every target is checked before any is changed; a failed check raises ``GraphbufError`` naming what is
missing, with nothing changed. The originals are kept on the classes and restored by :func:`unpatch`. The
plugin never imports torch_npu or vllm-ascend's attention stack before vllm-ascend has set itself up: this
module imports only the standard library at import time.
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

from . import routing
from .routing import ROUTE_ATTR, Route

__all__ = [
    "BUILDER_CLASS",
    "IMPL_CLASS",
    "ROUTE_ATTR",
    "TARGET_MODULE",
    "Route",
    "apply",
    "install",
    "is_patched",
    "unpatch",
]

logger = logging.getLogger(__name__)

TARGET_MODULE = "vllm_ascend.attention.attention_v1"
IMPL_CLASS = "AscendAttentionBackendImpl"
BUILDER_CLASS = "AscendAttentionMetadataBuilder"

_ORIGINALS_ATTR = "_graphbuf_originals"
_FORWARD_IMPL_PARAMS = ("self", "query", "key", "value", "kv_cache", "attn_metadata", "output")

_lock = threading.RLock()
_patched_classes: list[type] = []
_hook: _PatchOnImport | None = None


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
        impl_cls.forward_impl = _wrap_forward_impl(impl_raw["forward_impl"])
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
    signature = inspect.signature(original)

    @functools.wraps(original)
    def update_graph_params(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        changed = False
        forward_context = bound.arguments.get("forward_context")
        attn_metadata = getattr(forward_context, "attn_metadata", None)
        if forward_context is not None:
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
        if route is not None or getattr(metadata, ROUTE_ATTR, None) is not None:
            setattr(metadata, ROUTE_ATTR, route)
        return metadata

    return build


# -------------------------------------------------------------------------------------------- helpers


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

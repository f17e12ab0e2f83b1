"""Everything of vLLM and vllm-ascend the adapter reads: one table, one check, one way to read.

Activation is decided by :func:`first_miss` over the whole table (never by a version string): the plugin
stays inactive with one log line naming the first miss. At run time every read of an upstream field goes
through :func:`read`, which raises :class:`UpstreamError` naming the table entry instead of standing in a
default. This module imports only the standard library and ``graphbuf.errors`` (itself standard-library
only) at import time.

Checked on: vllm-ascend 0.23.0.post1 + vLLM 0.23.0 ("0.23"), vllm-ascend main 182b75ea + vLLM 0.27.1
("main") and the reconstructed UpdatableGraph tree + vLLM 0.28.0 ("upd", standing for vllm-ascend 0.30+), by
the real-module tests (``tests/integration/real_vllm_ascend``).

The update mechanism (:func:`detect_mechanism`) is decided from the surface, never from a version string:
``UPDATABLE`` when all of ``UPDATABLE_PARTS`` are present, ``LEGACY`` when none is, and a miss naming what is
missing when only some are. Rows marked "legacy" or "upd" in the table are checked only under that mechanism.

Modules: ``av1`` = vllm_ascend.attention.attention_v1, ``autils`` = vllm_ascend.attention.utils, ``afc`` =
vllm_ascend.ascend_forward_context, ``vfc`` = vllm.forward_context, ``vcfg`` = vllm.config, ``vkv`` =
vllm.v1.kv_cache_interface, ``aug`` = vllm_ascend.compilation.updatable_graph, ``acl`` =
vllm_ascend.compilation.acl_graph, ``autl`` = vllm_ascend.utils. Checked: 0.23 = 0.23.0.post1 + vLLM 0.23.0,
main = 182b75ea + vLLM 0.27.1, upd = the UpdatableGraph reconstruction (daa6441) + vLLM 0.28.0.

=========================================================================  ========  =============
name (what graphbuf reads)                                                 where     checked
=========================================================================  ========  =============
``AscendAttentionBackendImpl.forward_impl(self, query, key, value,         av1       0.23 main upd
kv_cache, attn_metadata, output)``
``AscendAttentionBackendImpl.update_graph_params``: a staticmethod of a    av1       0.23 main
form in ``UPDATE_FORMS`` (legacy only: graphbuf's re-issue wrapper)
``register_task(operation, kwargs, provider)`` (upd only)                  aug       upd
``ACLGraphWrapper._updatable_graph_replay(self, forward_context, graph)``  acl       upd
(upd only)
``use_updatable_graph(attn_backend)`` (upd only)                           autl      upd
``_EXTRA_CTX.is_draft_model`` in ``extra_attrs`` (upd only: draft graphs)  afc       upd
``AscendAttentionBackendImpl`` instance fields head_size, scale,           av1       0.23 main upd
sliding_window, sinks, alibi_slopes, attn_type, key_cache, value_cache
``AscendAttentionMetadataBuilder.build(self, common_prefix_len,            av1       0.23 main upd
common_attn_metadata, fast_build)``
``AscendAttentionMetadataBuilder`` fields set in ``__init__``:             av1       0.23 main upd
kv_cache_spec and layer_names (vLLM's base builder), vllm_config,
device, compilation_config, decode_threshold
``AscendAttentionBackend.get_supported_kernel_block_sizes()`` ([128])      av1       0.23 main upd
``AscendAttentionState`` members DecodeOnly, SpecDecoding, ChunkedPrefill  av1       0.23 main upd
``AscendMetadata`` fields attn_state, num_prefills, seq_lens_list          av1       0.23 main upd
``AscendCommonAttentionMetadata`` fields block_table_tensor, seq_lens,     autils    0.23 main upd
num_actual_tokens, num_input_tokens, max_query_len, query_start_loc_cpu,
causal
``record_attention_compute_start`` (imported into av1 from a module that   av1       0.23 main upd
moved on main)
``_EXTRA_CTX`` (private) listing ``capturing`` in its ``extra_attrs``      afc       0.23 main upd
``get_forward_context``, ``is_forward_context_available``;                 vfc       0.23 main upd
``ForwardContext`` fields attn_metadata, cudagraph_runtime_mode
``VllmConfig`` fields compilation_config, scheduler_config, model_config,  vcfg      0.23 main upd
parallel_config, speculative_config, quant_config; ``CompilationConfig``
cudagraph_mode, cudagraph_capture_sizes; ``SchedulerConfig``
max_num_seqs, max_num_batched_tokens; ``ModelConfig`` max_model_len;
``ParallelConfig`` tensor_parallel_size; ``SpeculativeConfig``
num_speculative_tokens
``FullAttentionSpec`` fields block_size, head_size, sliding_window         vkv       0.23 main upd
=========================================================================  ========  =============

``quant_config.enable_c8_quant`` is the one field read with a default, because upstream itself reads it so
(``getattr(quant_config, "enable_c8_quant", False)`` in ``AscendAttentionBackendImpl.__init__``): quant
configs other than ModelSlim's do not have it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from graphbuf.errors import GraphbufError

__all__ = [
    "ACL_GRAPH_MODULE",
    "ATTENTION_MODULE",
    "FORWARD_CONTEXT_MODULE",
    "LARGE_HEAD_PROVIDER",
    "SURFACE",
    "UPDATABLE_MODULE",
    "UPDATABLE_PARTS",
    "UPDATE_FORMS",
    "Entry",
    "Mechanism",
    "UpstreamError",
    "capturing",
    "detect_mechanism",
    "first_miss",
    "forward_context",
    "is_draft_model",
    "read",
    "upstream_large_head",
]

ATTENTION_MODULE = "vllm_ascend.attention.attention_v1"
EXTRA_CONTEXT_MODULE = "vllm_ascend.ascend_forward_context"
UTILS_MODULE = "vllm_ascend.attention.utils"
FORWARD_CONTEXT_MODULE = "vllm.forward_context"
CONFIG_MODULE = "vllm.config"
KV_SPEC_MODULE = "vllm.v1.kv_cache_interface"
UPDATABLE_MODULE = "vllm_ascend.compilation.updatable_graph"
ACL_GRAPH_MODULE = "vllm_ascend.compilation.acl_graph"
ASCEND_UTILS_MODULE = "vllm_ascend.utils"

LARGE_HEAD_PROVIDER = ("FIABnsdLargeHeadParamProvider", "full_graph_fia_bnsd_large_head")
"""Upstream's own 512-dim decode route (the revised upstream PR, vllm-ascend 0.30+ if it lands): the
provider class in the attention module and the impl's capture method. Either present means upstream routes
large-head decode itself (:func:`upstream_large_head`)."""


class Mechanism(str, Enum):
    """How the running vllm-ascend updates a FULL graph's attention tasks before a replay."""

    LEGACY = "update_graph_params"
    """Up to 0.29 (0.23.0.post1, main 182b75ea): the model runner calls
    ``AscendAttentionBackendImpl.update_graph_params`` before each replay; graphbuf wraps it."""
    UPDATABLE = "UpdatableGraph"
    """0.30+: tasks are registered with the graph at capture (``register_task``) and
    ``ACLGraphWrapper._updatable_graph_replay`` resolves each task's provider; ``update_graph_params`` is
    never called for Ascend attention backends."""


FORWARD_IMPL_PARAMS = ("self", "query", "key", "value", "kv_cache", "attn_metadata", "output")
BUILD_PARAMS = ("self", "common_prefix_len", "common_attn_metadata", "fast_build")

UPDATE_FORMS: dict[str, tuple[str, ...]] = {
    "0.23/0.24 (num_dcp_pcp_tokens)": (
        "update_stream", "forward_context", "num_tokens", "vllm_config", "speculative_config",
        "num_dcp_pcp_tokens", "draft_attn_metadatas",
    ),
    "0.25.1+ and main 182b75ea": (
        "update_stream", "forward_context", "num_tokens", "vllm_config", "speculative_config",
        "draft_attn_metadatas",
    ),
}  # fmt: skip
"""The ``update_graph_params`` signatures the wrapper knows (parameter names in order). 0.23/0.24 call it
with 7 positional arguments; from 0.25.1 (vllm-ascend #12592) with 5 positional arguments plus
``draft_attn_metadatas=``. Any other signature is a surface miss; any call that does not bind to the known
signature raises (``patch.py``)."""


class UpstreamError(GraphbufError, RuntimeError):
    """An upstream class, field or signature the adapter reads is not what ``SURFACE`` says."""


@dataclass(frozen=True)
class Entry:
    """One row of the surface table: ``name`` (what is read), ``where`` (module), ``check`` (returns a
    miss description or None, given the imported modules by name), ``mechanisms`` (when it is read)."""

    name: str
    where: str
    check: Callable[[dict[str, Any]], str | None]
    mechanisms: frozenset[Mechanism] = frozenset(Mechanism)
    """The update mechanisms under which the row is read (both by default)."""


def _params(func: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return ()


def _cls(modules: dict[str, Any], module: str, name: str) -> Any:
    value = modules[module].__dict__.get(name)
    return value if isinstance(value, type) else None


def _code_names(cls: type, methods: tuple[str, ...] | None = None) -> set[str]:
    """Attribute names the class's own functions (or only ``methods``) load or store, through its MRO."""
    names: set[str] = set()
    for klass in cls.__mro__:
        for key, value in vars(klass).items():
            if methods is not None and key not in methods:
                continue
            func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            code = getattr(func, "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return names


def _fields(cls: type) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))


def _class_check(module: str, name: str) -> Callable[[dict[str, Any]], str | None]:
    def check(modules: dict[str, Any]) -> str | None:
        return None if _cls(modules, module, name) is not None else f"class {module}.{name} is missing"

    return check


def _signature_check(
    module: str, cls_name: str, method: str, params: tuple[str, ...], static: bool = False
) -> Callable[[dict[str, Any]], str | None]:
    def check(modules: dict[str, Any]) -> str | None:
        cls = _cls(modules, module, cls_name)
        if cls is None:
            return f"class {module}.{cls_name} is missing"
        raw = cls.__dict__.get(method)
        if raw is None:
            return f"{cls_name}.{method} is missing"
        if static and not isinstance(raw, staticmethod):
            return f"{cls_name}.{method} is not a staticmethod"
        found = _params(raw.__func__ if isinstance(raw, staticmethod) else raw)
        if found[: len(params)] != params:
            return f"{cls_name}.{method} takes ({', '.join(found)}), graphbuf reads ({', '.join(params)})"
        return None

    return check


def _update_check(modules: dict[str, Any]) -> str | None:
    cls = _cls(modules, ATTENTION_MODULE, "AscendAttentionBackendImpl")
    raw = None if cls is None else cls.__dict__.get("update_graph_params")
    if not isinstance(raw, staticmethod):
        return "AscendAttentionBackendImpl.update_graph_params is missing or not a staticmethod"
    found = _params(raw.__func__)
    if found not in UPDATE_FORMS.values():
        return (
            f"AscendAttentionBackendImpl.update_graph_params takes ({', '.join(found)}), which is none of "
            f"the forms graphbuf knows ({'; '.join(UPDATE_FORMS)})"
        )
    return None


def _instance_fields_check(
    module: str, cls_name: str, fields: tuple[str, ...], methods: tuple[str, ...] | None = None
) -> Callable[[dict[str, Any]], str | None]:
    def check(modules: dict[str, Any]) -> str | None:
        cls = _cls(modules, module, cls_name)
        if cls is None:
            return f"class {module}.{cls_name} is missing"
        names = _code_names(cls, methods)
        missing = [f for f in fields if f not in names]
        return f"{cls_name} never sets {', '.join(missing)}" if missing else None

    return check


def _dataclass_check(
    module: str, cls_name: str, fields: tuple[str, ...]
) -> Callable[[dict[str, Any]], str | None]:
    def check(modules: dict[str, Any]) -> str | None:
        cls = _cls(modules, module, cls_name)
        if cls is None:
            return f"class {module}.{cls_name} is missing"
        missing = [f for f in fields if f not in _fields(cls)]
        return f"{cls_name} has no field {', '.join(missing)}" if missing else None

    return check


def _enum_check(modules: dict[str, Any]) -> str | None:
    cls = _cls(modules, ATTENTION_MODULE, "AscendAttentionState")
    members = getattr(cls, "__members__", {})
    missing = [m for m in ("DecodeOnly", "SpecDecoding", "ChunkedPrefill") if m not in members]
    return f"AscendAttentionState has no member {', '.join(missing)}" if missing else None


def _function_check(module: str, *names: str) -> Callable[[dict[str, Any]], str | None]:
    def check(modules: dict[str, Any]) -> str | None:
        missing = [n for n in names if not callable(modules[module].__dict__.get(n))]
        return f"{module} has no function {', '.join(missing)}" if missing else None

    return check


def _extra_context_check(modules: dict[str, Any]) -> str | None:
    extra = modules[EXTRA_CONTEXT_MODULE].__dict__.get("_EXTRA_CTX")
    if extra is None:
        return f"{EXTRA_CONTEXT_MODULE}._EXTRA_CTX is missing"
    if "capturing" not in getattr(type(extra), "extra_attrs", ()):
        return f"{EXTRA_CONTEXT_MODULE}._EXTRA_CTX does not list 'capturing' in extra_attrs"
    return None


def _forward_context_fields(modules: dict[str, Any]) -> str | None:
    cls = _cls(modules, FORWARD_CONTEXT_MODULE, "ForwardContext")
    if cls is None:
        return f"class {FORWARD_CONTEXT_MODULE}.ForwardContext is missing"
    missing = [f for f in ("attn_metadata", "cudagraph_runtime_mode") if f not in _fields(cls)]
    return f"ForwardContext has no field {', '.join(missing)}" if missing else None


def _config_check(modules: dict[str, Any]) -> str | None:
    config = modules[CONFIG_MODULE].__dict__
    wanted = {
        "VllmConfig": ("compilation_config", "scheduler_config", "model_config", "parallel_config",
                       "speculative_config", "quant_config"),
        "CompilationConfig": ("cudagraph_mode", "cudagraph_capture_sizes"),
        "SchedulerConfig": ("max_num_seqs", "max_num_batched_tokens"),
        "ModelConfig": ("max_model_len",),
        "ParallelConfig": ("tensor_parallel_size",),
        "SpeculativeConfig": ("num_speculative_tokens",),
    }  # fmt: skip
    for cls_name, fields in wanted.items():
        cls = config.get(cls_name)
        if not isinstance(cls, type):
            return f"class {CONFIG_MODULE}.{cls_name} is missing"
        missing = [f for f in fields if f not in _fields(cls)]
        if missing:
            return f"{cls_name} has no field {', '.join(missing)}"
    return None


def _params_check(module: str, path: str, params: tuple[str, ...]) -> Callable[[dict[str, Any]], str | None]:
    """``module.<path>`` (``Class.method`` or a function) exists and its parameters start with ``params``."""

    def check(modules: dict[str, Any]) -> str | None:
        obj: Any = modules[module]
        for piece in path.split("."):
            obj = obj.__dict__.get(piece) if hasattr(obj, "__dict__") else None
            if obj is None:
                return f"{module}.{path} is missing"
        found = _params(obj)
        if found[: len(params)] != params:
            return f"{path} takes ({', '.join(found)}), graphbuf calls it as ({', '.join(params)})"
        return None

    return check


def _draft_flag_check(modules: dict[str, Any]) -> str | None:
    extra = modules[EXTRA_CONTEXT_MODULE].__dict__.get("_EXTRA_CTX")
    if "is_draft_model" not in getattr(type(extra), "extra_attrs", ()):
        return f"{EXTRA_CONTEXT_MODULE}._EXTRA_CTX does not list 'is_draft_model' in extra_attrs"
    return None


_LEGACY = frozenset({Mechanism.LEGACY})
_UPD = frozenset({Mechanism.UPDATABLE})

SURFACE: tuple[Entry, ...] = (
    Entry("AscendAttentionBackendImpl.forward_impl", ATTENTION_MODULE,
          _signature_check(ATTENTION_MODULE, "AscendAttentionBackendImpl", "forward_impl",
                           FORWARD_IMPL_PARAMS)),
    Entry("AscendAttentionBackendImpl.update_graph_params", ATTENTION_MODULE, _update_check, _LEGACY),
    Entry("register_task", UPDATABLE_MODULE,
          _params_check(UPDATABLE_MODULE, "register_task", ("operation", "kwargs", "provider")), _UPD),
    Entry("ACLGraphWrapper._updatable_graph_replay", ACL_GRAPH_MODULE,
          _params_check(ACL_GRAPH_MODULE, "ACLGraphWrapper._updatable_graph_replay",
                        ("self", "forward_context", "graph")), _UPD),
    Entry("use_updatable_graph", ASCEND_UTILS_MODULE,
          _params_check(ASCEND_UTILS_MODULE, "use_updatable_graph", ("attn_backend",)), _UPD),
    Entry("_EXTRA_CTX.is_draft_model", EXTRA_CONTEXT_MODULE, _draft_flag_check, _UPD),
    Entry("AscendAttentionBackendImpl instance fields", ATTENTION_MODULE,
          _instance_fields_check(ATTENTION_MODULE, "AscendAttentionBackendImpl",
                                 ("head_size", "scale", "sliding_window", "sinks", "alibi_slopes",
                                  "attn_type", "key_cache", "value_cache"))),
    Entry("AscendAttentionMetadataBuilder.build", ATTENTION_MODULE,
          _signature_check(ATTENTION_MODULE, "AscendAttentionMetadataBuilder", "build", BUILD_PARAMS)),
    Entry("AscendAttentionMetadataBuilder instance fields", ATTENTION_MODULE,
          _instance_fields_check(ATTENTION_MODULE, "AscendAttentionMetadataBuilder",
                                 ("kv_cache_spec", "layer_names", "vllm_config", "device",
                                  "compilation_config", "decode_threshold"), ("__init__",))),
    Entry("AscendAttentionBackend.get_supported_kernel_block_sizes", ATTENTION_MODULE,
          _signature_check(ATTENTION_MODULE, "AscendAttentionBackend", "get_supported_kernel_block_sizes", (),
                           static=True)),
    Entry("AscendAttentionState members", ATTENTION_MODULE, _enum_check),
    Entry("AscendMetadata fields", ATTENTION_MODULE,
          _dataclass_check(ATTENTION_MODULE, "AscendMetadata",
                           ("attn_state", "num_prefills", "seq_lens_list"))),
    Entry("AscendCommonAttentionMetadata fields", UTILS_MODULE,
          _dataclass_check(UTILS_MODULE, "AscendCommonAttentionMetadata",
                           ("block_table_tensor", "seq_lens", "num_actual_tokens", "num_input_tokens",
                            "max_query_len", "query_start_loc_cpu", "causal"))),
    Entry("record_attention_compute_start", ATTENTION_MODULE,
          _function_check(ATTENTION_MODULE, "record_attention_compute_start")),
    Entry("_EXTRA_CTX.capturing", EXTRA_CONTEXT_MODULE, _extra_context_check),
    Entry("get_forward_context, is_forward_context_available", FORWARD_CONTEXT_MODULE,
          _function_check(FORWARD_CONTEXT_MODULE, "get_forward_context", "is_forward_context_available")),
    Entry("ForwardContext fields", FORWARD_CONTEXT_MODULE, _forward_context_fields),
    Entry("vLLM config fields", CONFIG_MODULE, _config_check),
    Entry("AttentionSpec fields", KV_SPEC_MODULE,
          _dataclass_check(KV_SPEC_MODULE, "FullAttentionSpec",
                           ("block_size", "head_size", "sliding_window"))),
)  # fmt: skip
"""The table of the module docstring, as checks."""

_MODULES = (ATTENTION_MODULE, EXTRA_CONTEXT_MODULE, UTILS_MODULE, FORWARD_CONTEXT_MODULE, CONFIG_MODULE,
            KV_SPEC_MODULE)  # fmt: skip


def first_miss(attention_module: Any = None, mechanism: Mechanism | None = None) -> str | None:
    """Check the table's rows for ``mechanism``; the first miss as ``"<entry> (<where>): <what>"``, or None
    when they all hold.

    ``attention_module``: the imported ``ATTENTION_MODULE`` (None: ``sys.modules``, else imported). The
    other modules are imported (vLLM is loaded by then; the attention module imports them itself).
    ``mechanism``: None detects it (:func:`detect_mechanism`); a half-present mechanism is the first miss.
    """
    if mechanism is None:
        try:
            mechanism = detect_mechanism()[0]
        except UpstreamError as exc:
            return str(exc)
    names = _MODULES + ((UPDATABLE_MODULE, ACL_GRAPH_MODULE, ASCEND_UTILS_MODULE)
                        if mechanism is Mechanism.UPDATABLE else ())  # fmt: skip
    modules: dict[str, Any] = {}
    for name in names:
        if name == ATTENTION_MODULE and attention_module is not None:
            modules[name] = attention_module
            continue
        try:
            modules[name] = sys.modules.get(name) or importlib.import_module(name)
        except ImportError as exc:
            return f"module {name} does not import: {exc}"
    for entry in SURFACE:
        if mechanism not in entry.mechanisms:
            continue
        miss = entry.check(modules)
        if miss is not None:
            return f"{entry.name} ({entry.where}): {miss}"
    return None


UPDATABLE_PARTS: tuple[tuple[str, str], ...] = (
    (UPDATABLE_MODULE, "register_task"),
    (ACL_GRAPH_MODULE, "ACLGraphWrapper._updatable_graph_replay"),
    (ASCEND_UTILS_MODULE, "use_updatable_graph"),
)
"""``(module, attribute)`` of the UpdatableGraph mechanism: all present = ``Mechanism.UPDATABLE``, none =
``Mechanism.LEGACY``, some = a miss naming the missing ones (:func:`detect_mechanism`)."""


def _optional_module(name: str) -> Any:
    """The module ``name`` if it exists (imported now if needed), else None. A module that exists but fails
    to import raises :class:`UpstreamError` naming it."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):  # a missing parent package, or a module without __spec__
        return None
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UpstreamError(f"{name} exists but does not import: {exc}") from exc


def _has(module: Any, path: str) -> bool:
    obj = module
    for piece in path.split("."):
        obj = getattr(obj, "__dict__", {}).get(piece)
        if obj is None:
            return False
    return True


def detect_mechanism() -> tuple[Mechanism, str]:
    """The running vllm-ascend's update mechanism and the evidence, from the surface (``UPDATABLE_PARTS``),
    never from a version string. :class:`UpstreamError` naming what is missing when the surface is
    half-present (some parts, not all: neither path can be trusted)."""
    found, missing = [], []
    for module_name, attr in UPDATABLE_PARTS:
        module = _optional_module(module_name)
        (found if module is not None and _has(module, attr) else missing).append(f"{module_name}.{attr}")
    if not missing:
        return Mechanism.UPDATABLE, f"{', '.join(found)} present"
    if not found:
        return Mechanism.LEGACY, f"no {UPDATABLE_MODULE}: AscendAttentionBackendImpl.update_graph_params"
    raise UpstreamError(
        f"the UpdatableGraph update mechanism is half-present: {', '.join(found)} found but "
        f"{', '.join(missing)} missing; graphbuf cannot tell how this vllm-ascend updates FULL-graph tasks "
        "(a wrapper on update_graph_params would never be called, a registered task never resolved)"
    )


def upstream_large_head(attention_module: Any) -> str | None:
    """What of upstream's own large-head route (``LARGE_HEAD_PROVIDER``) the attention module has, or None."""
    provider, method = LARGE_HEAD_PROVIDER
    impl = attention_module.__dict__.get("AscendAttentionBackendImpl")
    present = [provider] if isinstance(attention_module.__dict__.get(provider), type) else []
    if isinstance(impl, type) and any(method in vars(k) for k in impl.__mro__):
        present.append(f"AscendAttentionBackendImpl.{method}")
    return ", ".join(present) or None


def is_draft_model() -> bool:
    """vllm-ascend's forward context says the draft model runs (False outside a forward context)."""
    if forward_context() is None:
        return False
    module = sys.modules.get(EXTRA_CONTEXT_MODULE) or importlib.import_module(EXTRA_CONTEXT_MODULE)
    return bool(read(read(module, "_EXTRA_CTX", "_EXTRA_CTX.capturing"), "is_draft_model",
                     "_EXTRA_CTX.is_draft_model"))  # fmt: skip


_ABSENT = object()


def read(obj: Any, name: str, entry: str) -> Any:
    """``obj.<name>``; :class:`UpstreamError` naming ``entry`` (a ``SURFACE`` row) when it is absent."""
    value = getattr(obj, name, _ABSENT)
    if value is _ABSENT:
        raise UpstreamError(
            f"upstream miss at run time: {type(obj).__module__}.{type(obj).__qualname__} has no {name!r} "
            f"(surface entry {entry!r}, checked at activation)"
        )
    return value


def forward_context() -> Any:
    """vLLM's current forward context, or None outside one (``is_forward_context_available``)."""
    module = sys.modules.get(FORWARD_CONTEXT_MODULE) or importlib.import_module(FORWARD_CONTEXT_MODULE)
    return module.get_forward_context() if module.is_forward_context_available() else None


def capturing() -> bool:
    """vllm-ascend's forward context says a graph is being captured (False outside a forward context)."""
    if forward_context() is None:
        return False
    module = sys.modules.get(EXTRA_CONTEXT_MODULE) or importlib.import_module(EXTRA_CONTEXT_MODULE)
    return bool(read(module, "_EXTRA_CTX", "_EXTRA_CTX.capturing").capturing)


def iter_table() -> Iterator[tuple[str, str]]:
    """``(name, where)`` of every row, in table order."""
    for entry in SURFACE:
        yield entry.name, entry.where

"""vLLM general-plugin entry point that routes large-head decode attention on vllm-ascend to graphbuf.

Declared in pyproject.toml under ``[project.entry-points."vllm.general_plugins"]`` as
``graphbuf_vllm_ascend = "graphbuf.adapters.vllm_ascend.glue.plugin:register"``.

Invariants:

- Importing this module imports only the standard library: no torch, no torch_npu, no vllm, no vllm_ascend.
- ``register()`` never raises (vLLM calls general plugins without a try/except), does its work at most once
  per process, and logs exactly one INFO line per process through vLLM's logger (``activation.announce``,
  shown at vLLM's default ``VLLM_LOGGING_LEVEL=INFO``): active or not and why, the update mechanism, which
  layers graphbuf routes and which upstream owns. When the patch waits for vllm-ascend's attention module
  (``deferred``), that line is logged when the module is imported and patched (or found wanting).
  :func:`decision` returns the same decision as text.
- Without vllm_ascend or without an NPU it changes nothing, and on a machine without vllm_ascend or without
  torch_npu it never imports torch_npu.
- Activation is decided by the whole upstream surface (``upstream.py``), never by a version string: a miss
  leaves the plugin inactive with one warning naming the first miss. The version is only logged.
- It never registers a platform plugin; it only patches vllm-ascend's attention classes (see ``patch.py``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_NAME",
    "activate",
    "decision",
    "npu_available",
    "register",
    "vllm_ascend_version",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_NAME = "graphbuf_vllm_ascend"
"""Name of the entry point in the ``vllm.general_plugins`` group (what ``VLLM_PLUGINS`` lists)."""

DISABLE_ENV = "GRAPHBUF_VLLM_ASCEND_DISABLE"
"""Setting this environment variable to 1 (or true/yes/on) makes the plugin do nothing."""

_TRUTHY = frozenset({"1", "true", "yes", "on"})

_lock = threading.Lock()
_decision: str | None = None


def register() -> None:
    """vLLM entry point: decide once per process whether to patch vllm-ascend, and log the decision.

    A second call in the same process does nothing. Never raises: an unexpected failure is logged as a
    warning and recorded as the decision, and vllm-ascend is left as it was.
    """
    global _decision
    with _lock:
        if _decision is not None:
            return
        try:
            result = activate()
        except Exception as exc:  # vLLM calls general plugins without a guard; never take the process down
            logger.warning("graphbuf vllm-ascend plugin failed and changed nothing: %r", exc)
            result = f"failed: {exc!r}"
        _decision = result
        if not result.startswith("active:") or not result.endswith(_DEFERRED):
            _announce(result)


def decision() -> str | None:
    """What ``register()`` decided in this process, or None if it has not run here yet. A deferred patch
    that later found an upstream miss at the attention module's import reads ``inactive: ...``; one that
    applied there reads ``active: ...`` with the update mechanism and the large-head owner."""
    patch = sys.modules.get(f"{__package__}.patch")
    reason = None if patch is None else patch.inactive_reason()
    if _decision is not None and reason is not None:
        return f"inactive: {reason}"
    state = sys.modules.get(f"{__package__}.activation")
    decided = None if state is None else state.current()
    if _decision is not None and _decision.endswith(_DEFERRED) and decided is not None:
        applied = _decision.removesuffix(_DEFERRED).replace("patch deferred", "patch applied at its import")
        return f"{applied}; {decided.describe()}"
    return _decision


def activate(npu_available: bool | None = None) -> str:
    """Patch vllm-ascend if it is installed, an NPU is present and its surface is the one graphbuf reads.

    ``npu_available``: None probes the machine (``npu_available()``); True/False skips the probe, which
    lets tests drive the active path on a CPU machine with a fake vllm_ascend on ``sys.path``.
    Returns a one-line description of what was decided. Unlike ``register()`` it may be called many times
    (the patch itself is idempotent) and it does not log the decision, except that an upstream surface
    miss (``upstream.first_miss``) logs one warning naming the first miss and changes nothing. The version
    is part of the decision's text, never a condition.
    """
    if os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUTHY:
        return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}; vllm-ascend left untouched"
    if not _module_available("vllm_ascend"):
        return "inactive: vllm_ascend is not importable; nothing patched"
    if npu_available is None:
        available, reason = _probe_npu()
    else:
        available, reason = npu_available, "NPU availability given by the caller"
    if not available:
        return f"inactive: no NPU available ({reason}); nothing patched"

    version = vllm_ascend_version() or "unknown"
    from . import activation, patch, upstream  # lazily: importing this module stays standard-library only

    try:
        state = patch.install()
    except upstream.UpstreamError as exc:
        logger.warning("graphbuf vllm-ascend plugin inactive on vllm-ascend %s: %s", version, exc)
        return f"inactive: vllm-ascend {version}: {exc}"
    decided = activation.current()
    if state == "deferred" or decided is None:
        return f"active: vllm-ascend {version}; attention patch {state}{_DEFERRED}"
    return f"active: vllm-ascend {version}; attention patch {state}; {decided.describe()}"


_DEFERRED = " (the update mechanism is decided when vllm_ascend.attention.attention_v1 is imported)"


def _announce(result: str) -> None:
    from . import activation  # lazily, as in activate()

    activation.announce(result)


def vllm_ascend_version() -> str | None:
    """The installed vllm-ascend version: distribution metadata first, else the package's own attribute.

    Only the metadata lookup avoids importing vllm_ascend; the fallback imports it (its ``_version``
    module written by setuptools_scm, then ``vllm_ascend.__version__``). None if neither is found.
    """
    try:
        return importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        pass
    for module_name in ("vllm_ascend._version", "vllm_ascend"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        version = getattr(module, "__version__", None)
        if isinstance(version, str) and version:
            return version
    return None


def npu_available() -> bool:
    """True if torch_npu imports and reports at least one NPU. Imports torch_npu only if it is installed."""
    return _probe_npu()[0]


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules whose __spec__ is None
        return False


def _probe_npu() -> tuple[bool, str]:
    if not _module_available("torch_npu"):
        return False, "torch_npu is not installed"
    try:
        torch_npu = importlib.import_module("torch_npu")
        npu = getattr(torch_npu, "npu", None)
        if npu is None or not npu.is_available():
            return False, "torch_npu reports no NPU"
        count = int(npu.device_count())
    except (ImportError, OSError, RuntimeError) as exc:
        return False, f"torch_npu failed to load: {exc!r}"
    if count < 1:
        return False, "torch_npu reports 0 devices"
    return True, f"torch_npu reports {count} NPU(s)"

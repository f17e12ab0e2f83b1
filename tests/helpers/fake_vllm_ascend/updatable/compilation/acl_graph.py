"""Fake ``vllm_ascend.compilation.acl_graph`` (vllm-ascend 0.30+): ``ACLGraphWrapper``'s FULL-graph replay.

``replay(forward_context, graph)`` is the wrapper's FULL branch: through ``_updatable_graph_replay`` when
``use_updatable_graph(self.attn_backend)`` holds, else a bare ``graph.replay()`` (what the reconstructed
tree's model runner gets: it never sets the backend). ``_updatable_graph_replay`` resolves the tasks (a draft
model's from ``SharedSource(draft_model_metadata)``, the target's from
``ContextSource(forward_context.attn_metadata)``), then replays and updates (ENPU: updates, then replays).
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.ascend_forward_context import _EXTRA_CTX
from vllm_ascend.compilation.updatable_graph import ContextSource, SharedSource
from vllm_ascend.utils import use_updatable_graph


class ACLGraphWrapper:
    def __init__(
        self, update_stream: Any = None, attn_backend: Any = None, enable_enpu: bool = False
    ) -> None:
        self.update_stream = update_stream
        self.attn_backend = attn_backend
        self.enable_enpu = enable_enpu
        self.draft_model_metadata: list[dict[str, Any]] = []

    def set_attn_backend(self, attn_backend: Any) -> None:
        self.attn_backend = attn_backend

    def replay(self, forward_context: Any, graph: Any) -> None:
        if use_updatable_graph(self.attn_backend):
            self._updatable_graph_replay(forward_context, graph)
        else:
            graph.replay()

    def _updatable_graph_replay(self, forward_context: Any, graph: Any) -> None:
        if _EXTRA_CTX.is_draft_model:
            tasks = graph.resolve_tasks(SharedSource(self.draft_model_metadata))
        else:
            tasks = graph.resolve_tasks(ContextSource(forward_context.attn_metadata))
        if self.enable_enpu:
            graph.update(self.update_stream, tasks)
            graph.replay()
        else:
            graph.replay()
            graph.update(self.update_stream, tasks)

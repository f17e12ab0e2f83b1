"""Fake ``vllm_ascend.compilation.updatable_graph`` (vllm-ascend 0.30+), from the documented contract.

A graph being captured is the active one (a context variable); ``register_task`` captures an op as a task
group gated by a fresh ``ExternalEvent`` (wait, reset, group begin, op, group end) and keeps the op, weak
references to its kwargs, the provider and its registration index. Equal providers share one slot.
``resolve_tasks(source)`` binds each task to captured kwargs overlaid with what the source gives for its
provider; ``update`` re-issues each bound op between ``graph_task_update_begin/_end`` on the update stream and
records its event there. ``REGISTERED`` counts registrations per provider (for tests).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm_ascend.utils import weak_ref_tensors

_capturing: ContextVar[UpdatableGraph | None] = ContextVar("fake_updatable_graph", default=None)


@dataclass(frozen=True)
class ContextSource:
    context: Any

    def get(self, provider: Any) -> Sequence[dict[str, Any]]:
        return (provider.resolve(self.context),)


@dataclass(frozen=True)
class SharedSource:
    params: Sequence[dict[str, Any]]

    def get(self, provider: Any) -> Sequence[dict[str, Any]]:
        return self.params


@dataclass
class Task:
    operation: Callable[..., Any]
    kwargs: dict[str, Any]
    provider: Any
    index: int
    handle: Any
    event: Any
    params: dict[str, Any] = field(default_factory=dict)


class UpdatableGraph(torch.npu.NPUGraph):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[Task] = []
        self.provider_sizes: dict[Hashable, int] = {}
        self._token: Any = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        self._token = _capturing.set(self)

    def capture_end(self) -> None:
        try:
            super().capture_end()
        finally:
            _capturing.reset(self._token)
            self._token = None

    def register_task(self, operation: Callable[..., Any], kwargs: dict[str, Any], provider: Any) -> None:
        npu = torch.npu  # type: ignore[attr-defined]
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        operation(**kwargs)
        handle = npu.graph_task_group_end(stream)
        index = self.provider_sizes.get(provider, 0)
        self.provider_sizes[provider] = index + 1
        self.tasks.append(Task(operation, weak_ref_tensors(kwargs), provider, index, handle, event))

    def resolve_tasks(self, source: Any) -> tuple[Task, ...]:
        params = {provider: source.get(provider) for provider in self.provider_sizes}
        for provider, size in self.provider_sizes.items():
            if len(params[provider]) != size:
                raise AssertionError(f"{provider}: {len(params[provider])} params for {size} tasks")
        return tuple(
            Task(
                t.operation,
                {**t.kwargs, **params[t.provider][t.index]},
                t.provider,
                t.index,
                t.handle,
                t.event,
            )
            for t in self.tasks
        )

    def update(self, update_stream: Any, tasks: Sequence[Task]) -> None:
        npu = torch.npu  # type: ignore[attr-defined]
        with npu.stream(update_stream):
            for task in tasks:
                npu.graph_task_update_begin(update_stream, task.handle)
                task.operation(**task.kwargs)
                npu.graph_task_update_end(update_stream)
                task.event.record(update_stream)


def register_task(operation: Callable[..., Any], kwargs: dict[str, Any], provider: Any) -> None:
    graph = _capturing.get()
    if graph is None:
        operation(**kwargs)
    else:
        graph.register_task(operation, kwargs, provider)

"""The base of graphbuf's torch dispatch modes (the recorder, its op probe, the capture guard)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchMode"]


class DispatchMode(TorchDispatchMode):
    """A :class:`TorchDispatchMode` whose ``__torch_dispatch__`` torch leaves as written.

    torch otherwise wraps each subclass's ``__torch_dispatch__`` to keep torch.compile out of it, and that
    wrapper imports ``torch._dynamo`` (1-1.5 s) at the first op it sees. Nothing is compiled inside
    graphbuf's modes, so the wrapper is never needed."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

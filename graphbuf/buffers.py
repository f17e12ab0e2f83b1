"""StaticBuffers: one slab per device holding every captured buffer at a fixed address, forever.

Invariants:
  * the slab is allocated once, in ``__init__``; nothing is ever reallocated or rebound;
  * ``view(size)`` returns views into the slab; views of one buffer at different sizes start at the same
    address, so a graph captured at any size keeps reading the bytes ``refresh`` writes;
  * ``refresh`` validates every source before writing any byte (see :mod:`graphbuf.refresh`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch

from graphbuf.bound import BoundSources
from graphbuf.planner import Plan, plan
from graphbuf.refresh import Refresher, Source
from graphbuf.spec import GraphSpec

__all__ = ["StaticBuffers", "poison_value"]


def poison_value(dtype: torch.dtype) -> int | float | bool:
    """The sentinel a poisoned slab holds: NaN for floats, the minimum for integers, True for bool."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


class StaticBuffers:
    """Every buffer of a spec, allocated once in ONE slab on ``device``.

    Args:
        spec: a :class:`GraphSpec`, a spec path or shipped name, or an existing :class:`Plan`.
        device: where the slab lives (``"cpu"``, ``"cuda"``, ``"npu"``, ...).
        overrides: constant overrides (e.g. ``{"num_blocks": n}``), applied before planning.
        poison: fill the slab with :func:`poison_value` sentinels instead of the pad values, so a read of a
            row that was never written shows up.
        strict: also check value bounds (``min``/``max``) and NaN of device-resident sources, which costs a
            device sync. Host sources are always checked.
        max_bytes: the slab limit (default: the spec's ``limits.max_bytes``).
    """

    def __init__(
        self,
        spec: GraphSpec | Plan | str,
        device: str | torch.device = "cpu",
        *,
        overrides: Mapping[str, int] | None = None,
        poison: bool = False,
        strict: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        self.plan: Plan = (
            spec if isinstance(spec, Plan) else plan(spec, overrides=overrides, max_bytes=max_bytes)
        )
        self.device = torch.device(device)
        self.slab = torch.empty(self.plan.total_bytes, dtype=torch.uint8, device=self.device)
        full: dict[str, torch.Tensor] = {}
        for b in self.plan.buffers:
            typed = self.slab[b.offset : b.offset + b.nbytes].view(b.dtype)
            t = typed.view(b.shape)
            pad = 0 if b.pad == "repeat_last" else b.pad
            t.fill_(poison_value(b.dtype) if poison else pad)
            full[b.name] = t
        self._full = MappingProxyType(full)
        self._views: dict[int, Mapping[str, torch.Tensor]] = {}
        for s in self.plan.capture_sizes:
            views = {}
            for b in self.plan.buffers:
                shape = self.plan.shape_at(b, s)
                t = full[b.name][: shape[0]]
                if len(shape) == 2 and shape[1] != b.shape[1]:
                    t = t[:, : shape[1]]
                views[b.name] = t
            self._views[s] = MappingProxyType(views)
        self._refresher = Refresher(self.plan, self.slab, full, strict=strict)

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The capture sizes, sorted ascending."""
        return self.plan.capture_sizes

    @property
    def names(self) -> tuple[str, ...]:
        """Buffer names (per-group buffers as ``<name>.<group>``), in slab order."""
        return self.plan.names

    @property
    def full(self) -> Mapping[str, torch.Tensor]:
        """Each buffer's whole allocation (its shape at the largest capture size)."""
        return self._full

    def view(self, size: int) -> Mapping[str, torch.Tensor]:
        """Name → the rows a graph of ``size`` tokens captures, as views into the slab."""
        try:
            return self._views[size]
        except KeyError:
            sizes = ", ".join(map(str, self.capture_sizes))
            raise KeyError(f"view({size}): not a capture size; sizes: {sizes}") from None

    def addresses(self, size: int) -> tuple[int, ...]:
        """Data pointers of ``view(size)`` in :attr:`names` order: what a graph of ``size`` baked in."""
        return tuple(t.data_ptr() for t in self.view(size).values())

    def refresh(
        self,
        size: int,
        sources: Mapping[str, Source],
        *,
        num_reqs: int | None = None,
        strict: bool | None = None,
    ) -> int:
        """Write ``sources`` into the buffers captured at ``size``; return the live request count.

        ``sources`` maps buffer names to torch tensors, numpy arrays or lists, on the host or on this
        device. Every buffer must be given unless its spec says ``keep: true``. The live request count comes
        from the sources' row counts (evaluating each buffer's ``rows`` rule) or ``num_reqs``; all must
        agree. Everything is validated first; on any :class:`graphbuf.RefreshError` no byte changes.

        After a valid refresh with n live rows and source width w: rows ``[:n, :w]`` equal the source,
        ``[:n, w:]`` and rows ``[n:]`` equal the pad value (``repeat_last``: the last live row).
        """
        return self._refresher.refresh(size, sources, num_reqs=num_reqs, strict=strict)

    def bind(self, sources: Mapping[str, torch.Tensor | np.ndarray]) -> BoundSources:
        """Bind persistent host ``sources`` once; refresh them by request count with
        :meth:`BoundSources.refresh` (see :mod:`graphbuf.bound`).

        Each bound source must keep its address for as long as it is bound; every buffer not declared
        ``keep: true`` must be bound.
        """
        return BoundSources(self, sources)

    def __repr__(self) -> str:
        return (
            f"StaticBuffers({self.plan.spec.name!r}, device={str(self.device)!r}, "
            f"buffers={len(self.names)}, bytes={self.plan.total_bytes})"
        )

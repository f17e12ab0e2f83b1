"""Eager inputs: fresh tensors for a step above the largest capture size, from sources validated as a refresh
validates them and padded by the same :func:`graphbuf.buffers.commit.write_live`; no captured byte touched."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from graphbuf.buffers.commit import place_device_source, write_live
from graphbuf.buffers.layout import Layout
from graphbuf.buffers.validate import Prepared

__all__ = ["build_eager"]


def build_eager(
    layout: Layout, prepared: Sequence[Prepared], size: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each prepared buffer as a new tensor of its shape at ``size`` tokens on ``device``, padded."""
    out = {}
    for slot, host, dev, n, w in prepared:
        rows, cols = layout.capacity(slot, size)
        image = np.full((rows, cols) if cols else (rows,), slot.pad, dtype=slot.np_dtype)
        write_live(image, host, slot, n, w, rows, 0, 0)
        t = torch.from_numpy(image)
        t = (t.view(torch.bfloat16) if slot.bf16 else t).to(device)
        if dev is not None:
            place_device_source(t, slot, dev, n, w, rows, cols)
        out[slot.name] = t
    return out

"""The byte oracle of a refresh, written independently of ``graphbuf.buffers.commit``: what a buffer holds
after an accepted refresh (README "After a valid refresh"), built with torch from the source alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def expected_buffer(
    shape: tuple[int, ...], src: Any, *, end: int, pad: Any, repeat_last: bool, dtype: torch.dtype
) -> torch.Tensor:
    """A whole buffer of ``shape`` after a refresh from live values ``src`` (n rows; 2-D: its width, clipped
    to the buffer's columns): the pad everywhere, the live cells, and under ``repeat_last`` rows ``n..end``
    (``end``: the rows captured at the refresh's size) equal to the last live row."""
    live = torch.as_tensor(np.asarray(src) if not isinstance(src, torch.Tensor) else src).to(dtype)
    out = torch.full(shape, 0 if repeat_last else pad, dtype=dtype)
    n = live.shape[0]
    if len(shape) == 1:
        out[:n] = live
    else:
        w = min(live.shape[1], shape[1])
        out[:n, :w] = live[:, :w]
    if repeat_last and n and end > n:
        out[n:end] = out[n - 1]
    return out

"""What the model drill judges, in three layers per dtype (issue 34 §3).

1. **Replay = eager on the same buffers.** After every replayed step the same callable runs eagerly on the
   same refreshed buffers, from the KV caches as they were before the step: logits and every KV cache must
   be bit-identical (on the cpu; an accelerator may differ by one rounding step of the output dtype).
2. **Replay = a live-only eager step.** The step is built again straight from the requests' state (token ids,
   positions, block lists, lengths), with no graphbuf buffer and no padded row, and run eagerly from the same
   caches: the live logits rows and the caches outside the trash block must match (bit-exact in bfloat16,
   within :data:`FP32_LIVE_TOL` in float32). This layer sees a padded row not cleared, a block table one
   column short, a length left stale.
3. **Teacher-forced agreement with transformers.** transformers' own forward over each served stream gives its
   choice at every position; where its top-2 margin is at least :data:`MARGIN` the served token must be its
   argmax. Positions below the margin are counted (skipped), and no logit may lie further than
   :data:`LOGIT_BOUND` from transformers' (a wrong attention scale moves the logits by several units while
   every choice can still agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FP32_LIVE_TOL", "LOGIT_BOUND", "MARGIN", "LayerCount", "TeacherForced", "caches_differ", "logits_differ",
]  # fmt: skip

#: Layer 3's top-2 margin (in logits): positions where transformers' margin is below it are skipped.
MARGIN = 0.25
#: Layer 3's largest allowed logit difference from transformers: twice the margin (measured on the drill's
#: model: at most 0.22 in bfloat16, 1.4e-5 in float32).
LOGIT_BOUND = 2 * MARGIN
#: Layer 2's float32 tolerance (``|a - b| <= tol + tol * |b|``, logits and cache values): a live-only batch
#: runs other matmul shapes, whose float32 sums round in another order.
FP32_LIVE_TOL = 1e-3

KV = Sequence[tuple[torch.Tensor, torch.Tensor]]


def logits_differ(got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when ``got`` equals ``want`` (bit-identical when ``tol`` is 0; else ``|a - b| <= tol + tol * |b|``
    elementwise), else where and by how much."""
    if got.shape != want.shape:
        return f"logits shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if torch.equal(got, want) or (tol > 0 and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)):
        return None
    diff = (got.float() - want.float()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    row = int(diff.max(dim=-1).values.argmax()) if diff.dim() > 1 else int(diff.argmax())
    return f"logits differ by up to {worst:.3g} (row {row}, tolerance {tol:g})"


def caches_differ(got: KV, want: KV, tol: float, *, blocks: int | None = None) -> str | None:
    """None when every layer's K and V caches are bit-identical over their first ``blocks`` blocks (all when
    None), or agree within ``tol`` where they differ (``tol`` > 0), else the first layer, cache and block that
    differ."""
    for layer, (pair_got, pair_want) in enumerate(zip(got, want)):
        for name, a, b in (("K", pair_got[0], pair_want[0]), ("V", pair_got[1], pair_want[1])):
            a, b = a[:blocks], b[:blocks]
            bits_a, bits_b = _bits(a), _bits(b)
            if torch.equal(bits_a, bits_b):
                continue
            changed = (bits_a != bits_b).flatten(1).any(dim=1).nonzero().flatten()  # blocks differing at all
            a, b = a[changed].float(), b[changed].float()
            if tol > 0 and torch.allclose(a, b, rtol=tol, atol=tol):
                continue
            diff = (a - b).abs()
            block = int(changed[diff.flatten(1).max(dim=1).values.argmax()])
            return f"layer {layer} {name} cache differs in block {block} by up to {float(diff.max()):.3g}"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its element size (a bitwise comparison, and faster than a float one)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), t.dtype))


@dataclass
class LayerCount:
    """One layer's tally over a serving: steps checked, steps that failed, the first failure's text."""

    checked: int = 0
    failed: int = 0
    first: str | None = None

    def add(self, step: int, problem: str | None) -> None:
        self.checked += 1
        if problem is not None:
            self.failed += 1
            if self.first is None:
                self.first = f"step {step}: {problem}"

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "failed": self.failed, "first": self.first}


@dataclass
class TeacherForced:
    """Layer 3 over every served position: agreement where transformers' margin allows a verdict."""

    positions: int = 0
    skipped: int = 0  # transformers' top-2 margin below MARGIN
    flips: int = 0  # judged positions where the served token is not transformers' argmax
    max_logit_diff: float = 0.0
    first_flip: str | None = None
    first_divergence: dict[int, int] = field(default_factory=dict)  # request -> first position differing

    def add(self, request: int, served: list[int], ours: torch.Tensor, theirs: torch.Tensor) -> None:
        """``served`` tokens, our logits rows that chose them and transformers' rows at the same positions."""
        top = theirs.float().topk(2, dim=-1)
        margin = top.values[:, 0] - top.values[:, 1]
        choice = top.indices[:, 0].tolist()
        self.max_logit_diff = max(self.max_logit_diff, float((ours.float() - theirs.float()).abs().max()))
        for j, token in enumerate(served):
            self.positions += 1
            if token != choice[j] and request not in self.first_divergence:
                self.first_divergence[request] = j
            if float(margin[j]) < MARGIN:
                self.skipped += 1
            elif token != choice[j]:
                self.flips += 1
                if self.first_flip is None:
                    self.first_flip = (
                        f"request {request} token {j}: served {token}, transformers {choice[j]} "
                        f"(margin {float(margin[j]):.2f} >= {MARGIN})"
                    )

    @property
    def ok(self) -> bool:
        return self.flips == 0 and self.max_logit_diff <= LOGIT_BOUND

    def problem(self) -> str | None:
        """What fails this layer, or None."""
        if self.flips:
            return f"{self.flips} flips; first at {self.first_flip}"
        if self.max_logit_diff > LOGIT_BOUND:
            return f"a logit {self.max_logit_diff:.3g} away from transformers' (bound {LOGIT_BOUND:g})"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions, "skipped_below_margin": self.skipped, "margin": MARGIN,
            "flips": self.flips, "max_logit_diff": round(self.max_logit_diff, 4),
            "first_flip": self.first_flip,
            "first_divergence": {str(i): p for i, p in sorted(self.first_divergence.items())},
        }  # fmt: skip

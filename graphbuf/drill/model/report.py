"""The model drill's report: one :class:`DtypeRun` per dtype, judged by :mod:`.criterion`'s three layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .criterion import FP32_LIVE_TOL, LOGIT_BOUND, MARGIN, TeacherForced
from .serve import ServeResult

__all__ = ["DtypeRun", "ModelDrillReport"]


@dataclass
class DtypeRun:
    """One dtype's serving and its checks."""

    dtype: str
    requests: int
    result: ServeResult
    teacher: TeacherForced
    replays: dict[str, dict[int, int]]  # runner -> capture size -> replays
    eager_steps: int
    capture_seconds: float

    @property
    def identical(self) -> int:
        """Requests whose every served token is transformers' greedy choice after the same prefix."""
        return self.requests - len(self.teacher.first_divergence)

    @property
    def problems(self) -> list[str]:
        """What fails this dtype, layer by layer (empty: it passes)."""
        r, out = self.result, []
        if r.error:
            out.append(r.error)
        for name, count in (("layer 1 (replay = eager, same buffers)", r.replay_eager),
                            ("layer 1 (draft replay = eager)", r.draft_replay_eager),
                            ("layer 2 (replay = live-only eager)", r.live_eager)):  # fmt: skip
            if not count.ok:
                out.append(f"{name}: {count.failed}/{count.checked} steps differ; first at {count.first}")
        if not self.teacher.ok:
            out.append(f"layer 3 (teacher-forced): {self.teacher.problem()}")
        if not r.drafter.ok:
            out.append(f"drafter vs transformers' assistant: {r.drafter.problem()}")
        if self.dtype == "float32" and self.teacher.first_divergence:
            i, p = min(self.teacher.first_divergence.items())
            out.append(f"float32 sequences differ from transformers' greedy choice: request {i} at token {p}")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def replay_tokens_per_s(self) -> float:
        r = self.result
        return r.tokens / r.step_seconds if r.step_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        steps = sum(r.accepted.values())
        accepted = sum(a * n for a, n in r.accepted.items())
        return {
            "dtype": self.dtype, "ok": self.ok, "requests": self.requests, "steps": r.steps,
            "mtp_off_steps": r.decode_steps, "dp_padded_steps": r.dp_padded_steps, "prefills": r.prefills,
            "joined_mid_run": r.joined_mid_run, "finished_mid_run": r.finished_mid_run,
            "layer1_replay_eager": r.replay_eager.as_dict(),
            "layer1_draft_replay_eager": r.draft_replay_eager.as_dict(),
            "layer2_live_eager": r.live_eager.as_dict(), "layer3_teacher_forced": self.teacher.as_dict(),
            "drafter_vs_transformers": r.drafter.as_dict(), "identical": self.identical,
            "accepted_per_request_step": {str(a): n for a, n in sorted(r.accepted.items())},
            "accepted_by_step": r.accepted_by_step,
            "mean_accepted": (sum(a * n for a, n in r.accepted.items()) / steps) if steps else None,
            "acceptance_rate": (accepted / r.drafter.positions) if r.drafter.positions else None,
            "batch_sizes": {str(b): n for b, n in sorted(r.batch_sizes.items())},
            "replays_by_size": {
                k: {str(s): n for s, n in sorted(v.items())} for k, v in self.replays.items()
            },
            "eager_steps": self.eager_steps, "nulled_sliding_blocks": r.nulled_blocks,
            "problems": self.problems, "error": r.error, "capture_seconds": round(self.capture_seconds, 2),
            "replay_tokens_per_s": round(self.replay_tokens_per_s, 1),
        }  # fmt: skip

    def render(self) -> list[str]:
        d, r, t = self.as_dict(), self.result, self.teacher
        exact = "bit-exact" if self.dtype != "float32" else f"|a - b| <= {FP32_LIVE_TOL:g} (1 + |b|)"
        replays = "; ".join(
            f"{k} " + ", ".join(f"{s}: {n}" for s, n in v.items())
            for k, v in d["replays_by_size"].items()
            if v
        )
        return [
            f"[{self.dtype}] requests {d['requests']} (joined mid-run {d['joined_mid_run']}, "
            f"finished mid-run {d['finished_mid_run']}), decode steps {d['steps']} "
            f"(MTP-off {d['mtp_off_steps']}, DP-padded {d['dp_padded_steps']}), prefills {d['prefills']}",
            f"  1. replay = eager on the same buffers (logits, KV caches bit-identical): "
            f"{_count(r.replay_eager)} steps; draft steps {_count(r.draft_replay_eager)}",
            f"  2. replay = live-only eager step from the requests' state ({exact}): "
            f"{_count(r.live_eager)} steps",
            f"  3. teacher-forced vs transformers (top-2 margin >= {MARGIN}): {t.flips} flips in "
            f"{t.positions - t.skipped} judged positions, {t.skipped} skipped; "
            f"max logit diff {t.max_logit_diff:.3g} (bound {LOGIT_BOUND:g})",
            f"  drafter vs transformers' Gemma4AssistantForCausalLM (margin >= {MARGIN}): "
            f"{r.drafter.flips} flips in {r.drafter.positions - r.drafter.skipped} judged drafts, "
            f"{r.drafter.skipped} skipped; max logit diff {r.drafter.max_logit_diff:.3g} "
            f"(bound {LOGIT_BOUND:g})",
            f"  free-running identity with transformers' greedy choice "
            f"({'judged' if self.dtype == 'float32' else 'reported'}): {self.identical}/{self.requests} "
            "sequences"
            + "".join(
                f"; request {i} first differs at token {p}" for i, p in sorted(t.first_divergence.items())
            ),
            "  accepted drafts per request-step: "
            + ", ".join(f"{a}: {n}" for a, n in d["accepted_per_request_step"].items())
            + (
                f" (mean {d['mean_accepted']:.2f}, {100 * d['acceptance_rate']:.0f} % of drafts)"
                if d["mean_accepted"] is not None
                else ""
            )
            + "; per verify step: " + " ".join(r.accepted_by_step),
            "  live requests per step: " + ", ".join(f"{b}: {n}" for b, n in d["batch_sizes"].items()),
            f"  replays per capture size: {replays}; eager steps {d['eager_steps']} (prefills: only decode "
            f"steps are captured); sliding blocks replaced by the null block {d['nulled_sliding_blocks']}",
            f"  tokens/s: replayed steps {d['replay_tokens_per_s']:.1f} (checks included); capture "
            f"{d['capture_seconds']:.1f} s",
            *(f"  FAIL: {p}" for p in self.problems),
        ]  # fmt: skip


def _count(count: Any) -> str:
    return f"{count.checked - count.failed}/{count.checked}"


@dataclass
class ModelDrillReport:
    spec: str
    model: str
    device: str
    runs: list[DtypeRun] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    shrink_serves: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every dtype passes layers 1-3 (float32 also token for token) and nothing failed."""
        return all(r.ok for r in self.runs) and self.failure is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec, "model": self.model, "device": self.device, "ok": self.ok,
            "runs": [r.as_dict() for r in self.runs], "failure": self.failure,
            "shrink_serves": self.shrink_serves, "seconds": round(self.seconds, 2),
        }  # fmt: skip

    def render(self) -> str:
        lines = [
            f"graphbuf drill: {self.spec} --model {self.model} on {self.device} (transformers' Gemma4 and "
            "its assistant)"
        ]
        for run in self.runs:
            lines += run.render()
        if self.failure is not None:
            f = self.failure
            lines.append(
                f"smallest failing scenario ({f['dtype']}): {f['requests']} requests, {f['tokens']} tokens"
                + (f" (shrunk in {self.shrink_serves} serves)" if self.shrink_serves else "")
                + f": {f['what']}"
            )
            if f.get("saved"):
                lines.append(f"saved to {f['saved']}")
            if f.get("replay_command"):
                lines.append(f"replay it: {f['replay_command']}")
        lines.append(f"{'PASS' if self.ok else 'FAIL'} in {self.seconds:.1f} s")
        return "\n".join(lines)

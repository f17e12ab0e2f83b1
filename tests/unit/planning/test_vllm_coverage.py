"""The coverage certificate of a vLLM configuration (issue 31 §6): capture sizes derived as vLLM and
vllm-ascend derive them, every reachable uniform decode batch → its graph or eager, one warning with the
sizes that cover it. vLLM's own ``_set_cudagraph_sizes`` is compared in the real-module harness (vLLM 0.23.0,
0.27.1, 0.28.0: ``tests/integration/real_vllm_ascend/test_real_build.py``) and here where vLLM imports."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from graphbuf.errors import SpecError
from graphbuf.planning.sizes import propose_sizes
from graphbuf.planning.vllm_coverage import (
    VllmServing,
    certify,
    certify_vllm_config,
    derive_capture_sizes,
    serving_from_compilation_config,
    warn_uncovered,
)


def test_an_off_grid_max_num_seqs_leaves_the_top_batch_eager_and_names_the_fix() -> None:
    """vllm-ascend #16049/#16623: max_num_seqs 13 with MTP 3 sets the ceiling to 52, vLLM's grid ends at
    48 and truncates it: 13 requests (52 tokens) run eagerly with only a 'Truncating' warning upstream."""
    cert = certify(VllmServing(13, 3, max_num_batched_tokens=8192))
    assert cert.capture_sizes == (4, 8, 16, 24, 32, 40, 48)
    assert cert.eager_requests == (13,)
    assert any("52 → 48" in note for note in cert.notes)
    warning = cert.warning()
    assert warning is not None and "13 requests (52 tokens" in warning and "EAGERLY" in warning
    assert cert.fix == propose_sizes(4, 13, max_tokens=8192).sizes
    assert f"cudagraph_capture_sizes={list(cert.fix)}" in warning
    fixed = certify(VllmServing(13, 3, capture_sizes=cert.fix, max_num_batched_tokens=8192))
    assert fixed.ok and fixed.warning() is None and fixed.fix is None


@pytest.mark.parametrize("seqs", [1, 2, 3, 5, 7, 13, 16, 33, 64, 100, 128, 129, 200, 256])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_every_batch_has_a_graph_or_is_named_and_the_fix_covers_it(seqs: int, k: int) -> None:
    serving = VllmServing(seqs, k, max_num_batched_tokens=8192)
    q = 1 + k
    if (seqs, q) == (1, 3):  # ceiling 3, grid [1, 2] truncated to 2: nothing rounds up to 3 under it
        with pytest.raises(SpecError, match=f"after rounding to multiples of {q}"):
            certify(serving)  # vLLM refuses to start here too (test_real_build compares)
        return
    cert = certify(serving)
    assert [b.requests for b in cert.coverage.batches] == list(range(1, seqs + 1))
    for b in cert.coverage.batches:
        assert b.tokens == b.requests * q
        if b.capture_size is not None:  # the smallest captured size holding it, a decode key
            assert b.capture_size >= b.tokens and b.capture_size <= seqs * q
            assert b.capture_size == min(s for s in cert.capture_sizes if s >= b.tokens)
        else:
            assert not any(b.tokens <= s <= seqs * q for s in cert.capture_sizes)
    assert all(s % q == 0 for s in cert.capture_sizes)
    assert cert.ok == (cert.warning() is None)
    if not cert.ok:
        assert certify(VllmServing(seqs, k, capture_sizes=cert.fix, max_num_batched_tokens=8192)).ok


def test_ascend_default_ceiling_is_max_num_seqs_times_q_capped_at_512() -> None:
    assert derive_capture_sizes(VllmServing(16, 3))[0] == (4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes, notes = derive_capture_sizes(VllmServing(256, 3))
    assert sizes[-1] == 512 and "= 512" in notes[0]
    cert = certify(VllmServing(256, 3))
    assert cert.eager_requests == tuple(range(129, 257))  # 516..1024 tokens: past the 512 cap


def test_vllms_own_default_appends_the_uniform_decode_sizes() -> None:
    """vLLM 0.32 without a platform ceiling: min(max_num_seqs × q × 2, 512) and the decode sizes."""
    sizes, _ = derive_capture_sizes(VllmServing(13, 3, platform="vllm"))
    assert 52 in sizes and sizes[-1] == 104
    assert certify(VllmServing(13, 3, platform="vllm")).ok
    sizes, _ = derive_capture_sizes(VllmServing(13, 0, platform="vllm"))
    assert 13 in sizes and certify(VllmServing(13, 0, platform="vllm")).ok


def test_max_num_batched_tokens_caps_sizes_and_reachable_batches() -> None:
    cert = certify(VllmServing(16, 3, max_num_batched_tokens=40))
    assert cert.capture_sizes[-1] == 40
    assert [b.requests for b in cert.coverage.batches] == list(range(1, 11))  # 10 × 4 = 40 tokens at most
    assert cert.ok


def test_configured_sizes_are_rounded_to_multiples_of_q_and_the_top_can_drop() -> None:
    """A configured 50 rounds up to 52, past the (truncated) ceiling 50: dropped, so 12 requests are eager."""
    cert = certify(VllmServing(13, 3, capture_sizes=(4, 8, 16, 32, 50)))
    assert cert.capture_sizes == (4, 8, 16, 32)
    assert cert.eager_requests == (9, 10, 11, 12, 13)


def test_data_parallelism_is_named_in_the_warning_and_the_certificate() -> None:
    cert = certify(VllmServing(13, 0, data_parallel_size=2))
    assert "data parallelism" in (cert.warning() or "") and "data_parallel_size 2" in cert.render()


@pytest.mark.parametrize(
    ("serving", "match"),
    [
        (dict(max_num_seqs=0), "max_num_seqs = 0"),
        (dict(max_num_seqs=4, num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(max_num_seqs=4, capture_sizes=()), "empty"),
        (dict(max_num_seqs=4, capture_sizes=(4, 0)), r"cudagraph_capture_sizes\[1\]"),
        (dict(max_num_seqs=4, platform="cuda"), "platform"),
        (dict(max_num_seqs=4, capture_sizes=(4, 8), max_capture_size=16), "disagrees"),
        (dict(max_num_seqs=4, num_speculative_tokens=3, capture_sizes=(1, 2)), "multiples of 4"),
    ],
)
def test_invalid_configurations_are_refused_naming_the_field(serving: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        certify(VllmServing(**serving))


def test_compilation_config_json() -> None:
    serving = serving_from_compilation_config(
        '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 8, 52]}', max_num_seqs=13,
        num_speculative_tokens=3,
    )  # fmt: skip
    assert serving.capture_sizes == (4, 8, 52) and certify(serving).ok
    with pytest.raises(SpecError, match="invalid JSON at character"):
        serving_from_compilation_config("{", max_num_seqs=1)
    with pytest.raises(SpecError, match="expected a list"):
        serving_from_compilation_config('{"cudagraph_capture_sizes": 4}', max_num_seqs=1)


class _Mode:
    def __init__(self, decode: str) -> None:
        self._decode = SimpleNamespace(name=decode)

    def decode_mode(self) -> Any:
        return self._decode


def _running_config(sizes: list[int], decode: str = "FULL", seqs: int = 13, k: int = 3) -> Any:
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=_Mode(decode), cudagraph_capture_sizes=sizes),
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=8192),
        speculative_config=SimpleNamespace(num_speculative_tokens=k) if k else None,
        parallel_config=SimpleNamespace(data_parallel_size=1),
    )


def test_a_running_config_is_certified_from_its_final_sizes_and_warned_once(caplog: Any) -> None:
    config = _running_config([4, 8, 16, 24, 32, 40, 48])
    logger = logging.getLogger("graphbuf.test_vllm_coverage")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        first = warn_uncovered(config, logger)
        second = warn_uncovered(config, logger)
    assert first is not None and first.eager_requests == (13,) and first.notes == ()
    assert second == first
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "13 requests (52 tokens" in lines[0] and "cudagraph_capture_sizes=" in lines[0]
    covered = _running_config(list(first.fix or ()))
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert warn_uncovered(covered, logger).ok  # type: ignore[union-attr]
    assert len(caplog.records) == 1


def test_no_full_decode_graphs_means_no_certificate() -> None:
    assert certify_vllm_config(_running_config([4, 8], decode="NONE")) is None
    assert certify_vllm_config(_running_config([4, 8], decode="PIECEWISE")) is None

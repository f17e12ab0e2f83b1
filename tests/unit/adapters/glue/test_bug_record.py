"""The bug record as tests (issue 31 §5), each named for its upstream issue, on the fake tree (legacy
mechanism and, where the mechanism matters, UpdatableGraph with the NPU stand-in). The real-module versions
a CPU can reach run in ``tests/integration/real_vllm_ascend/test_real_updatable.py``; vllm-ascend #16794
and sglang-omni #2160 are in ``test_updatable.py`` (they need the UpdatableGraph fake and threads).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from vllm_plugin_harness import SIZE, WIDTH, Runner, make_builder
from vllm_plugin_harness import RoutedModel as Model

import graphbuf.adapters.vllm_ascend.glue.resolve as resolve
import graphbuf.adapters.vllm_ascend.glue.routing as routing
from graphbuf.errors import RefreshError, SpecError


def _apply(route: routing.Route) -> routing.Route:
    route.apply()  # the UpdatableGraph provider's refresh (nothing staged under the legacy mechanism)
    return route


# ------------------------------------------------------------------------------------ vllm-ascend #16980


@pytest.mark.parametrize("tree", ["legacy_tree", "upd_tree"])
def test_vllm_ascend_16980_draft_and_target_layers_read_their_own_kv_groups_block_table(
    request: pytest.FixtureRequest, tree: str
) -> None:
    """#16980 (MTP acceptance 0 %): draft layers read KV group 0's block table. Here the target group and
    the draft's group are built in one step with different tables: each group's graphbuf table holds its
    own runner's rows, before and after the other group's refresh."""
    fixture = request.getfixturevalue(tree)
    av1 = fixture.av1
    target_builder, draft_builder = make_builder(av1), make_builder(av1)
    target_runner, draft_runner = Runner(), Runner()
    routes = []
    for builder, runner, base in ((target_builder, target_runner, 0), (draft_builder, draft_runner, 3)):
        common = runner.common(av1, [1, 1, 1], "DecodeOnly", padded_reqs=SIZE)
        common.num_input_tokens = SIZE
        runner.block_table[:3] = (torch.arange(3 * WIDTH, dtype=torch.int32).reshape(3, WIDTH) + base) % 6
        routes.append(getattr(builder.build(0, common), routing.ROUTE_ATTR))
    target, draft = (_apply(r) for r in routes)
    assert target.group is not draft.group
    assert target.block_table.data_ptr() != draft.block_table.data_ptr()
    assert torch.equal(target.block_table[:3], target_runner.block_table[:3])
    assert torch.equal(draft.block_table[:3], draft_runner.block_table[:3])
    assert not torch.equal(target.block_table[:3], draft.block_table[:3])


# ------------------------------------------------------------------------------------ vllm-ascend #15461


@pytest.mark.parametrize("k", [1, 2, 3])
def test_vllm_ascend_15461_padded_mtp_requests_leave_no_stale_row_or_length(legacy_tree: Any, k: int) -> None:
    """#15461: padded MTP requests kept the state of the requests that sat in their rows before. A full
    batch of 4 long requests, then 2 live requests padded to the same capture size: rows 2 and 3 of
    graphbuf's table and lengths are 0, and so are their host lengths."""
    av1, q = legacy_tree.av1, 1 + k
    builder, runner = make_builder(av1, spec_tokens=k), Runner()
    routes = []
    for live in (4, 2):
        common = runner.common(av1, [q] * live, "SpecDecoding", padded_reqs=4)
        common.num_input_tokens = 4 * q
        runner.seq_lens[:4] = torch.tensor([11, 12, 10, 9], dtype=torch.int32)  # rows 2, 3 keep old values
        routes.append(getattr(builder.build(0, common), routing.ROUTE_ATTR))
    full, padded = routes
    assert (full.q_len, full.size, padded.size) == (q, 4 * q, 4 * q)
    assert full.seq_lens.data_ptr() == padded.seq_lens.data_ptr()  # one captured buffer
    assert padded.seq_lens.tolist() == [11, 12, 0, 0]
    assert not padded.block_table[2:].any()
    assert padded.seq_lens_host == (11, 12, 0, 0) and padded.num_reqs == 2


# ---------------------------------------------------------------------------- vllm-ascend #12840, #13779


@pytest.mark.parametrize("tree", ["legacy_tree", "upd_tree"])
def test_vllm_ascend_12840_13779_a_padded_requests_kv_length_is_never_negative(
    request: pytest.FixtureRequest, tree: str
) -> None:
    """#12840, #13779: a padded request's KV length came out as -2. The runner's padded rows here hold -2;
    graphbuf's lengths for them are 0 on the device and on the host, and a negative live length is refused
    before a byte is written."""
    fixture = request.getfixturevalue(tree)
    model = Model(fixture)
    route = _apply(routing.route_of(model.build([5, 9], padded_rows=-2)))
    assert route.seq_lens.tolist() == [5, 9, 0, 0] and route.seq_lens_host == (5, 9, 0, 0)
    assert min(route.seq_lens.tolist()) >= 0
    before = route.seq_lens.clone()
    with pytest.raises(RefreshError, match=r"host KV lengths \[5, -2\].*must lie in \[0, 12\]"):
        model.build([5, -2])
    assert torch.equal(route.seq_lens, before)


# ------------------------------------------------------------------------------------ vllm-ascend #14024


@pytest.mark.parametrize("k", [0, 2])
def test_vllm_ascend_14024_capacity_is_checked_against_the_largest_size_at_activation(
    legacy_tree: Any, k: int
) -> None:
    """#14024: the slot mapping was sized for max_num_seqs, not max_num_seqs x (1 + k). At a group's
    activation graphbuf's tables must hold the largest routed capture size's requests; vLLM's default sizes
    reach max_num_seqs x (1 + k) tokens, which route with exactly max_num_seqs rows."""
    av1, q = legacy_tree.av1, 1 + k
    builder = make_builder(av1, spec_tokens=k, capture_sizes=[q * r for r in (1, 2, 4, 8, 16, 32)])
    checked: list[tuple[Any, ...]] = []
    real_check = resolve.GroupBuffers.check_capacity

    def check(self: Any, *args: Any) -> None:
        checked.append(args)
        real_check(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(resolve.GroupBuffers, "check_capacity", check)
        group = resolve.group_buffers(builder, "cpu", kernel_block_size=4)
    assert checked == [(16, 2048)]  # at the group's activation, with the vLLM config's envelope
    assert max(group.capture_sizes) == 16 * q  # 16 = max_num_seqs; 32 requests are left to upstream
    assert group.not_routed == (32 * q,)
    rows = {name: int(group.buffers.view(16 * q)[name].shape[0]) for name in resolve.ROUTED_BUFFERS}
    assert rows == dict.fromkeys(resolve.ROUTED_BUFFERS, 16)
    per_request = rf"{16 * q} tokens // {q} tokens per request = 16 rows > max_num_seqs 8"
    with pytest.raises(SpecError, match=per_request):
        group.check_capacity(8, 2048)
    with pytest.raises(SpecError, match=rf"{16 * q} tokens > max_num_batched_tokens 8 \(the runner's slot"):
        group.check_capacity(None, 8)


def test_vllm_ascend_14024_a_planned_size_beyond_the_capacity_fails_activation(
    legacy_tree: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sizing bug that would let a capture size past max_num_seqs x (1 + k) through (planted here in the
    envelope) is stopped at the group's activation, naming the size: the group keeps upstream's path."""
    monkeypatch.setattr(resolve, "envelope_sizes", lambda sizes, tpr, constants: (sorted(sizes), []))
    builder = make_builder(legacy_tree.av1, spec_tokens=1, capture_sizes=[2, 4, 64])
    with caplog.at_level(logging.WARNING, logger=resolve.__name__):
        assert resolve.group_buffers(builder, "cpu", kernel_block_size=4) is None
    [line] = [r.getMessage() for r in caplog.records if r.name == resolve.__name__]
    assert "not routed" in line and "64" in line and "max_num_seqs" in line

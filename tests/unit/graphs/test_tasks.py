"""Host task arguments: captured tasks re-issued with fresh host args (cpu emulator)."""

from __future__ import annotations

import pytest
import torch

from graphbuf.errors import CaptureError
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.tasks import CapturedTask, FrozenList, TaskKind


def masked_row_sum(x: torch.Tensor, out: torch.Tensor, *, seq_lens: list[int]) -> None:
    """Like an attention kernel with host ``actual_seq_lengths``: row i sums its first seq_lens[i] values."""
    assert isinstance(seq_lens, list)  # the task function gets lists back, not frozen tuples
    for i, n in enumerate(seq_lens):
        out[i] = x[i, :n].sum()


def _setup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.arange(12.0).reshape(3, 4)
    return x, torch.zeros(3), torch.zeros(1)


def _expected(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    return torch.stack([x[i, :n].sum() for i, n in enumerate(lens)])


def test_task_kinds_are_told_apart_by_name() -> None:
    assert TaskKind.parse("attention") is TaskKind.ATTENTION
    assert TaskKind.parse(TaskKind.SLIDING_ATTENTION) is TaskKind.SLIDING_ATTENTION
    assert str(TaskKind.PAGED_ATTENTION) == "paged_attention"
    assert len({k.value for k in TaskKind}) == len(TaskKind)
    with pytest.raises(ValueError, match="allowed: 'attention'"):
        TaskKind.parse("attn")


def test_baked_until_update_then_updated_and_persistent() -> None:
    x, out, total = _setup()
    g = Graph("cpu")
    with g.capture():
        task = g.task(TaskKind.ATTENTION, masked_row_sum, x, out, seq_lens=[1, 2, 3])
        torch.sum(out, 0, keepdim=True, out=total)  # a consumer after the task sees the task's output
    assert isinstance(task, CapturedTask) and g.tasks == (task,)
    assert task.kind is TaskKind.ATTENTION and task.host_args["seq_lens"] == [1, 2, 3]

    g.replay()  # baked values
    assert torch.equal(out, _expected(x, [1, 2, 3]))
    assert total.item() == out.sum().item()

    task.update(seq_lens=[4, 1, 2])
    assert torch.equal(out, _expected(x, [1, 2, 3]))  # an update takes effect at the next replay
    assert task.host_args["seq_lens"] == [4, 1, 2] and task.updates == 1

    g.replay()
    assert torch.equal(out, _expected(x, [4, 1, 2]))
    assert total.item() == out.sum().item()

    x.add_(1.0)  # device inputs still refresh in place; the update persists across replays
    g.replay()
    g.replay()
    assert torch.equal(out, _expected(x, [4, 1, 2]))


def test_update_validates_names_and_forms() -> None:
    x, out, _ = _setup()
    g = Graph("cpu")
    with g.capture():
        task = g.task("attention", masked_row_sum, x, out, seq_lens=[1, 2, 3])
    with pytest.raises(CaptureError, match=r"missing: \['seq_lens'\], unknown: \['seq_len'\]"):
        task.update(seq_len=[1, 1, 1])
    with pytest.raises(CaptureError, match=r"unknown: \['extra'\]"):
        task.update(seq_lens=[1, 1, 1], extra=2)
    with pytest.raises(CaptureError, match="sequence of 3 values"):
        task.update(seq_lens=[1, 1])  # the captured batch size is fixed
    with pytest.raises(CaptureError, match="a scalar"):
        task.update(seq_lens=3)
    with pytest.raises(TypeError, match="tensor_args"):
        task.update(seq_lens=torch.tensor([1, 1, 1]))
    assert task.host_args["seq_lens"] == [1, 2, 3] and task.updates == 0
    g.replay()
    assert torch.equal(out, _expected(x, [1, 2, 3]))


def test_host_args_are_a_read_only_copy() -> None:
    x, out, _ = _setup()
    lens = [1, 2, 3]
    g = Graph("cpu")
    with g.capture():
        task = g.task("attention", masked_row_sum, x, out, seq_lens=lens)
    lens[0] = 4  # the caller's list changing later changes nothing
    with pytest.raises(TypeError):
        task.host_args["seq_lens"] = [9, 9, 9]  # type: ignore[index]
    assert isinstance(task.host_args["seq_lens"], FrozenList)
    assert task.host_args["seq_lens"] == [1, 2, 3]
    g.replay()
    assert torch.equal(out, _expected(x, [1, 2, 3]))


def test_task_argument_errors() -> None:
    x, out, _ = _setup()
    g = Graph("cpu")
    with pytest.raises(CaptureError, match="only valid inside capture"):
        g.task("attention", masked_row_sum, x, out, seq_lens=[1, 2, 3])
    lens = torch.tensor([1, 2, 3])
    with g.capture():
        with pytest.raises(TypeError, match="tensor_args"):
            g.task("attention", masked_row_sum, x, out, seq_lens=lens)
        with pytest.raises(TypeError, match=r"tensor_args\[1\]"):
            g.task("attention", masked_row_sum, x, [1, 2, 3])
        with pytest.raises(ValueError, match="unknown task kind"):
            g.task("nope", masked_row_sum, x, out, seq_lens=[1, 2, 3])
    assert g.tasks == ()


def _two_kinds() -> tuple[Graph, torch.Tensor, CapturedTask, CapturedTask, torch.Tensor, torch.Tensor]:
    """A graph with one ``attention`` and one ``sliding_attention`` task over the same input, both captured
    with lengths [1, 1, 1]: (graph, input, full task, sliding task, full output, sliding output)."""
    x = torch.arange(12.0).reshape(3, 4)
    full_out, sliding_out = torch.zeros(3), torch.zeros(3)
    g = Graph("cpu")
    with g.capture():
        full = g.task("attention", masked_row_sum, x, full_out, seq_lens=[1, 1, 1])
        sliding = g.task("sliding_attention", masked_row_sum, x, sliding_out, seq_lens=[1, 1, 1])
    return g, x, full, sliding, full_out, sliding_out


def test_update_tasks_by_kind_only_touches_that_kind() -> None:
    g, x, full, sliding, full_out, sliding_out = _two_kinds()
    assert g.update_tasks("attention", seq_lens=[2, 3, 4]) == 1
    g.replay()
    assert torch.equal(full_out, _expected(x, [2, 3, 4]))
    assert torch.equal(sliding_out, _expected(x, [1, 1, 1]))
    assert full.updates == 1 and sliding.updates == 0
    assert g.update_tasks(TaskKind.MLA_ATTENTION, seq_lens=[1, 1, 1]) == 0


def test_reissue_updates_only_tasks_whose_host_args_changed() -> None:
    g, x, full, sliding, full_out, sliding_out = _two_kinds()
    assert g.reissue({"attention": {"seq_lens": [1, 1, 1]}, "mla_attention": {"seq_lens": [2, 2, 2]}}) == 0
    assert full.updates == 0 and sliding.updates == 0  # nothing new: no task update issued
    assert g.reissue({"attention": {"seq_lens": [2, 3, 4]}, "sliding_attention": {}}) == 1
    g.replay()
    assert torch.equal(full_out, _expected(x, [2, 3, 4]))
    assert torch.equal(sliding_out, _expected(x, [1, 1, 1]))
    assert full.updates == 1 and sliding.updates == 0


def test_failed_update_keeps_the_previous_task() -> None:
    x, out, _ = _setup()

    def picky(x: torch.Tensor, out: torch.Tensor, *, seq_lens: list[int]) -> None:
        if max(seq_lens) > 4:
            raise ValueError("seq_len beyond the block table")
        masked_row_sum(x, out, seq_lens=seq_lens)

    g = Graph("cpu")
    with g.capture():
        task = g.task("attention", picky, x, out, seq_lens=[1, 2, 3])
    with pytest.raises(ValueError, match="block table"):
        task.update(seq_lens=[9, 9, 9])
    assert task.host_args["seq_lens"] == [1, 2, 3]
    g.replay()
    assert torch.equal(out, _expected(x, [1, 2, 3]))


def test_update_reads_back_raise_inside_the_task() -> None:
    x, out, _ = _setup()

    def reads_back(x: torch.Tensor, out: torch.Tensor, *, n: int) -> None:
        out.fill_(x[0, :n].sum().item())

    g = Graph("cpu")
    with pytest.raises(CaptureError, match="item"), g.capture():
        g.task("custom", reads_back, x, out, n=2)
    assert not g.captured


def test_task_output_used_outside_the_task_is_rejected() -> None:
    x = torch.ones(3)
    stash: dict[str, torch.Tensor] = {}

    def leaky(x: torch.Tensor) -> None:
        stash["y"] = x * 2  # a fresh tensor, not a preallocated one among tensor_args

    g = Graph("cpu")
    with pytest.raises(CaptureError, match="preallocated tensor"), g.capture():
        g.task("custom", leaky, x)
        _ = stash["y"] + 1
    assert not g.captured and g.tasks == ()


def test_stale_task_after_reset_and_update_inside_capture() -> None:
    x, out, _ = _setup()
    g = Graph("cpu")
    with g.capture():
        task = g.task("attention", masked_row_sum, x, out, seq_lens=[1, 2, 3])
        with pytest.raises(CaptureError, match="after capture"):
            task.update(seq_lens=[2, 2, 2])
    g.reset()
    assert g.tasks == ()
    with pytest.raises(CaptureError, match="no longer holds"):
        task.update(seq_lens=[2, 2, 2])


def test_tasks_in_emulator_and_main_recording_keep_order() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    out = torch.zeros(3)
    g = Graph("cpu")
    with g.capture():
        scaled = x * 2  # before the task
        task = g.task("attention", masked_row_sum, scaled, out, seq_lens=[4, 4, 4])
        result = out + 1  # after the task
    x.fill_(1.0)
    task.update(seq_lens=[1, 2, 3])
    g.replay()
    assert torch.equal(result, torch.tensor([3.0, 5.0, 7.0]))
    assert g.emulator is not None and g.emulator.num_steps > 0

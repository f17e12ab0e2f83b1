"""``graphbuf/graphs/watch.py``: what a captured graph uses but does not own, checked before every replay
(alive, same address, shape and stride), named in the error."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from graphbuf import AddressChangedError, LivenessError
from graphbuf.graphs.watch import Checked, Watch


def test_watch_check_returns_the_checked_tensors_tagged_with_their_watch() -> None:
    """``Watch.check``: the default ``where`` is ``replay`` (``check__mutmut_2``), the result carries its
    watch so a replay can skip a second check (``check__mutmut_5``)."""
    a, b = torch.zeros(2), torch.ones(3)
    w = Watch([("a", a), ("b", b), ("a again", a)])
    checked = w.check()
    assert checked.watch is w and list(checked) == [a, b, a] and len(w) == 3
    b.resize_(4)
    with pytest.raises(AddressChangedError, match=r"^replay: b moved"):
        w.check()


def test_watch_errors_say_what_happened_and_what_to_do() -> None:
    """The full texts of the freed and moved errors (``_error__mutmut_13``/``_25``/``_26``/``_28``)."""
    a = torch.zeros(2)
    ptr = a.data_ptr()
    w = Watch([("a", a)])
    a.set_(torch.zeros(2, 2))
    with pytest.raises(AddressChangedError) as moved:
        w.check("before replay")
    assert str(moved.value) == (
        f"before replay: a moved: captured at {ptr:#x} shape [2] stride [1] float32, now {a.data_ptr():#x} "
        "shape [2, 2] stride [2, 1] float32; the graph still uses the captured address and type. It was "
        "rebound (set_, .data = or a new tensor), resized, restrided or re-typed instead of written in "
        "place; copy into it (t.copy_(new)) or capture again."
    )
    c = torch.zeros(3)
    ptr = c.data_ptr()
    w = Watch([("c", c)])
    del c
    with pytest.raises(LivenessError) as freed:
        w.check()
    assert str(freed.value) == (
        f"replay: c (captured at {ptr:#x}, shape [3]) was freed after capture; the graph would read or write "
        "released memory. Keep every tensor a graph uses alive as long as the graph, or capture again."
    )


def test_an_unchanged_watch_passes_and_keeps_its_order_and_labels() -> None:
    a, b = torch.zeros(4), torch.ones(2, 3)
    w = Watch([("b", b), ("a", a)])
    assert w.labels == ("b", "a") and len(w) == 2
    for _ in range(3):
        checked = w.check("refresh")
        assert isinstance(checked, Checked) and list(checked) == [b, a]
    a.copy_(torch.arange(4.0))  # written in place: the graph reads the new values at the same address
    assert w.check()[1] is a


def test_an_empty_watch_checks_nothing() -> None:
    w = Watch()
    assert len(w) == 0 and w.labels == () and list(w.check()) == []


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: t.resize_(3, 3), id="resized"),
        pytest.param(lambda t: t.set_(torch.zeros(2, 4)), id="rebound"),
        pytest.param(lambda t: t.as_strided_((4, 2), (1, 4)), id="restrided"),
        pytest.param(lambda t: t.unsqueeze_(0), id="reshaped-in-place"),
    ],
)
def test_every_change_of_geometry_is_named_with_its_label(change) -> None:
    keep, t = torch.zeros(5), torch.zeros(2, 4)
    w = Watch([("keep", keep), ("block_table[8]", t)])
    change(t)
    with pytest.raises(AddressChangedError, match=r"^replay: block_table\[8\] moved: captured at 0x"):
        w.check()


def test_a_freed_tensor_is_reported_even_after_the_check_that_would_pass() -> None:
    t = torch.zeros(3)
    w = Watch([("kv_cache", t)])
    w.check()
    del t
    gc.collect()
    freed = r"^step: kv_cache \(captured at 0x[0-9a-f]+, shape \[3\]\) was freed"
    with pytest.raises(LivenessError, match=freed):
        w.check("step")


def test_named_relabels_what_it_watches_and_appends_what_it_did_not() -> None:
    """``named``: a watched tensor takes the caller's name and keeps its captured geometry (a tensor moved
    before ``named`` is still reported); an unwatched one is appended at its present geometry."""
    a, b, extra = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    w = Watch([("input 0", a), ("input 1", b)])
    b.resize_(6)
    n = w.named({"seq_lens": a, "workspace": extra})
    assert n.labels == ("seq_lens", "input 1", "workspace") and len(w) == 2
    with pytest.raises(AddressChangedError, match=r"^replay: input 1 moved"):
        n.check()


def test_named_keeps_a_dead_entry_so_the_next_check_reports_it() -> None:
    a, gone = torch.zeros(2), torch.zeros(2)
    w = Watch([("a", a), ("gone", gone)])
    del gone
    gc.collect()
    n = w.named({"a": a})
    assert n.labels == ("a", "gone")
    with pytest.raises(LivenessError, match=r"^replay: gone "):
        n.check()


def test_the_watch_holds_no_strong_reference() -> None:
    t = torch.zeros(2)
    ref = weakref.ref(t)
    w = Watch([("t", t)])
    del t
    gc.collect()
    assert ref() is None and len(w) == 1


def test_named_goes_on_past_a_dead_entry() -> None:
    """A dead entry in the middle keeps its place; the live ones after it are still named."""
    a, gone, c = torch.zeros(2), torch.zeros(2), torch.zeros(3)
    w = Watch([("a", a), ("gone", gone), ("input 2", c)])
    del gone
    gc.collect()
    assert w.named({"a": a}).labels == ("a", "gone", "input 2")
    c.resize_(6)  # moved before naming: the name keeps the captured geometry, so the move is reported
    n = w.named({"a": a, "positions": c})
    assert n.labels == ("a", "gone", "positions")
    with pytest.raises(LivenessError, match=r"^replay: gone "):
        n.check()

"""``graphbuf/exclusive.py``: one caller at a time; a second raises instead of waiting."""

from __future__ import annotations

import threading

import pytest

from graphbuf import ConcurrentUseError
from graphbuf.exclusive import Exclusive


def test_hold_runs_the_block_and_releases_on_exit_and_on_error() -> None:
    guard = Exclusive("{call} while busy")
    with guard.hold("refresh()"):
        pass
    with pytest.raises(KeyError), guard.hold("refresh()"):
        raise KeyError("x")
    with guard.hold("again()"):  # released after the error
        pass


def test_a_second_caller_raises_with_its_own_call_named() -> None:
    guard = Exclusive("StaticBuffers: {call} called while another call is running")
    with guard.hold("refresh()"):
        with (
            pytest.raises(ConcurrentUseError, match=r"^StaticBuffers: view\(\) called while another"),
            guard.hold("view()"),
        ):
            pass
        with pytest.raises(ConcurrentUseError, match=r"^StaticBuffers: bind\(\) called"):
            guard.enter("bind()")


def test_enter_and_release_pair_without_a_block() -> None:
    guard = Exclusive("{call}")
    guard.enter("refresh()")
    with pytest.raises(ConcurrentUseError, match=r"^refresh\(\)$"):
        guard.enter("refresh()")
    guard.release()
    guard.enter("refresh()")
    guard.release()


def test_another_thread_is_refused_not_kept_waiting() -> None:
    guard, entered, done = Exclusive("{call} busy"), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        with guard.hold("first()"):
            entered.set()
            done.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    entered.wait(5)
    try:
        guard.enter("second()")
    except ConcurrentUseError as exc:
        errors.append(exc)
    done.set()
    t.join(5)
    assert [str(e) for e in errors] == ["second() busy"]

"""``graphbuf/drill/allocator.py``: the drill's process keeps freed heap memory (glibc ``mallopt``)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

import graphbuf.drill.allocator as allocator


def test_on_linux_glibc_the_thresholds_are_set() -> None:
    code = "from graphbuf.drill.allocator import keep_freed_memory as k; print(k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("True" if sys.platform.startswith("linux") else "False"), out.stderr
    assert allocator.MMAP_THRESHOLD == 256 << 20 and allocator.TRIM_THRESHOLD == 512 << 20


def test_without_a_c_library_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert allocator.keep_freed_memory() is False
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.keep_freed_memory() is False


def test_graphbuf_drill_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphbuf import cli

    called = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: called.append(1) or True)
    monkeypatch.setattr("graphbuf.drill.session.run_drill_cli", lambda *a, **k: 0)
    assert cli.main(["drill", "gemma4-31b-it-mtp", "--replays", "0"]) == 0
    assert called == [1]

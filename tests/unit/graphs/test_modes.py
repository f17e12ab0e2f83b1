"""``graphbuf/graphs/modes.py``: graphbuf's dispatch modes are left as written (no torch._dynamo import)."""

from __future__ import annotations

import subprocess
import sys

from torch.utils._python_dispatch import TorchDispatchMode

import graphbuf.graphs.emulator.ops
import graphbuf.graphs.emulator.recording
import graphbuf.graphs.guards
from graphbuf.graphs.modes import DispatchMode


def test_a_mode_keeps_its_own_torch_dispatch() -> None:
    def raw(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    mode = type("M", (DispatchMode,), {"__torch_dispatch__": raw})
    assert mode.__dict__["__torch_dispatch__"] is raw  # torch did not wrap it
    modules = (graphbuf.graphs.emulator.ops, graphbuf.graphs.emulator.recording, graphbuf.graphs.guards)
    modes = [
        v for m in modules for v in vars(m).values()
        if isinstance(v, type) and issubclass(v, TorchDispatchMode) and v.__module__ == m.__name__
    ]  # fmt: skip
    assert len(modes) == 3 and all(issubclass(v, DispatchMode) for v in modes), modes


def test_capture_and_replay_never_import_torch_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from graphbuf import Graph\n"
        "x = torch.ones(4)\n"
        "g = Graph('cpu')\n"
        "with g.capture():\n"
        "    y = (x * 2).sum()\n"
        "g.replay()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr

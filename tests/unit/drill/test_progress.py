"""graphbuf.drill.progress: the one progress printer of every drill mode (issue 33 §3), and ``--replays``'
default; imports no torch."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from graphbuf.drill.progress import Progress


def test_off_a_terminal_a_line_comes_every_interval_even_when_the_count_stands_still() -> None:
    stream = io.StringIO()
    progress = Progress(stream, interval=0.2)
    progress("capture", 0, 3)  # a long capture: no call for a while
    time.sleep(0.75)
    progress("capture", 3, 3)
    time.sleep(0.5)  # the phase ended: nothing more until the next call
    progress.close()
    lines = stream.getvalue().splitlines()
    waiting = [line for line in lines if line.startswith("drill: 0/3 sizes captured, ")]
    assert len(waiting) >= 2 and all(line.endswith("s so far") for line in waiting), lines
    assert lines[-1].startswith("drill: 3/3 sizes captured in "), lines
    assert "\r" not in stream.getvalue()


def test_other_phases_are_named_as_given_and_close_stops_the_ticker() -> None:
    stream = io.StringIO()
    progress = Progress(stream, interval=0.1)
    progress("contract", 0, 4)
    progress("decode steps", 1, 4)
    progress.close()
    text = stream.getvalue()
    time.sleep(0.3)
    assert stream.getvalue() == text and "drill: 1/4 decode steps, ETA " in text


def test_the_module_imports_no_torch() -> None:
    code = "import sys, graphbuf.drill.progress; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "False"

"""Progress of every ``graphbuf drill`` mode on stderr, and the default of ``--replays``; imports no torch.

:class:`Progress` is the one progress printer: the attention drill, ``--replay``, ``--padding-contract`` and
the whole-model drill call it as ``progress(phase, done, total)``. On a terminal it keeps one line, rewritten
in place with an ETA; otherwise it prints a plain line at most every 5 s, at each phase's end, and (from a
daemon thread) every 5 s while a long step keeps the count from moving.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from graphbuf.errors import UsageError

__all__ = ["DEFAULT_REPLAYS", "INTERVAL", "REPLAYS_ENV", "Progress", "default_replays"]

REPLAYS_ENV = "GRAPHBUF_DRILL_REPLAYS"
"""Environment variable: the default of ``graphbuf drill --replays`` (60 when unset)."""
DEFAULT_REPLAYS = 60

#: Seconds between plain progress lines off a terminal.
INTERVAL = 5.0
#: What a phase counts, as the progress line names it (any other phase is named as given).
UNITS = {"capture": "sizes captured", "replay": "replays", "contract": "padding trials"}


def default_replays() -> int:
    """``--replays`` when not given: ``$GRAPHBUF_DRILL_REPLAYS``, else 60; UsageError if it is not an
    integer ≥ 0."""
    text = os.environ.get(REPLAYS_ENV)
    if text is None or not text.strip():
        return DEFAULT_REPLAYS
    if not text.strip().isdigit() or len(text.strip()) > 9:
        raise UsageError(f"{REPLAYS_ENV}={text[:40]!r}: must be an integer ≥ 0 (at most 9 digits)")
    return int(text)


class Progress:
    """``progress(phase, done, total)`` on ``stream`` (default stderr); ``interval``: seconds between plain
    lines off a terminal. Call :meth:`close` when the run ends."""

    def __init__(self, stream: Any = None, interval: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = INTERVAL if interval is None else interval
        self.started: dict[str, float] = {}
        self.last = 0.0
        self.width = 0
        self._state: tuple[str, int, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self.started.setdefault(phase, now)
            self._state = (phase, done, total)
            gap = 0.2 if self.tty else self.interval
            if done < total and (now - self.last < gap or not (done or self.tty)):
                self._start_ticker()
                return
            self._write(now)

    def _line(self, now: float) -> str:
        assert self._state is not None
        phase, done, total = self._state
        began = self.started[phase]
        line = f"drill: {done}/{total} {UNITS.get(phase, phase)}"
        if done and done < total:
            line += f", ETA {(now - began) / done * (total - done):.0f} s"
        elif done >= total:
            line += f" in {now - began:.1f} s"
        else:
            line += f", {now - began:.0f} s so far"
        return line

    def _write(self, now: float) -> None:
        self.last = now
        line = self._line(now)
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _start_ticker(self) -> None:
        if self.tty or self._ticker is not None:
            return
        self._ticker = threading.Thread(target=self._tick, name="graphbuf-drill-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval / 5):
            with self._lock:
                now = time.perf_counter()
                state = self._state
                if state is not None and state[1] < state[2] and now - self.last >= self.interval:
                    self._write(now)

    def close(self) -> None:
        """Stop the 5 s ticker; end the terminal line."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0

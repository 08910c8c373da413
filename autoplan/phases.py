"""Where planning's seconds go: tracing, building strategies, building ILPs, solving them and
pricing plans. `autoplan.plan` counts them (`counted`) and logs the split at its end (shown by
``-v`` on the command line); the steps mark their work with `timed`, which counts nothing
outside a `counted` block.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

# the phases in the order they are reported
PHASES = ("trace", "strategies", "ILP build", "solve", "pricing")


class _Counter:
    """The seconds of each phase so far, and whether a phase is running in a thread (so that
    a phase inside another counts once, in the outer one). Threads that plan side by side
    (`autoplan.side_by_side`) each count their own seconds: the phases can then add up to
    more than the wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._running = threading.local()
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return getattr(self._running, "phase", False)

    @running.setter
    def running(self, value: bool) -> None:
        self._running.phase = value

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds


_current: contextvars.ContextVar[_Counter | None] = contextvars.ContextVar(
    "autoplan_phases", default=None
)


@contextmanager
def counted() -> Iterator[dict[str, float]]:
    """Count the seconds of every `timed` phase inside the block, into the dict it gives."""
    counter = _Counter()
    token = _current.set(counter)
    try:
        yield counter.seconds
    finally:
        _current.reset(token)


@contextmanager
def timed(phase: str) -> Iterator[None]:
    """Count the block's seconds as ``phase`` (one of `PHASES`) of the `counted` block around
    it, if any."""
    counter = _current.get()
    if counter is None or counter.running:
        yield
        return
    counter.running = True
    start = time.perf_counter()
    try:
        yield
    finally:
        counter.running = False
        counter.add(phase, time.perf_counter() - start)


def split(seconds: dict[str, float], elapsed: float) -> str:
    """``"trace 2.1 s, strategies 0.8 s, ..., other 0.3 s"`` of ``elapsed`` seconds (the
    phases' seconds summed over the threads that ran them)."""
    parts = [f"{phase} {seconds.get(phase, 0.0):.1f} s" for phase in PHASES]
    other = elapsed - sum(seconds.get(phase, 0.0) for phase in PHASES)
    return ", ".join([*parts, f"other {max(other, 0.0):.1f} s"])

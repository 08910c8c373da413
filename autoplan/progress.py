"""Progress of long work (a profile, a plan): what the library reports to a callback as it
goes, and the line the command line draws from it on stderr (`autoplan.cli`). The library
itself prints nothing.

`autoplan.profile` reports the share of its curves measured; the planner counts ILPs solved of
the ILPs known so far (`Tally`): which ones it will solve is learned as it goes (a pipeline's
layers, tighter memory budgets), so the share done is of the work known at the time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """How far some work is: `done` in [0, 1], `elapsed` seconds, what is being done, and
    whether a unit worth one line in a log (a curve measured, a mesh planned) has just
    finished."""

    done: float
    elapsed: float
    label: str
    milestone: bool

    def line(self, width: int = 24) -> str:
        """One line of text: a bar, the percentage, the label, elapsed and estimated time left
        (elapsed time scaled by the work left; its units cost roughly alike)."""
        filled = round(self.done * width)
        left = _clock(self.elapsed * (1 - self.done) / self.done) if self.done > 0 else "?"
        return (
            f"[{'#' * filled}{'-' * (width - filled)}] {self.done:4.0%} {self.label:<34} "
            f"elapsed {_clock(self.elapsed)}, about {left} left"
        )


OnProgress = Callable[[Progress], None]


class Tally:
    """Units of work done of those known so far, each named ``unit`` ("ILP"), reported to
    ``on_progress`` (if any) as each is done. Work is announced when it is found (`expect`) and
    withdrawn when it turns out not to be needed (`withdraw`). Threads planning side by side
    share one tally: ``on_progress`` is called by one of them at a time."""

    def __init__(self, on_progress: OnProgress | None, unit: str) -> None:
        self._on_progress = on_progress
        self._unit = unit
        self._start = time.perf_counter()
        self._lock = threading.RLock()
        self.done = 0
        self.total = 0

    def expect(self, count: int) -> None:
        with self._lock:
            self.total += count

    def withdraw(self, count: int) -> None:
        with self._lock:
            self.total = max(self.done, self.total - count)

    def did(self, what: str, milestone: bool = False) -> None:
        """One unit done: ``what`` it was; a milestone if it finishes something larger."""
        with self._lock:
            self.done += 1
            self.total = max(self.total, self.done)
            self.report(what, milestone)

    def report(self, what: str, milestone: bool = False) -> None:
        """Tell ``on_progress`` what is being done, or (a milestone) what has just finished."""
        if self._on_progress is None:
            return
        with self._lock:
            self._on_progress(
                Progress(
                    done=self.done / self.total if self.total else 0.0,
                    elapsed=time.perf_counter() - self._start,
                    label=f"{self._unit} {self.done}/{self.total}: {what}",
                    milestone=milestone,
                )
            )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}:{secs:02d}"

"""The progress lines the command line draws: planning's on stderr from the library's
`Progress` reports, training's on stdout from its `StepRecord`s."""

from __future__ import annotations

import os
import sys

from autoplan.progress import Progress
from autoplan.training import StepRecord

TTY_ENV = "AUTOPLAN_STDERR_TTY"
PROGRESS_AFTER_S = 3.0  # planning quicker than this shows no progress


class ProgressLine:
    """Progress on stderr once the work has run ``after_s`` seconds: on a terminal one line
    redrawn in place, in a log one line per milestone (a curve measured, a mesh planned)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        # a rank's stderr is a pipe to `autoplan run`, which says whether its own is a terminal
        self.redraw = sys.stderr.isatty() or os.environ.get(TTY_ENV) == "1"
        self.drawn = False

    def __call__(self, p: Progress) -> None:
        if p.elapsed < self.after_s:
            return
        if self.redraw:
            print(f"\r{p.line()}\x1b[K", end="", file=sys.stderr, flush=True)
            self.drawn = True
        elif p.milestone:
            print(p.line(), file=sys.stderr, flush=True)

    def end(self) -> None:
        """Ends the line redrawn in place, before other output."""
        if self.drawn:
            print(file=sys.stderr, flush=True)
            self.drawn = False


_BAR = 20  # characters of the training bar


class StepLine:
    """Training steps on stdout: on a terminal one line redrawn in place, a bar of the steps
    done before each step's numbers; elsewhere (a log, a pipe) one line per step."""

    def __init__(self, steps: int, first: int = 0) -> None:
        self.steps = steps
        self.first = first  # the steps done before this run (resumed)
        self.redraw = sys.stdout.isatty()
        self.drawn = False

    def __call__(self, r: StepRecord) -> None:
        if not self.redraw:
            print(r.line(self.steps), flush=True)
            return
        done = round(_BAR * r.step / self.steps)
        print(
            f"\r[{'#' * done}{'.' * (_BAR - done)}] {r.line(self.steps)}\x1b[K", end="", flush=True
        )
        self.drawn = True

    def end(self) -> None:
        """Ends the line redrawn in place, before other output."""
        if self.drawn:
            print(flush=True)
            self.drawn = False

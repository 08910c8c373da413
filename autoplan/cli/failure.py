"""One message for a failed job: each rank that fails writes what failed and where to a
folder `autoplan run` gave it (instead of printing it: N ranks would print it N times), and
`autoplan run` prints one block of it, in place of torchrun's own report.

The block names the rank (rank 0's error, else the lowest rank's), the phase (before the
first step: tracing, planning, building, resuming; a step and what it was doing; after a
step: its checkpoint), the cause, and what to do: an `AutoplanError` says it; any other
error is one autoplan did not check for, and ``-vv`` prints its traceback. Of a job that
torchrun started again (``--max-restarts``), only the last start's errors are told.
"""

from __future__ import annotations

import json
import os
import re
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

from autoplan.errors import AutoplanError
from autoplan.execute.watchdog import EXIT_CODE, activity

ERRORS_ENV = "AUTOPLAN_ERRORS"  # the folder ranks write their errors to
_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+).*?local_rank\s*:\s*(\d+)")
_OTHERS = 3  # other ranks' differing errors shown


@dataclass(frozen=True)
class RankError:
    rank: int
    phase: str
    kind: str  # the exception's class name
    message: str
    checked: bool  # an AutoplanError: its message says what to do
    traceback: str
    start: int  # torchrun's restart count (--max-restarts): only the last start's are told


def phase(command: str = "run") -> str:
    """Where this rank is in ``command``, from the watchdog's record of the step."""
    if command == "profile":
        return "while measuring the cluster"
    step, doing = activity()
    if step == 0:
        return "before the first step (tracing, planning, building the step or resuming)"
    if doing:
        return f"at step {step} ({doing})"
    return f"after step {step} (saving its checkpoint, or checking the run)"


def record(rank: int, error: BaseException, command: str = "run") -> bool:
    """Write ``error`` for `autoplan run` to report; False where no `autoplan run` asked
    (torchrun started by hand: the rank prints it itself)."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder:
        return False
    found = RankError(
        rank,
        phase(command),
        type(error).__name__,
        str(error),
        isinstance(error, AutoplanError),
        "".join(traceback.format_exception(error)),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    tmp = Path(folder) / f".rank-{rank}.tmp"
    tmp.write_text(json.dumps(found.__dict__))
    tmp.replace(Path(folder) / f"rank-{rank}.json")
    return True


def _read(folder: Path) -> list[RankError]:
    found = []
    for file in sorted(folder.glob("rank-*.json")):
        try:
            found.append(RankError(**json.loads(file.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a rank killed while writing: torchrun's exit codes still tell
    last = max((e.start for e in found), default=0)
    return sorted((e for e in found if e.start == last), key=lambda e: e.rank)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _exit_codes(report: str) -> str:
    """What torchrun's report says of each rank that ended: "rank 1 ended by SIGKILL"."""
    seen: dict[int, str] = {}
    for code, rank in _EXIT.findall(report):
        number = int(code)
        if number < 0:
            try:
                how = f"was ended by {signal.Signals(-number).name}"
            except ValueError:
                how = f"was ended by signal {-number}"
        elif number == EXIT_CODE:
            how = f"was ended by the watchdog (exit code {number}; its message is above)"
        else:
            how = f"exited with code {number}"
        seen.setdefault(int(rank), how)
    return "; ".join(f"local rank {rank} {how}" for rank, how in sorted(seen.items()))


def summary(folder: Path, returncode: int, report: str, verbose: bool) -> tuple[str, int]:
    """The block `autoplan run` prints for a failed job, and its exit code (2 for an error of
    the input, as the command's own errors; 1 otherwise). ``report``: what torchrun printed
    once a rank had failed; ``verbose``: add tracebacks and that report."""
    errors = _read(folder)
    if not errors:
        ended = _exit_codes(report) or f"torchrun exited with code {returncode}"
        text = (
            f"autoplan: error: the job failed without an error from any rank: {ended}. A rank "
            "that is killed (out of memory, a signal) or crashes in native code leaves no "
            "message; its output, if any, is above"
        )
        return text + (f"\n{report.rstrip()}" if verbose and report else ""), 1
    first = next((e for e in errors if e.rank == 0), errors[0])
    same = [e.rank for e in errors if (e.kind, e.message) == (first.kind, first.message)]
    where = f"on {_ranks(same)}" if len(same) > 1 else f"on rank {first.rank}"
    lines = [f"autoplan: error {where} {first.phase}:"]
    if first.checked:
        lines.append(f"  {first.message}")
    else:
        cause = first.message.strip().splitlines()[0] if first.message.strip() else ""
        frame = _innermost(first.traceback)
        lines.append(f"  {first.kind}: {cause}{frame}")
        lines.append(
            "  autoplan did not check for this error: if the model and inputs train in one "
            "process, report it; -vv prints the traceback"
        )
    others = [e for e in errors if e.rank not in same]
    for e in others[:_OTHERS]:
        head = e.message.strip().splitlines()[0] if e.message.strip() else ""
        lines.append(f"  rank {e.rank} also failed {e.phase}: {e.kind}: {head}")
    if len(others) > _OTHERS:
        lines.append(f"  ({len(others) - _OTHERS} more ranks failed)")
    if verbose:
        lines.append(first.traceback.rstrip())
    return "\n".join(lines), 2 if all(e.checked for e in errors) else 1


def _innermost(text: str) -> str:
    """The innermost frame of a formatted traceback, as " (at file:line)"."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', text)
    return f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""

"""The watchdog: a train step that does not end in time ends the whole job, with a message
that says where every rank was, instead of hanging in a collective forever.

Each rank runs one monitor thread. The step marks what the main thread is doing (`watched`
around a step, `note` at its phases: backward's bucket all-reduces, the pipeline schedule's
sends and receives, the optimizer step); the thread writes a heartbeat with it to the job's
store (torchrun's) every tick. When a watched part outlasts its limit, the thread finds the
ranks whose heartbeat stopped (it reads every rank's, waits a few ticks and reads again: a
stopped or frozen process, SIGSTOP included, beats no more; a rank busy or waiting elsewhere
still does), prints what it waited for, where in the code, and which ranks fell silent, kills
the silent ranks on its own host with SIGKILL (a stopped process ignores SIGTERM until it is
continued, so torchrun's SIGTERM would wait out its 30 s grace), and ends its own process.
torchrun then ends the other ranks and itself. A rank whose launcher is gone (torchrun killed
with SIGKILL leaves its workers, which run in sessions of their own) ends too.

The limit is `step_timeout`: ten times the plan's predicted step time, at least a minute, or
the caller's. Building the step (rank 0 may plan for minutes while the others wait) and
checkpoint I/O are not watched.
"""

from __future__ import annotations

import atexit
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

from autoplan.errors import AutoplanError

FLOOR_S = 60.0
SLACK = 10.0  # times the plan's predicted step time
EXIT_CODE = 124  # as GNU timeout's
_PREFIX = "autoplan-watchdog"
_MAX_LINES = 8  # of other ranks in the message


def step_timeout(predicted_step_s: float, given_s: float | None) -> float:
    """The watchdog's limit for one step: ``given_s`` if set, else ten times the prediction,
    at least `FLOOR_S` (the first step warms caches; predictions can be off several times)."""
    if given_s is None:
        return max(FLOOR_S, SLACK * predicted_step_s)
    if given_s <= 0:
        raise AutoplanError(f"timeout {given_s:g} s: give a positive number of seconds")
    return given_s


@dataclass(frozen=True)
class _Activity:
    step: int
    doing: str
    since: float | None  # time.monotonic() when the watched part began; None: not watched
    limit_s: float


@dataclass(frozen=True)
class _Beat:
    """A rank's heartbeat record in the job's store."""

    beat: int  # counts up while the rank's monitor thread runs
    step: int
    doing: str
    pid: int
    host: str


# What the main thread does now: replaced whole (one assignment), read by the monitor thread.
_activity = _Activity(0, "", None, 0.0)


@contextmanager
def watched(step: int, doing: str, limit_s: float) -> Iterator[None]:
    """Watch the main thread while it does ``doing`` at ``step``: the job ends if it takes
    longer than ``limit_s`` seconds."""
    global _activity
    _activity = _Activity(step, doing, time.monotonic(), limit_s)
    _Monitor.ensure_running()
    try:
        yield
    finally:
        _activity = _Activity(step, "", None, 0.0)


def activity() -> tuple[int, str]:
    """The step the main thread is at and what it does there ("" between steps): where a
    rank was when it failed."""
    return _activity.step, _activity.doing


def note(doing: str) -> None:
    """What the main thread does now, inside a watched part (for the message)."""
    global _activity
    a = _activity
    if a.since is not None:
        _activity = _Activity(a.step, doing, a.since, a.limit_s)


class _Monitor:
    """The thread: heartbeats, and the end of the job when a watched part runs over."""

    _running: _Monitor | None = None

    @classmethod
    def ensure_running(cls) -> None:
        if cls._running is None:
            cls._running = cls()

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host, self.pid, self.parent = socket.gethostname(), os.getpid(), os.getppid()
        # torchrun's agent is the parent; another launcher's may leave legitimately (nohup)
        self.under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        self.beats = 0
        self.tick_s = 1.0
        self.store = _job_store()
        self._beat()  # at once: a rank stopped before its first tick is known too
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoplan-watchdog", daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalizes: a daemon thread still inside the store's
        # C++ call then would be ended mid-call, which aborts the process (SIGABRT at exit).
        atexit.register(self._stop_thread)

    def _stop_thread(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15.0)

    def _run(self) -> None:
        while True:
            a = _activity
            if a.since is not None:
                self.tick_s = min(1.0, max(0.1, a.limit_s / 10))
            if self._stop.wait(self.tick_s):
                return
            self._beat()
            if self.under_torchrun and os.getppid() != self.parent:
                self._end(f"autoplan: rank {self.rank}: its launcher (pid {self.parent}) is gone")
            a = _activity
            if a.since is not None and time.monotonic() - a.since > a.limit_s:
                self._expired(a)

    def _beat(self) -> None:
        self.beats += 1
        if self.store is None:
            return
        a = _activity
        beat = _Beat(self.beats, a.step, a.doing, self.pid, self.host)
        try:
            self.store.set(f"{self.rank}", json.dumps(asdict(beat)))
        except (RuntimeError, OSError):  # the store is gone: the job is ending
            self.store = None

    def _peers(self) -> dict[int, _Beat]:
        """Every other rank's last heartbeat, of those that sent one."""
        if self.store is None:
            return {}
        found = {}
        try:
            for rank in range(self.world):
                if rank != self.rank and self.store.check([f"{rank}"]):
                    found[rank] = _Beat(**json.loads(self.store.get(f"{rank}")))
        except (RuntimeError, OSError):
            self.store = None
        return found

    def _expired(self, a: _Activity) -> None:
        lines = [
            f"autoplan: rank {self.rank}: step {a.step} did not end within {a.limit_s:g} s "
            "(the watchdog's limit: --timeout, or TrainOptions.timeout_s)",
            f"  rank {self.rank} was waiting in {a.doing or 'the step'}",
            f"    {_main_thread_position()}",
        ]
        before = self._peers()
        # a few heartbeats later: a rank that beat no more in between is stopped or frozen
        for _ in range(max(3, round(1.0 / self.tick_s))):
            time.sleep(self.tick_s)
            self._beat()
        after = self._peers()
        silent = [r for r in sorted(before) if r in after and after[r].beat == before[r].beat]
        for rank in silent:
            peer = before[rank]
            killed = peer.host == self.host and _kill(peer.pid)
            lines.append(
                f"  rank {rank} stopped responding (pid {peer.pid} on {peer.host}; last heard "
                f"at step {peer.step}, in {peer.doing or 'no step'})"
                + (": killed" if killed else "")
            )
        others = [
            f"  rank {r} is at step {p.step}, in {p.doing or 'no step'}"
            for r, p in sorted(after.items())
            if r not in silent and (p.step, p.doing) != (a.step, a.doing)
        ]
        unheard = [r for r in range(self.world) if r != self.rank and r not in after]
        if self.store is None:
            others.append("  the other ranks' state is unknown (no job store to read it from)")
        elif unheard:
            others.append(f"  no heartbeat yet from rank(s) {_ranks(unheard)}")
        elif not silent:
            others.append("  every other rank still responds")
        if len(others) > _MAX_LINES:
            others[_MAX_LINES:] = [f"  ... and {len(others) - _MAX_LINES} more"]
        self._end("\n".join(lines + others))

    def _end(self, message: str) -> None:
        print(f"{message}\n  ending the job", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:_MAX_LINES]))
    return shown + (f" and {len(ranks) - _MAX_LINES} more" if len(ranks) > _MAX_LINES else "")


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _job_store() -> dist.Store | None:
    """A client of the job's store (torchrun's, at MASTER_ADDR:MASTER_PORT) of this thread's
    own, under this run's prefix; None if the job has none."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    # A store torchrun's agent shares with the ranks outlives a restart: each start beats
    # under its restart count. Unshared (`autoplan run` that may restart), each start's rank 0
    # opens a store of its own, and the agents' counts may differ (one restarted for a
    # failure, another for a node that joined).
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "own"
    try:
        store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False
        )
    except (RuntimeError, OSError):
        return None
    return dist.PrefixStore(f"{_PREFIX}/{run}/{restart}/", store)


def _main_thread_position() -> str:
    """Where the main thread is: its innermost torch.distributed call and the autoplan line
    that led there."""
    main = threading.main_thread().ident
    frame: FrameType | None = sys._current_frames().get(main) if main is not None else None
    ours = theirs = None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if theirs is None and "/torch/distributed/" in path:
            module = path.rpartition("/torch/")[2].removesuffix(".py").replace("/", ".")
            theirs = f"torch.{module}.{frame.f_code.co_name}"
        if "/autoplan/" in path:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            ours = f"autoplan/{path.rpartition('/autoplan/')[2]}:{frame.f_lineno} {line}"
            break
        frame = frame.f_back
    where = [w for w in (ours and f"at {ours}", theirs and f"in {theirs}") if w]
    return ", ".join(where) or "outside autoplan"

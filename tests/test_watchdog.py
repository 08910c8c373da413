"""The watchdog's limit, and a rank stopped with SIGSTOP mid-training: the whole job ends
within the limit and a few seconds, saying which rank stopped, at which step, and what the
others waited in, and no process of it is left."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoplan.errors import AutoplanError
from autoplan.execute.watchdog import FLOOR_S, step_timeout
from tests.conftest import ROOT

LIMIT_S = 4


def test_the_limit_is_ten_predicted_steps_at_least_a_minute() -> None:
    assert step_timeout(0.05, None) == FLOOR_S == 60
    assert step_timeout(30.0, None) == 300
    assert step_timeout(30.0, 2.5) == 2.5  # the caller's, floor or not
    with pytest.raises(AutoplanError, match="positive"):
        step_timeout(1.0, 0)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _rank(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).partition(b"=")[2])


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job(tmp_path: Path) -> None:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [
        sys.executable,
        "-m",
        "autoplan.cli",
        "run",
        str(ROOT / "examples/mlp.py"),
        "--cluster",
        str(ROOT / "costmodels/cpu-gloo-4.json"),
        "--nproc",
        "2",
        "--set",
        "batch_size=4",
        "--set",
        "hidden=64",
        "--steps",
        "1000000",
        "--timeout",
        str(LIMIT_S),
    ]
    with out.open("w") as stdout, err.open("w") as stderr:
        # a session of its own: a failing test ends torchrun and the ranks too, not only the
        # launcher (left running, they would take the cores of every test after this one)
        launcher = subprocess.Popen(
            cmd, stdout=stdout, stderr=stderr, cwd=tmp_path, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while "step       5/1000000  loss" not in out.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        (torchrun,) = _children(launcher.pid)
        ranks = {_rank(pid): pid for pid in _children(torchrun)}
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        code = launcher.wait(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    message = err.read_text()
    assert code != 0
    # the limit, the watchdog's look at the others (1.5 s) and torchrun's exit (~2 s; slower
    # on a loaded host)
    assert took < LIMIT_S + 15, (took, message[-3000:])
    found = re.search(rf"rank 0: step (\d+) did not end within {LIMIT_S} s", message)
    assert found and int(found[1]) >= 5, message[-3000:]
    assert re.search(r"rank 0 was waiting in .+\n    at autoplan/\S+:\d+ ", message), message
    assert re.search(
        rf"rank 1 stopped responding \(pid {ranks[1]} on .+; last heard at step \d+, "
        r"in .+\): killed",
        message,
    ), message[-3000:]
    assert not any(_running(pid) for pid in [torchrun, *ranks.values()])


_EXIT_CHECK = """
import atexit, os, threading
import torch.distributed as dist
from autoplan.execute import watchdog

def report():  # registered first, so it runs after the watchdog's own exit handler
    alive = [t.name for t in threading.enumerate() if t.name == "autoplan-watchdog"]
    print("watchdog alive at exit:", bool(alive), flush=True)

atexit.register(report)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
watchdog._Monitor.ensure_running()
dist.destroy_process_group()
"""


def test_the_monitor_thread_ends_before_the_interpreter_does() -> None:
    """A daemon thread still inside the store's C++ call when Python finalizes is ended
    mid-call, which aborts the process: the monitor stops at exit instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PORT": str(port)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "watchdog alive at exit: False" in run.stdout

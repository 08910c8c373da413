"""Elastic `autoplan run`: the number of nodes, the plan for the processes a start has, and a
job that loses a node and goes on with the one left."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autoplan
from autoplan.cli.elastic import Nodes, nodes, plan_for_world
from autoplan.cli.run_command import _fitted
from autoplan.errors import AutoplanError
from tests.conftest import ROOT


def test_nodes_are_a_number_or_a_range() -> None:
    assert nodes("2") == Nodes(2, 2) and not nodes("2").elastic and str(nodes("2")) == "2"
    assert nodes("2:4") == Nodes(2, 4) and nodes("2:4").elastic and str(nodes("2:4")) == "2:4"
    for bad, said in (("4:2", "1 <= MIN <= MAX"), ("0:2", "1 <= MIN"), ("two", "MIN:MAX")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            nodes(bad)


def test_the_plan_for_the_processes_a_start_has() -> None:
    given = {"four.json": 4, "three.json": 3}
    assert plan_for_world(given, 3) == ("three.json", None)
    assert plan_for_world({}, 3) == (None, None)
    plan, why = plan_for_world(given, 2)
    assert plan is None and why == (
        "no plan given is for the 2 processes this job has now (four.json (4 devices), "
        "three.json (3 devices)): planning for 2 instead"
    )


def test_a_cluster_file_is_fitted_to_the_processes_left(
    cpu4: autoplan.Cluster, a100: autoplan.Cluster
) -> None:
    assert _fitted(cpu4, 4) is cpu4
    three = _fitted(cpu4, 3)
    assert (three.num_nodes, three.devices_per_node, three.name) == (1, 3, "cpu-gloo-4-3")
    nodes_of_8 = dataclasses.replace(a100, num_nodes=4)
    two = _fitted(nodes_of_8, 16)
    assert (two.num_nodes, two.devices_per_node) == (2, 8)
    with pytest.raises(AutoplanError, match=r"12 processes do not fill nodes .*--nproc 8"):
        _fitted(nodes_of_8, 12)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's ranks run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _kill(pid: int) -> None:
    """End ``pid`` and the processes below it at once, as a machine that is lost."""
    for each in _tree(pid):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(each, signal.SIGKILL)


_LOSS = re.compile(r"step +(\d+)/\d+  loss (\S+)")


def _losses(text: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in _LOSS.finditer(text)}


@pytest.mark.slow
def test_a_lost_node_replans_and_resumes(tmp_path: Path) -> None:
    """Two nodes of 2 processes on this host (each its own `autoplan run --nnodes 1:2`, as on
    two machines) save a checkpoint every step; node 1 is killed whole (its `autoplan run`,
    torchrun's agent, its ranks) after a checkpoint. Node 0 goes on alone: it plans for its 2
    processes, resumes from the newest checkpoint and trains to the end, as `autoplan run
    --resume` on 2 processes does from that checkpoint."""
    run = [sys.executable, "-m", "autoplan.cli", "run", str(ROOT / "examples/mlp.py")]
    run += ["--cluster", str(ROOT / "costmodels/cpu-gloo-4.json"), "--nproc", "2"]
    run += ["--set", "batch_size=12", "--set", "hidden=48", "--steps", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a lost node is dropped after 1 s x 2 keep-alives missed; a rendezvous of fewer than 2
    # nodes waits 5 s for more (at the start, for the node that imports torch more slowly)
    conf = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=5"
    elastic = ["--nnodes", "1:2", "--rdzv-endpoint", f"localhost:{_free_port()}"]
    elastic += ["--max-restarts", "1", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1"]
    logs = [(tmp_path / f"node{i}.out", tmp_path / f"node{i}.err") for i in range(2)]
    nodes = []
    for i, (stdout, stderr) in enumerate(logs):
        host = f"--rdzv-conf=is_host={int(i == 0)},{conf}"  # node 0 keeps the rendezvous
        with stdout.open("w") as o, stderr.open("w") as e:
            nodes.append(
                subprocess.Popen([*run, *elastic, host], stdout=o, stderr=e, cwd=tmp_path, env=env)
            )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ckpt/step-00000003").is_dir():
            assert time.monotonic() < deadline and nodes[0].poll() is None, logs[0][1].read_text()
            time.sleep(0.05)
        _kill(nodes[1].pid)
        assert nodes[0].wait(timeout=120) == 0, logs[0][1].read_text()[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:  # else its pid may be another process's by now
                _kill(node.pid)
    first = "".join(log.read_text() for log, _ in logs)
    assert "training 30 steps on 4 processes" in first
    out = logs[0][0].read_text()
    resumed = re.search(
        r"resumed from ckpt/step-(\d+), saved by 4 processes: resharded into a new plan for 2 "
        r"processes\n",
        out,
    )
    assert resumed, out
    start = int(resumed[1])
    assert start >= 3 and f"training steps {start + 1}-30 on 2 processes" in out
    after = _losses(out[resumed.end() :])
    assert sorted(after) == list(range(start + 1, 31))

    # the same steps from that checkpoint on 2 processes, started as such
    shutil.copytree(tmp_path / f"ckpt/step-{start:08d}", tmp_path / f"ref/step-{start:08d}")
    reference = subprocess.run(
        [*run, "--resume", "--checkpoint-dir", "ref"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(reference.stdout)
    assert sorted(expected) == sorted(after)
    assert [after[s] for s in sorted(after)] == pytest.approx(
        [expected[s] for s in sorted(after)], abs=1e-6
    )

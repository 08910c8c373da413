"""Starting a command again as the ranks of a torchrun job."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from autoplan.cli.elastic import ONE_NODE, Nodes, may_restart
from autoplan.cli.failure import ERRORS_ENV, summary
from autoplan.cli.progress_line import TTY_ENV
from autoplan.errors import AutoplanError

log = logging.getLogger(__name__)

HASH_SEED_ENV = "PYTHONHASHSEED"  # the ranks' string hash seed, the same on every rank


def torchrun(
    argv: Sequence[str],
    nproc: int,
    nodes: Nodes = ONE_NODE,
    rdzv_endpoint: str | None = None,
    *,
    rdzv_conf: str | None = None,
    max_restarts: int = 0,
) -> int:
    """Start this command again as ``nproc`` processes per node under torchrun; they do the
    work. One node rendezvous on its own; more nodes each run the same command and meet at
    ``rdzv_endpoint`` (torchrun's c10d rendezvous, with its settings ``rdzv_conf``). After a
    failure torchrun starts the processes again, up to ``max_restarts`` times, on the nodes
    left (`autoplan.cli.elastic`). The ranks' output streams through; a failed job ends with
    one block (`autoplan.cli.failure`) instead of every rank's error and torchrun's report.
    Returns the exit code: 0, 2 for an error in the input (an `AutoplanError` on the ranks),
    else 1."""
    # The ranks learn their number from torchrun (WORLD_SIZE, LOCAL_WORLD_SIZE); left in,
    # torchrun would take these as its own (--nproc as --nproc-per-node).
    ours = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-conf", "--max-restarts")
    rest = [
        a
        for a, prev in zip(argv, ["", *argv[:-1]], strict=True)
        if a not in ours and prev not in ours and a.partition("=")[0] not in ours
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Every rank traces the model and must get the graph the plan was made for. A model that
    # iterates a set of strings while tracing (transformers' attention-mask kinds) orders its
    # ops by the string hash, which differs from process to process unless the seed is fixed.
    env.setdefault(HASH_SEED_ENV, "0")
    if nodes == ONE_NODE and rdzv_endpoint is None:
        where = ["--standalone"]
    elif rdzv_endpoint:
        where = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        where += [f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []
    else:
        raise AutoplanError(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT of one node")
    if max_restarts:
        where.append(f"--max-restarts={max_restarts}")
    restarts = may_restart(nodes, max_restarts)
    if restarts:
        # A restart's ranks would otherwise meet in the store of the first start, where the
        # last start's keys are left: gloo then reads a lost rank's address and cannot
        # connect. Unshared, each start's rank 0 opens a store of its own.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        "-m",
        "autoplan.cli",
        *rest,
    ]
    if sys.stderr.isatty():
        env[TTY_ENV] = "1"
    with tempfile.TemporaryDirectory(prefix="autoplan-errors-") as folder:
        env[ERRORS_ENV] = folder
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        stderr = _Stderr(restarts)
        try:
            while chunk := os.read(proc.stderr.fileno(), 1 << 16):
                stderr.feed(chunk)
        finally:
            returncode = proc.wait()
        if returncode == 0:
            stderr.flush_held()  # nothing failed: what was held was not a failure report
            return 0
        verbose = log.isEnabledFor(logging.DEBUG)
        text, code = summary(Path(folder), returncode, stderr.held_text(), verbose)
    print(text, file=sys.stderr, flush=True)
    return code


# torchrun's own lines once a rank has failed (its agent's log, then a traceback that ends
# in ChildFailedError): from the first of them on, stderr is held back, not printed
_REPORT = re.compile(rb"torch[./]distributed[./]elastic|ChildFailedError")
# where torchrun's report begins once it starts the processes no more
_FINAL = re.compile(rb"^Traceback|ChildFailedError")


class _Stderr:
    """The ranks' and torchrun's stderr: passed through as it comes until torchrun's failure
    report begins, held from there. In a job that may start again (``restarts``), the agent's
    lines about a failed start pass through (a restart follows), and only the final report is
    held."""

    def __init__(self, restarts: bool = False) -> None:
        self.restarts = restarts
        self.held: list[bytes] = []
        # in a job that may start again: torchrun's lines since the ranks' last, which name
        # the exit codes of the last start's processes
        self.since_ranks: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        out = sys.stderr.buffer
        held_from = _FINAL if self.restarts else _REPORT
        for piece in chunk.splitlines(keepends=True):
            if self.held or held_from.search(piece):
                self.held.append(piece)
                continue
            out.write(piece)
            if not self.restarts:
                continue
            if _REPORT.search(piece):
                self.since_ranks.append(piece)
            else:
                self.since_ranks.clear()
        out.flush()

    def held_text(self) -> str:
        """What torchrun said of the failure: its report, after the lines that named the
        last start's exit codes in a job that may start again."""
        return b"".join(self.since_ranks + self.held).decode(errors="replace")

    def flush_held(self) -> None:
        sys.stderr.buffer.write(b"".join(self.held))
        sys.stderr.flush()

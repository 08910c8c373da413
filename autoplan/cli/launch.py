"""Starting a command again as the ranks of a torchrun job."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from autoplan.errors import AutoplanError


def torchrun(
    argv: Sequence[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None
) -> int:
    """Start this command again as ``nproc`` processes per node under torchrun; they do the
    work. One node rendezvous on its own; more nodes each run the same command and meet at
    ``rdzv_endpoint``."""
    # The ranks learn their number from torchrun (WORLD_SIZE, LOCAL_WORLD_SIZE); left in,
    # torchrun would take these as its own (--nproc as --nproc-per-node).
    ours = ("--nproc", "--nnodes", "--rdzv-endpoint")
    rest = [
        a
        for a, prev in zip(argv, ["", *argv[:-1]], strict=True)
        if a not in ours and prev not in ours and a.partition("=")[0] not in ours
    ]
    if nnodes == 1:
        where = ["--standalone"]
    elif rdzv_endpoint:
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        raise AutoplanError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT of one node")
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
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode

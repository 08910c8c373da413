"""A job's gloo groups end before the interpreter does: DTensor's caches keep every mesh they
saw, and a mesh its groups, so without `released_at_exit` a destroyed group's threads still run
while Python tears down (where, in CI, they ended a clean job with SIGABRT)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# One gloo rank: a mesh, a DTensor op (which caches the mesh), the group destroyed. A handler
# registered before autoplan's runs after it, at exit: it lists the gloo threads still there.
SCRIPT = """
import atexit, os, sys
def gloo_threads():
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    print("gloo threads at exit:", sum("gloo" in n for n in names), flush=True)
atexit.register(gloo_threads)
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from autoplan.torch_private.mesh_release import released_at_exit
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
if sys.argv[1] == "released":
    released_at_exit(mesh)
x = distribute_tensor(torch.ones(4), mesh, [Replicate()])
(x + x).to_local()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("mode", ["released", "kept"])
def test_a_destroyed_group_ends_before_the_interpreter(mode: str) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # kept: the group's threads (workers, a transport loop) outlive destroy_process_group
    found = int(run.stdout.split("gloo threads at exit:")[1].split()[0])
    assert (found == 0) == (mode == "released"), run.stdout

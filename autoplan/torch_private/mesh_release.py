"""The process groups of autoplan's device meshes are let go before the interpreter ends.

A DeviceMesh holds its process groups (``_pg_registry``, torch 2.13), and DTensor's sharding
caches hold every mesh they have seen, for the life of the process. After
`dist.destroy_process_group` a gloo group therefore still lives, its threads running, until
the interpreter tears down; destroyed then, its threads end in ``std::terminate``: a job that
trained and saved cleanly aborts (SIGABRT) at exit. At exit the meshes autoplan made let go of
their groups while Python still runs, so a destroyed group ends there, as torch means it to.
"""

from __future__ import annotations

import atexit
import weakref

from torch.distributed.device_mesh import DeviceMesh

_MESHES: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()


def released_at_exit(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``, to let go of its process groups at the interpreter's exit."""
    _MESHES.add(mesh)
    return mesh


@atexit.register
def _release() -> None:
    for mesh in list(_MESHES):
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):  # torch releases without it hold no group
            registry.clear()
    _MESHES.clear()

"""`autoplan profile`'s run on every rank of a torchrun job: the tasks in the order they are
measured, progress for rank 0, and the profiled cluster.

The local curves (matmul, element-wise, activation) are measured at the start, the middle and the
end of the profile, and each point keeps the median of the three (`LOCAL_PASSES`, `_in_passes`,
`_median_curve`); every other task is measured once, in between (`timer.Timer`). Rank 0 gathers
every rank's `machine_fingerprint` (hosts joined), fits the constants to the curves
(`fit.fitted_cluster`, or `fit.device_on_base` for a profile of one rank) and returns the cluster.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from autoplan.cluster.measured import OVERHEADS, machine_fingerprint, monotone
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.profile.fit import device_on_base, fitted_cluster
from autoplan.profile.tasks import Settings, Task, plan_tasks
from autoplan.profile.timer import Report, Timer
from autoplan.progress import OnProgress, Progress

__all__ = ["base_refusal", "profile_cluster"]

log = logging.getLogger(__name__)
# the local curves, measured at the start, the middle and the end of a profile, each point the
# median of the three: a host whose speed drifts for a while spoils a curve measured in one go
# (by hand, 2 of ~12 profiles of 4 CPU ranks found matmuls 20-60% slower than the others and
# than the same matmul timed minutes later), and the faster of two passes reads it fast (5
# profiles so taken spread 0.7-1.4x point by point in their matmuls at 1e7-1e9 FLOPs)
LOCAL = ("matmul", "elementwise", "activation")
LOCAL_PASSES = 3


def profile_cluster(
    name: str,
    settings: Settings,
    backend: str | None = None,
    on_progress: OnProgress | None = None,
    base: Cluster | None = None,
) -> Cluster | None:
    """Measure the cluster this torchrun job runs on; every rank calls this. Rank 0 gets the
    profiled cluster (named `name`) and reports progress to `on_progress`; the others get None.
    `backend` defaults to nccl where CUDA is available, else gloo. A job of one rank measures
    its device alone and needs `base`, the cluster file whose links, node shape and backend
    the result keeps (`fit.device_on_base`); a job of several measures everything."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        return _profile(name, settings, backend, device, on_progress, base)
    finally:
        dist.destroy_process_group()


def base_refusal(nproc: int) -> str:
    """Why a profile of `nproc` ranks per node may not take (or must take) a base cluster."""
    if nproc == 1:
        return (
            "a profile of one rank measures its device's compute but no collectives: give "
            "--base CLUSTER.json, the cluster file whose links, node shape and backend to keep "
            "(e.g. costmodels/h100-sxm-8.json, NVIDIA's published figures), or --nproc 2 or "
            "more to measure the collectives"
        )
    return (
        f"--base is for a profile of one rank, which cannot measure collectives; {nproc} ranks "
        f"measure them: leave --base out"
    )


def _median_curve(passes: list[list[list[float]]]) -> list[list[float]]:
    """Several measurements of one curve, point by point the median of the passes that reached
    it (a pass ends early where its next size was predicted too slow), made monotone again:
    the median of fewer passes at the tail may dip."""
    longest = max(passes, key=len)
    xs = [x for x, _ in longest]
    seconds = [statistics.median(p[i][1] for p in passes if i < len(p)) for i in range(len(xs))]
    return [[x, s] for x, s in zip(xs, monotone(seconds), strict=True)]


def _profile(
    name: str,
    settings: Settings,
    backend: str,
    device: torch.device,
    on_progress: OnProgress | None,
    base: Cluster | None,
) -> Cluster | None:
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % per_node:
        raise AutoplanError(
            f"autoplan profile needs the same number of ranks on every node; this job has "
            f"{world} rank(s) with {per_node} on this node"
        )
    if (world == 1) != (base is not None):
        raise AutoplanError(base_refusal(world))
    num_nodes = world // per_node
    tasks = _in_passes(plan_tasks(num_nodes, per_node, settings))
    rank0 = dist.get_rank() == 0
    timer = Timer(device, settings)
    start = time.perf_counter()
    measured: dict[str, Any] = {}
    passes: dict[tuple[str, str], list[list[list[float]]]] = {}
    for i, task in enumerate(tasks):
        report = _reporter(i, len(tasks), task, start, on_progress if rank0 else None)
        if task.section == "sync_overhead":
            measured[task.section] = timer.sync_overhead(task, report)
        elif task.section in OVERHEADS:
            measured[task.section] = timer.overhead(task, report)
        elif task.section == "op_overheads":
            measured.setdefault(task.section, {})[task.key] = timer.overhead(task, report)
        elif task.section == "redistribute_overhead":
            measured[task.section] = timer.redistribute_overhead(task, report)
        elif task.section in LOCAL:
            passes.setdefault((task.section, task.key), []).append(timer.curve(task, report))
        else:
            measured.setdefault(task.section, {})[task.key] = timer.curve(task, report)
    for (section, key), curves in passes.items():
        measured.setdefault(section, {})[key] = _median_curve(curves)
    seconds = time.perf_counter() - start
    found: list[Any] = [None] * world
    dist.all_gather_object(found, machine_fingerprint(backend))
    if not rank0:
        return None
    kinds = {dataclasses.replace(f, hosts=()) for f in found}
    if len(kinds) > 1:
        log.warning(
            "the hosts differ (%s); the profile's fingerprint names rank 0's hardware",
            "; ".join(sorted(k.describe() for k in kinds)),
        )
    fingerprint = {**found[0].to_dict(), "hosts": sorted({h for f in found for h in f.hosts})}
    measured = {"fingerprint": fingerprint, **measured}
    day = datetime.datetime.now(datetime.UTC).date().isoformat()
    how = (
        f"Profiled by `autoplan profile` on {day}: {num_nodes} node(s) x {per_node} {backend} "
        f"rank(s) on {fingerprint['device']}, torch {fingerprint['torch']}, {seconds:.0f} s. "
        f"Each point is the median of {settings.repeats} timed runs (slowest rank) after a "
        f"warm-up, made monotone by isotonic regression; the {', '.join(LOCAL)} curves are "
        f"measured at the start, the middle and the end, each point the median of the "
        f"{LOCAL_PASSES}; a curve ends where a call would pass {settings.max_seconds:g} s or at "
        f"{settings.max_bytes} bytes / n={settings.max_matmul_dim}. One more op costs "
        f"{measured['op_overhead'] * 1e6:.1f} us beyond its compute (op_overhead), per op "
        f"{_per_op(measured['op_overheads'])} (op_overheads)"
    )
    memory_bytes = _memory_bytes(device, per_node if base is None else base.devices_per_node)
    if base is not None:
        if device.type == "cpu":
            log.warning(
                "one CPU rank was timed with the host's cores to itself: ranks that share them "
                "compute slower; profile with --nproc N (N ranks) to measure that"
            )
        return device_on_base(
            name=name, base=base, memory_bytes=memory_bytes, measured=measured, how=f"{how}."
        )
    how += (
        f", a redistribution {_span(measured['redistribute_overhead'])} beyond its collective "
        f"(redistribute_overhead, from the smallest tensor to the largest), a blocking "
        f"redistribution after compute {measured['sync_overhead'] * 1e6:.0f} us beyond one "
        f"alone (sync_overhead)."
    )
    return fitted_cluster(
        name=name,
        backend=backend,
        num_nodes=num_nodes,
        devices_per_node=per_node,
        memory_bytes=memory_bytes,
        measured=measured,
        how=how,
        # CPU ranks share the host's cores (the ones this process may run on)
        cores_per_node=len(os.sched_getaffinity(0)) if device.type == "cpu" else None,
    )


def _in_passes(tasks: tuple[Task, ...]) -> list[Task]:
    """`tasks` in the order they are measured: the local curves `LOCAL_PASSES` times, spread
    evenly among the others (the first pass first, the last one last)."""
    local = [t for t in tasks if t.section in LOCAL]
    others = [t for t in tasks if t.section not in LOCAL]
    parts = max(1, LOCAL_PASSES - 1)
    order = list(local)
    for p in range(parts):
        order += others[len(others) * p // parts : len(others) * (p + 1) // parts]
        order += local if p < LOCAL_PASSES - 1 else []
    return order


def _reporter(
    index: int,
    num_tasks: int,
    task: Task,
    start: float,
    on_progress: OnProgress | None,
) -> Report:
    """What tells `on_progress` (if any) how far the profile is as task number `index` goes."""

    def report(points_done: int) -> None:
        if on_progress is None:
            return
        done = (index + points_done / len(task.sizes)) / num_tasks
        finished = points_done == len(task.sizes)
        label = f"{task.section} {task.key} {'done' if finished else _size(task, points_done)}"
        on_progress(Progress(done, time.perf_counter() - start, label, finished))

    return report


def _per_op(overheads: dict[str, float]) -> str:
    """The per-op overheads in us, by the op's short name, for the profile's source line."""
    return ", ".join(
        f"{op.split('.')[1] if '.' in op else op} {s * 1e6:.1f}" for op, s in overheads.items()
    )


def _span(points: list[list[float]]) -> str:
    """A curve's first and last seconds, for the profile's source line."""
    return f"{points[0][1] * 1e6:.0f}-{points[-1][1] * 1e6:.0f} us"


def _memory_bytes(device: torch.device, per_node: int) -> int:
    """A device's memory, or for CPU ranks the host's memory shared by the node's ranks."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_node


def _size(task: Task, done: int) -> str:
    """The size being measured, for the progress line."""
    if task.section == "matmul":
        return f"n={task.sizes[done]}"
    nbytes = task.xs[done]
    return next(
        f"{nbytes / 2**p:.0f} {unit}"
        for p, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
        if nbytes >= 2**p or p == 0
    )

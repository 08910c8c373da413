"""The measurements of `autoplan profile`, run on every rank of a torchrun job.

Every point of every curve is timed the same way (`_Bench._seconds`): after one untimed call (first
calls set things up), all ranks start together (barrier), one call is timed to choose how many calls
make one timed run (enough for ~20 ms, so small sizes are not lost in timer and barrier noise; a
slow first call timed here left tiny ops ~50x too slow), then `repeats` runs are timed and each
run's time per call is the slowest rank's (all_reduce MAX), because a step waits for its slowest
rank; the median run is kept. Every rank runs the operation at once, as in training: local ops on
every device, a collective on all its groups. Matmuls, element-wise ops and GELU cycle through
operands larger than the caches (`_cold`), as a step streams its tensors through them; their curves
are measured at the start, the middle and the end of the profile, and each point keeps the median of
the three (`LOCAL_PASSES`). A run of local ops (matmul, element-wise, activation, op chains) ends
with a barrier inside the clock: ranks that share cores (CPU ranks) start their clocks only when
scheduled, so without it each would time itself alone and miss the contention (the barrier adds its
latency, a few % of a run). Collectives wait for their group anyway. The decisions (calls per run,
when a curve stops) use the agreed times, so every rank takes the same path. Sends are timed as a
ping-pong between the two ranks of a pair, halved. `op_overhead` is the slope between chains of 8
and 64 tiny ops run forward and backward (what one more op adds beyond its compute);
`redistribute_overhead` what an all-reduce of each size costs through DTensor's redistribution
beyond the raw all-reduce; `sync_overhead` what a tiny such redistribution costs after a few ms of
compute beyond its cost alone. Each is the median over rounds of runs of its operations, one right
after the other (`_Bench.paired`, `_Bench.sync_overhead`).

Rank 0 gathers every rank's `machine_fingerprint` (hosts joined) and returns the cluster.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from autoplan.cluster.measured import OVERHEADS, machine_fingerprint, monotone
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.profile.fit import device_on_base, fitted_cluster
from autoplan.profile.tasks import (
    COLLECTIVE_ITEMSIZE,
    SYNC_WORK_CALLS,
    SYNC_WORK_DIM,
    Progress,
    Settings,
    Task,
    plan_tasks,
)
from autoplan.torch_private import wait_collective

__all__ = ["base_refusal", "matmul_seconds", "profile_cluster"]

log = logging.getLogger(__name__)
# the local curves, measured at the start, the middle and the end of a profile, each point the
# median of the three: a host whose speed drifts for a while spoils a curve measured in one go
# (by hand, 2 of ~12 profiles of 4 CPU ranks found matmuls 20-60% slower than the others and
# than the same matmul timed minutes later), and the faster of two passes reads it fast (5
# profiles so taken spread 0.7-1.4x point by point in their matmuls at 1e7-1e9 FLOPs)
LOCAL = ("matmul", "elementwise", "activation")
LOCAL_PASSES = 3
SYNC_BYTES = COLLECTIVE_ITEMSIZE  # the tensor sync_overhead redistributes: the curves' first size
# redistribute_overhead's points up to 1 MiB take this many times the pairs of runs: cheap there,
# and noisy (by hand, on 4 CPU ranks sharing 2 cores, 15 pairs spread ~2x, 45 pairs ~1.5x)
SMALL_REDISTRIBUTION_FACTOR = 3

RUN_SECONDS = 0.02  # aim of one timed run: enough calls of a small op to outweigh noise
MAX_CALLS = 10_000  # calls per timed run at most (a ~2 us op on CPU)
# local ops cycle through operands of at least this many bytes, more than a CPU's last-level
# cache or a GPU's L2 (50 MB on an H100), in at most this many sets
COLD_POOL_BYTES = 128 * 2**20
COLD_POOL_SETS = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Op(NamedTuple):
    call: Callable[[], object]
    scale: float = 1.0  # the time of one call times this is the curve's seconds
    local: bool = False  # no communication: end each timed run with a barrier


def profile_cluster(
    name: str,
    settings: Settings,
    backend: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
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


def matmul_seconds(n: int, device: torch.device) -> float:
    """Seconds of one n x n float32 matmul, timed as `autoplan profile` times its matmul curve
    (every rank at once, cold operands, the slowest rank, the median of the default repeats);
    every rank calls this. A probe of the host's speed now against its profile."""
    bench = _Bench(device, Settings(), 1, None)
    op = _cold((n, n), torch.float32, device, lambda a, b, out: torch.matmul(a, b, out=out))
    return bench._seconds(op, bench.settings.repeats)


def _profile(
    name: str,
    settings: Settings,
    backend: str,
    device: torch.device,
    on_progress: Callable[[Progress], None] | None,
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
    bench = _Bench(device, settings, len(tasks), on_progress if rank0 else None)
    measured: dict[str, Any] = {}
    passes: dict[tuple[str, str], list[list[list[float]]]] = {}
    for i, task in enumerate(tasks):
        if task.section == "sync_overhead":
            measured[task.section] = bench.sync_overhead(i, task)
        elif task.section in OVERHEADS:
            measured[task.section] = bench.overhead(i, task)
        elif task.section == "op_overheads":
            measured.setdefault(task.section, {})[task.key] = bench.overhead(i, task)
        elif task.section == "redistribute_overhead":
            measured[task.section] = bench.redistribute_overhead(i, task)
        elif task.section in LOCAL:
            passes.setdefault((task.section, task.key), []).append(bench.curve(i, task))
        else:
            measured.setdefault(task.section, {})[task.key] = bench.curve(i, task)
    for (section, key), curves in passes.items():
        measured.setdefault(section, {})[key] = _median_curve(curves)
    seconds = time.perf_counter() - bench.start
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


class _Bench:
    """Times the points of the curves, one task after another, on every rank."""

    def __init__(
        self,
        device: torch.device,
        settings: Settings,
        num_tasks: int,
        on_progress: Callable[[Progress], None] | None,
    ) -> None:
        self.device = device
        self.settings = settings
        self.num_tasks = num_tasks
        self.on_progress = on_progress
        self.start = time.perf_counter()
        self._groups: dict[tuple[tuple[int, ...], ...], Any] = {}

    def curve(self, index: int, task: Task) -> list[list[float]]:
        """[[x, seconds], ...] of task number `index`, up to where the next size is predicted
        to take longer than max_seconds per call (at large sizes time grows at most linearly
        with size)."""
        xs: list[float] = []
        seconds: list[float] = []
        for i, (size, x) in enumerate(zip(task.sizes, task.xs, strict=True)):
            self._report(index, task, i)
            op = self._operation(task, size)
            xs.append(x)
            seconds.append(self._seconds(op, self._repeats(task)) * op.scale)
            del op  # free this size's tensors before the next, larger ones
            nxt = i + 1
            if nxt < len(task.xs) and seconds[-1] * task.xs[nxt] / x > self.settings.max_seconds:
                break
        self._report(index, task, len(task.sizes))
        return [[x, s] for x, s in zip(xs, monotone(seconds), strict=True)]

    def _report(self, index: int, task: Task, points_done: int) -> None:
        if self.on_progress is None:
            return
        done = (index + points_done / len(task.sizes)) / self.num_tasks
        finished = points_done == len(task.sizes)
        label = f"{task.section} {task.key} {'done' if finished else _size(task, points_done)}"
        self.on_progress(Progress(done, time.perf_counter() - self.start, label, finished))

    def overhead(self, index: int, task: Task) -> float:
        """Seconds per unit of x that the operation at `task.sizes[1]` takes beyond the one at
        `task.sizes[0]` (>= 0; see `paired`)."""
        self._report(index, task, 0)
        without, with_ = (self._operation(task, size) for size in task.sizes)
        seconds = self.paired(without, with_, self._repeats(task))
        self._report(index, task, len(task.sizes))
        return max(0.0, seconds / (task.xs[1] - task.xs[0]))

    def redistribute_overhead(self, index: int, task: Task) -> list[list[float]]:
        """[[bytes, seconds], ...]: at each size, what the all-reduce costs through DTensor
        beyond the raw one (>= 0, made monotone)."""
        seconds = []
        for i, size in enumerate(task.sizes):
            self._report(index, task, i)
            raw, dtensor = (
                _redistribution(size, dtensor=d, device=self.device) for d in (False, True)
            )
            repeats = self._repeats(task) * (SMALL_REDISTRIBUTION_FACTOR if size <= 2**20 else 1)
            seconds.append(max(0.0, self.paired(raw, dtensor, repeats)))
        self._report(index, task, len(task.sizes))
        return [[x, s] for x, s in zip(task.xs, monotone(seconds), strict=True)]

    def sync_overhead(self, index: int, task: Task) -> float:
        """What the tiny redistribution costs right after compute beyond its cost alone,
        called back to back (>= 0): per repeat, (compute then it) - compute - it alone."""
        self._report(index, task, 0)
        compute, then_sync, alone = (self._operation(task, size) for size in task.sizes)
        runs = self._runs((compute, then_sync, alone), self._repeats(task))
        self._report(index, task, len(task.sizes))
        return max(0.0, statistics.median(b - a - c for a, b, c in zip(*runs, strict=True)))

    def paired(self, without: _Op, with_: _Op, repeats: int) -> float:
        """Seconds per call that `with_` takes beyond `without`: the median over `repeats` of
        the difference of two runs timed one right after the other (`_runs`)."""
        first, second = self._runs((without, with_), repeats)
        return statistics.median(b - a for a, b in zip(first, second, strict=True))

    def _runs(self, ops: tuple[_Op, ...], repeats: int) -> list[list[float]]:
        """Per op, the slowest rank's seconds per call in each of `repeats` rounds, each round
        one run of every op, one right after the other. Differences taken within a round
        cancel the host's drift, which the difference of two medians kept
        (redistribute_overhead: 0.04 to 2.1 ms in 3 profiles)."""
        calls = [self._calls(op) for op in ops]
        runs: list[list[float]] = [[] for _ in ops]
        for _ in range(repeats):
            for op, count, found in zip(ops, calls, runs, strict=True):
                found.append(self._timed(op, count))
        return [self._slowest(found) for found in runs]

    def _repeats(self, task: Task) -> int:
        """Timed runs per point: `Settings.repeats`, or the task's own minimum if higher."""
        return max(task.repeats, self.settings.repeats)

    def _seconds(self, op: _Op, repeats: int) -> float:
        """Median over the timed runs of the slowest rank's seconds per call of `op`."""
        calls = self._calls(op)
        return statistics.median(self._slowest([self._timed(op, calls) for _ in range(repeats)]))

    def _calls(self, op: _Op) -> int:
        """How many calls of `op` make one timed run."""
        op.call()  # the first call may set things up (kernels, caches): never timed
        dist.barrier()
        # one call alone, without the closing barrier, which may take far longer than a small
        # op and would leave too few calls per run to outweigh it
        first = self._slowest([self._run(op, 1, closing_barrier=False)])[0]
        return max(1, min(MAX_CALLS, math.ceil(RUN_SECONDS / max(first, 1e-9))))

    def _timed(self, op: _Op, calls: int) -> float:
        """This rank's seconds per call over one run of `calls` calls, started together."""
        dist.barrier()
        return self._run(op, calls, closing_barrier=op.local) / calls

    def _run(self, op: _Op, calls: int, *, closing_barrier: bool) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            op.call()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if closing_barrier:
            dist.barrier()
        return time.perf_counter() - start

    def _slowest(self, values: list[float]) -> list[float]:
        found = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return [float(v) for v in found.tolist()]

    def _operation(self, task: Task, size: int) -> _Op:
        """The operation timed at `size` of `task` on this rank."""
        device = self.device
        if task.section in ("matmul", "elementwise"):
            shape = (size, size) if task.section == "matmul" else (size,)
            fn = torch.matmul if task.section == "matmul" else torch.add
            return _cold(shape, DTYPES[task.key], device, lambda a, b, out: fn(a, b, out=out))
        if task.section == "activation":
            return _cold((size,), DTYPES[task.key], device, _gelu_forward_backward)
        if task.section in ("op_overhead", "op_overheads"):
            return _chain(size, device, task.key)
        if task.section == "sync_overhead":
            if size == 2:
                return _redistribution(SYNC_BYTES, dtensor=True, device=device)
            return _compute_then_sync(sync=size == 1, device=device)
        mine = self._group(task.groups)
        if mine is None:
            return _Op(lambda: None)
        ranks, group = mine
        full = torch.zeros(size // 4, device=device)  # float32: the sizes are multiples of 4 * n
        part = torch.zeros(size // 4 // len(ranks), device=device)
        if task.section == "send_recv":
            first = dist.get_rank() == ranks[0]
            peer = ranks[1] if first else ranks[0]

            def ping_pong() -> None:
                if first:
                    dist.send(full, peer)
                    dist.recv(full, peer)
                else:
                    dist.recv(full, peer)
                    dist.send(full, peer)

            return _Op(ping_pong, scale=0.5)  # a round trip is two messages
        other = torch.zeros_like(full)
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_gather": lambda: dist.all_gather_single(full, part, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_single(part, full, group=group),
            "all_to_all": lambda: dist.all_to_all_single(other, full, group=group),
        }
        return _Op(calls[task.section])

    def _group(self, groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], Any] | None:
        """This rank's group among `groups` and its process group (None if it is in none).
        Every rank creates every group, in the same order, including those it is not in."""
        if groups not in self._groups:
            handles = [dist.new_group(list(g)) for g in groups]
            self._groups[groups] = dict(zip(groups, handles, strict=True))
        rank = dist.get_rank()
        return next(((g, h) for g, h in self._groups[groups].items() if rank in g), None)


def _cold(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object],
) -> _Op:
    """`fn(a, b, out)` on tensors of `shape`, each call on the next of a pool of such triples
    that together pass `COLD_POOL_BYTES`: a step streams its weights and activations through
    the caches once, and an op timed on the same operands again and again finds them cached
    (by hand, 4 ranks on 2 cores: a 256x512 @ 512x512 matmul 7% faster, a 362^3 one 18%)."""
    nbytes = 3 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    count = max(1, min(COLD_POOL_SETS, math.ceil(COLD_POOL_BYTES / nbytes)))
    # filled, not random: the speed does not depend on the values, and filling 256 MB tensors
    # with random numbers on every rank would take longer than timing them
    pool = [
        tuple(torch.full(shape, 0.5, dtype=dtype, device=device) for _ in range(3))
        for _ in range(count)
    ]
    sets = itertools.cycle(pool)

    def call() -> None:
        fn(*next(sets))

    return _Op(call, local=True)


def _compute_then_sync(*, sync: bool, device: torch.device) -> _Op:
    """A few ms of matmuls on every rank, each call followed by a tiny redistribution (as
    `_redistribution`) if `sync`."""
    dim = SYNC_WORK_DIM
    work = _cold((dim, dim), torch.float32, device, lambda a, b, out: torch.matmul(a, b, out=out))
    redistribution = _redistribution(SYNC_BYTES, dtensor=True, device=device)

    def call() -> None:
        for _ in range(SYNC_WORK_CALLS):
            work.call()
        if sync:
            redistribution.call()

    return _Op(call, local=True)


def _gelu_forward_backward(x: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    """GELU's forward into `out`, then its backward into `out` (`measured.activation`)."""
    torch.ops.aten.gelu.out(x, out=out)
    torch.ops.aten.gelu_backward.grad_input(grad, x, grad_input=out)


def _chain(length: int, device: torch.device, op: str = "") -> _Op:
    """`length` ops on a tiny tensor, forward and backward through autograd: `op` (one of
    `OP_OVERHEAD_KINDS`; a linear or layer norm with parameters of its own, as in a model), or
    element-wise ops (`op` empty)."""
    leaf = torch.ones(1, 1, 4, 4, device=device, requires_grad=True)
    # each op's own leaves (a linear's weight; a layer norm's weight and bias), as a model's
    shapes: dict[str, list[tuple[int, ...]]] = {
        "aten.linear.default": [(4, 4)],
        "aten.layer_norm.default": [(4,), (4,)],
    }
    params = [
        [torch.ones(shape, device=device, requires_grad=True) for shape in shapes.get(op, [])]
        for _ in range(length)
    ]
    links: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "": lambda y, i: y * 1.5 if i % 2 else y + 1.0,
        "aten.linear.default": lambda y, i: F.linear(y, *params[i]),
        "aten.layer_norm.default": lambda y, i: F.layer_norm(y, (4,), params[i][0], params[i][1]),
        "aten.gelu.default": lambda y, i: F.gelu(y),
        "aten.scaled_dot_product_attention.default": (
            lambda y, i: F.scaled_dot_product_attention(y, y, y)
        ),
        "view": lambda y, i: y.transpose(2, 3),
    }
    link = links[op]

    def call() -> None:
        y = leaf
        for i in range(length):
            y = link(y, i)
        y.sum().backward()
        leaf.grad = None
        for own in params:
            for p in own:
                p.grad = None

    return _Op(call, local=True)


def _redistribution(nbytes: int, *, dtensor: bool, device: torch.device) -> _Op:
    """An all-reduce of `nbytes` (float32) over all ranks: raw, or as DTensor's redistribution
    from Partial to Replicate issues it, waited for."""
    local = torch.ones(nbytes // 4, device=device)
    if not dtensor:
        return _Op(lambda: dist.all_reduce(local))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def redistribute() -> None:
        value = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        wait_collective(value.redistribute(mesh, [Replicate()]).to_local())

    return _Op(redistribute)


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

"""What `autoplan profile` measures: the curves, their sizes and the rank groups (no torch).

Sizes are chosen so that a profile takes minutes: powers of two for tensors and messages (about
3 per decade, the sizes real tensors tend to have), and n x n matmuls with n growing by sqrt(2)
(FLOPs by 2.8x), rounded to multiples of 8. Each curve stops early once its next size is
predicted to take longer than `Settings.max_seconds` per call (time grows at most linearly in
size at large sizes), so slow devices get shorter curves rather than longer profiles; the cost
model uses the analytic constants past a curve's end.

Group sizes are the ones the planner's meshes use: inside a node, every divisor of the devices
per node and every power of two up to it (Alpa's (1, 2^k) submeshes); across nodes, every
divisor of the device count (the axes of the whole cluster's meshes). A size is measured with
all its groups at once, as a mesh axis runs them: inside a node, consecutive blocks of ranks in
every node; across nodes, the strided groups of the outer axis of the mesh (size, N / size),
which span nodes. Other group sizes are priced by the analytic model.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cluster.hardware import REQUIRED_DTYPES
from autoplan.cluster.measured import COLLECTIVE_KINDS, OP_OVERHEAD_KINDS, OVERHEADS
from autoplan.cluster.mesh import mesh_groups

__all__ = ["ITEMSIZE", "Settings", "Task", "plan_tasks"]

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
COLLECTIVE_ITEMSIZE = ITEMSIZE["float32"]  # collectives move float32 tensors
SMALLEST_MATMUL = 16
# matmul dims are rounded to multiples of this, as real models' dims are: an odd dim misses the
# GPU's aligned tensor-core kernels (on an H100, bfloat16 n=5793 ran at 180 TFLOP/s, n=4096 at
# 845), and made monotone after n=8192 the curve then read 509 at n=8192 too
MATMUL_ALIGN = 8
SMALLEST_ELEMENTWISE = 64  # elements per tensor
# sync_overhead: what a tiny redistribution over all ranks costs right after a few ms of
# compute, beyond the same redistribution called back to back: the ranks reach it at different
# times
SYNC_WORK_DIM = 384  # the compute: SYNC_WORK_CALLS n x n matmuls (a few ms a rank on a CPU)
SYNC_WORK_CALLS = 2
# redistribute_overhead: what DTensor's redistribution, Partial to Replicate, costs beyond the
# all-reduce it issues, by tensor size (every collective of a plan goes through one, the
# gradient buckets' all-reduces do not). Its result is a fresh tensor, so the cost grows with
# the size, to a good part of the all-reduce's own time on CPU ranks. Its backward (here, to
# Partial: local) is a redistribution of its own, priced as such where it moves anything.
# Sizes from 4 B, by this factor, up to:
REDISTRIBUTE_STEP = 16
REDISTRIBUTE_MAX_BYTES = 64 * 2**20
# op_overhead: chains of this many ops on a tiny tensor, forward and backward; the overhead of
# one op is the slope between them (what the chain's ends, the loss and backward() cost, drops)
OVERHEAD_CHAINS = (8, 64)
# pairs of runs that each of OVERHEADS (a difference between two operations) takes at least: a
# difference is noisier than either of its terms
OVERHEAD_REPEATS = 15


@dataclass(frozen=True)
class Settings:
    """How far and how carefully to measure. The defaults reach "hundreds of MB" in minutes."""

    max_bytes: int = 256 * 2**20  # largest message, and largest element-wise tensor
    max_matmul_dim: int = 8192  # largest n of the n x n @ n x n matmuls
    max_seconds: float = 1.0  # a size predicted to take longer per call ends its curve
    repeats: int = 3  # timed repeats per size (after one warm-up); the median is kept


@dataclass(frozen=True)
class Task:
    """One curve: `section` and `key` as in the `measured` schema (`autoplan/cluster/fileio.py`).

    `sizes[i]` is what the operation is built from (matmul: n; element-wise and activation: elements
    per tensor; collective and redistribute_overhead: bytes; op_overhead and op_overheads: ops in
    the chain; sync_overhead: 0 for the compute, 1 for it followed by the redistribution, 2 for the
    redistribution alone)
    and `xs[i]` the curve's x at that size (FLOPs, bytes moved, tensor bytes, the cost model's
    nbytes, ops).
    `groups` are the rank groups a collective runs on, all at once.
    """

    section: str
    key: str
    sizes: tuple[int, ...]
    xs: tuple[float, ...]
    groups: tuple[tuple[int, ...], ...] = ()
    repeats: int = 0  # timed runs per point at least (Settings.repeats when more)


def plan_tasks(num_nodes: int, devices_per_node: int, settings: Settings) -> tuple[Task, ...]:
    """Every curve to measure for `num_nodes` nodes of `devices_per_node` ranks, in order (one
    rank: its compute curves and the op overheads alone)."""
    tasks = [_matmul(dtype, settings) for dtype in REQUIRED_DTYPES]
    tasks += [_elementwise(dtype, settings) for dtype in REQUIRED_DTYPES]
    tasks += [_activation(dtype, settings) for dtype in REQUIRED_DTYPES]
    chains = tuple(map(float, OVERHEAD_CHAINS))
    op_overhead, sync_overhead = OVERHEADS
    tasks.append(Task(op_overhead, "", OVERHEAD_CHAINS, chains, repeats=OVERHEAD_REPEATS))
    tasks += [
        Task("op_overheads", op, OVERHEAD_CHAINS, chains, repeats=OVERHEAD_REPEATS)
        for op in OP_OVERHEAD_KINDS
    ]
    num_devices = num_nodes * devices_per_node
    if num_devices == 1:  # one device: its compute, and nothing to communicate with
        return tuple(tasks)
    # an all-reduce over all ranks at each size, raw and through DTensor, paired
    largest = min(settings.max_bytes, REDISTRIBUTE_MAX_BYTES)
    sizes = _powers(COLLECTIVE_ITEMSIZE, largest, REDISTRIBUTE_STEP)
    xs = tuple(map(float, sizes))
    tasks.append(Task("redistribute_overhead", "", sizes, xs, repeats=OVERHEAD_REPEATS))
    # a few ms of matmuls on every rank (size 0), each followed by a tiny redistribution (1),
    # and that redistribution alone (2): three terms of a difference, so 3x the rounds
    tasks.append(Task(sync_overhead, "", (0, 1, 2), (0.0, 1.0, 2.0), repeats=3 * OVERHEAD_REPEATS))
    inter = _divisors(num_devices) if num_nodes > 1 else ()
    for link, sizes in (("intra", intra_group_sizes(devices_per_node)), ("inter", inter)):
        for size in sizes:
            groups = _groups(link, size, num_nodes, devices_per_node)
            for kind in COLLECTIVE_KINDS:
                if kind != "send_recv" or size == 2:
                    tasks.append(_collective(kind, f"{link}/{size}", groups, settings))
    return tuple(tasks)


def intra_group_sizes(devices_per_node: int) -> tuple[int, ...]:
    """Group sizes measured inside a node: divisors of it and powers of two up to it."""
    powers = {2**k for k in range(1, devices_per_node.bit_length())}
    return tuple(sorted(set(_divisors(devices_per_node)) | powers))


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(2, n + 1) if n % d == 0)


def _groups(link: str, size: int, num_nodes: int, per_node: int) -> tuple[tuple[int, ...], ...]:
    if link == "inter":
        return mesh_groups((size, num_nodes * per_node // size), 0)
    return tuple(
        tuple(range(node * per_node + b * size, node * per_node + (b + 1) * size))
        for node in range(num_nodes)
        for b in range(per_node // size)
    )


def _matmul(dtype: str, settings: Settings) -> Task:
    dims: list[int] = []
    n = float(SMALLEST_MATMUL)
    while (dim := MATMUL_ALIGN * round(n / MATMUL_ALIGN)) <= settings.max_matmul_dim:
        dims.append(dim)
        n *= 2**0.5
    return Task("matmul", dtype, tuple(dims), tuple(2.0 * d**3 for d in dims))


def _elementwise(dtype: str, settings: Settings) -> Task:
    size = ITEMSIZE[dtype]
    numels = _powers(SMALLEST_ELEMENTWISE, settings.max_bytes // size, 2)
    # c = a + b reads two tensors and writes one
    return Task("elementwise", dtype, numels, tuple(3.0 * e * size for e in numels))


def _activation(dtype: str, settings: Settings) -> Task:
    size = ITEMSIZE[dtype]
    numels = _powers(SMALLEST_ELEMENTWISE, settings.max_bytes // size, 2)
    return Task("activation", dtype, numels, tuple(float(e * size) for e in numels))


def _collective(
    kind: str, key: str, groups: tuple[tuple[int, ...], ...], settings: Settings
) -> Task:
    # gathered and scattered tensors split into one equal chunk per rank of the group
    chunks = 1 if kind in ("all_reduce", "send_recv") else len(groups[0])
    unit = COLLECTIVE_ITEMSIZE * chunks
    sizes = sorted({-(-b // unit) * unit for b in _powers(1, settings.max_bytes, 2)})
    return Task(kind, key, tuple(sizes), tuple(float(b) for b in sizes), groups)


def _powers(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    out = []
    n = lo
    while n <= hi:
        out.append(n)
        n *= factor
    return tuple(out)

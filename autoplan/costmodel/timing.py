"""Cost model: seconds for an operator's compute and for a collective, from a Cluster.

Pure functions of plain numbers and a `Cluster`; no torch. Units: FLOPs, bytes, seconds,
FLOP/s and bytes/s.

Measured first, analytic elsewhere. Where the cluster was profiled (`Cluster.curves`, from the
file's `measured` section) and the size lies inside a measured curve, the curve's interpolated
time is used (`autoplan.cluster.measured.Curve`: exact at measured points, monotone in size);
outside every measured range, and for anything not measured, the analytic formulas below are.

Compute (roofline). An operator doing `flops` floating-point operations and moving `bytes_moved`
bytes to and from device memory takes

    t = max(flops / (peak_flops[dtype] * compute_efficiency),
            bytes_moved / (memory_bandwidth * memory_efficiency))

where a dtype the cluster file does not list (int64, bool, float64) uses the float32 peak.
Measured: each of the two terms separately takes the `matmul` curve (seconds of x FLOPs) or
the `elementwise` curve (seconds of x bytes moved) of the same dtype (after that fallback)
when x lies inside it, so t = max(matmul(flops), elementwise(bytes_moved)).

Tile quantization (`tile_share`). A GPU's matmul computes its result in whole tiles of
`TILE` x `TILE` elements, so a result of 130 rows costs as much as one of 256: the compute
term divides by the share of the tiles' work that falls inside the result (`useful`, from
`autoplan.costmodel.pricer.Pricer.tile_share`; 1 for everything but matmuls, and on CPU
ranks, which do not compute in tensor-core tiles). A measured matmul curve, where it covers
the size, is read as it is: it measured square matmuls, whose tiles are full.

Transcendental work (`activation_time`). An op that evaluates a transcendental function per
element (GELU, softmax, attention's scores; `autoplan.graph.flops.transcendental`) adds the
measured time of GELU's forward and backward over that many elements (the `activation` curve, x
= their bytes; past its ends, at the rate of the nearest end). Unmeasured, it adds nothing: the
roofline's memory term prices such an op where, as on GPUs, its bandwidth bounds it.

Framework work (`with_overhead`). Each op also costs the framework's work around its compute
(dispatch, autograd's records, its backward node): the op's own measured overhead where the
profile has one (`op_overheads`: linear, layer norm, GELU, attention, any view op), else the
measured `op_overhead` (an element-wise op's), 0 where not measured. CPU ranks (gloo) do that
work on the core that computes, so it adds (`with_overhead`). A GPU runs kernels while the host
queues the next ones, so the host's work is summed apart (`host_overhead`) and a step's compute
takes the longer of the two sums (`autoplan.costmodel.step_price.price_step`). On one H100
(benchmarks/gpu_steps.py), pricing each op at the longer of its own two predicted a GPT-350M
step at 1.22x its measured time, the longer of the sums at 1.09x. A collective that goes through
DTensor adds the measured `redistribute_overhead` at its bytes (`redistribute_overhead` here);
where the step waits on one, and for a message between pipeline stages, it adds `sync_overhead`
(`autoplan.costmodel.pricer`, `autoplan.costmodel.pipeline_price`).

Collectives (alpha-beta, ring algorithms). For a group of n ranks on a link with latency
alpha (s) and bandwidth beta (bytes/s per device, one direction), with `nbytes` as noted:

    all_reduce      (2 (n-1) + 1) alpha + 2 (n-1)/n * nbytes / beta   nbytes = tensor size per rank
    all_gather        (  (n-1) + 1) alpha +   (n-1)/n * nbytes / beta   nbytes = gathered OUTPUT
    reduce_scatter    (  (n-1) + 1) alpha +   (n-1)/n * nbytes / beta   nbytes = full INPUT per rank
    all_to_all        (  (n-1) + 1) alpha +   (n-1)/n * nbytes / beta   nbytes = input (= output)
    send_recv                      alpha +             nbytes / beta   nbytes = message; n ignored

A group whose ring crosses nodes (its ranks on m of them, m < n) pays the inter-node latency
only on the steps that cross a node, m - 1 of them per pass (2 (m - 1) for all_reduce), and
the intra-node latency on the others, as NCCL's ring model prices its latency
(`ncclTopoTuneModel`, src/graph/tuning.cc: (nsteps - nInterSteps) intraLat + nInterSteps
interLat). Its bandwidth is the inter-node link's, a GPU's share of the node's network
(one NIC each), times the group's ranks on each node, at most the intra-node link's: k ranks of
a node carry k rings side by side, each through one of their NICs (NCCL's channels, its
`busBw = nChannels * speedInter`), where one rank a node has one NIC to itself. all_to_all and
send_recv go rank to rank, each through its own NIC.

On NCCL, a ring collective also has the LL ("low latency") protocol, which NCCL picks for small
messages (`ncclTopoGetAlgoTime` takes the fastest protocol by its model): a flag in every
8-byte word in place of Simple's fences, so far less latency for a quarter of the bandwidth (a
third on one node, but for all-reduce). The files' latencies are Simple's; LL's are NCCL's own
ratios of its two (src/graph/tuning.cc, `baseLat` and `hwLat` of the ring: the call 3.6 of
8.4 us, an NVLink hop 0.47 of 3.4 us, 1.8 times that where the ring spans nodes, a network hop
2.7 of 9.6 us), and `collective_time` takes the faster of the two for all_reduce, all_gather
and reduce_scatter on an NCCL cluster (`NCCL_LL`; all_to_all and send_recv go by send and
receive, Simple's).

The extra alpha per group collective is the cost of issuing one call (launch and the group's
synchronization). Without it, an all-gather plus a reduce-scatter would cost exactly one
all-reduce, and the planner could not tell Megatron's one all-reduce per layer pair from two
gather/scatter pairs; real collectives pay per call, so fewer, larger ones win.

A group of one rank, or zero bytes, costs 0.0 (send_recv: only zero bytes). The link is chosen by
the caller (`Cluster.axis_link` / `Cluster.link_for_ranks`): a group that spans nodes runs at the
inter-node link's speed. Measured: the curve of that kind keyed "intra/<n>" when the link is
the cluster's `intra_node` link, "inter/<n>" when it is its `inter_node` link (links compare by
value, so where the two are equal, as on one host, the intra curves are read; send_recv:
"<link>/2"); a group size that was not profiled uses the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cluster.hardware import Link
from autoplan.cluster.measured import COLLECTIVE_KINDS, Curve
from autoplan.cluster.model import Cluster

__all__ = [
    "COLLECTIVE_KINDS",
    "activation_time",
    "analytic_collective_time",
    "collective_time",
    "compute_time",
    "host_overhead",
    "op_overhead_s",
    "redistribute_overhead",
    "sync_overhead",
    "tile_share",
    "with_overhead",
]

# A tensor-core GEMM's output tile, rows and columns: NVIDIA's "Matrix Multiplication
# Background" guide (docs.nvidia.com/deeplearning/performance) names cuBLAS's tiles 256x128,
# 128x128, 64x128 and 64x64 and picks large ones for large results; 128 is their middle
TILE = 128


def compute_time(
    cluster: Cluster, flops: float, bytes_moved: float, dtype: str, useful: float = 1.0
) -> float:
    """Roofline time (s) of one operator on one device of `cluster`: the larger of its
    compute-bound time for `flops` at `dtype` and its memory-bound time for `bytes_moved`,
    each from the measured curve where it covers the size, else from the constants; of the
    constants' compute time, only the share ``useful`` does work (a matmul's `tile_share`)."""
    if flops < 0 or bytes_moved < 0 or not 0 < useful <= 1:
        raise ValueError(
            f"flops and bytes_moved must be >= 0 and useful in (0, 1], got flops={flops!r}, "
            f"bytes_moved={bytes_moved!r}, useful={useful!r}"
        )
    device = cluster.device
    key = cluster.dtype_key(dtype)
    compute_s = flops / (device.peak_flops[key] * device.compute_efficiency * useful)
    memory_s = bytes_moved / (device.memory_bandwidth * device.memory_efficiency)
    curves = cluster.curves
    return max(
        _measured_or(curves.matmul.get(key), flops, compute_s),
        _measured_or(curves.elementwise.get(key), bytes_moved, memory_s),
    )


def tile_share(rows: int, cols: int) -> float:
    """Of a GPU matmul's work on whole `TILE` x `TILE` tiles, the share inside a result of
    ``rows`` x ``cols``."""
    if rows < 1 or cols < 1:
        return 1.0
    padded = -(-rows // TILE) * TILE * (-(-cols // TILE) * TILE)
    return rows * cols / padded


def activation_time(cluster: Cluster, nbytes: float, dtype: str) -> float:
    """Time (s) of the transcendental work over `nbytes` bytes of elements: the measured
    `activation` curve of `dtype` (float32's for unlisted dtypes), outside its range at the
    rate of its nearest end; 0.0 without a curve (the roofline alone)."""
    curve = cluster.curves.activation.get(cluster.dtype_key(dtype))
    if nbytes <= 0 or curve is None:
        return 0.0
    measured = curve(nbytes)
    if measured is not None:
        return measured
    end = -1 if nbytes > curve.xs[-1] else 0
    return nbytes * curve.seconds[end] / curve.xs[end]


def redistribute_overhead(cluster: Cluster, nbytes: float) -> float:
    """Time (s) DTensor's redistribution of a tensor of `nbytes` adds to the collective it
    issues: the measured curve, below it its first point, above it at the rate of its last
    point (the part that grows with size, a fresh result tensor, dominates there); 0.0 where
    not measured."""
    curve = cluster.curves.redistribute_overhead
    if curve is None:
        return 0.0
    if nbytes > curve.xs[-1]:
        return nbytes * curve.seconds[-1] / curve.xs[-1]
    measured = curve(max(nbytes, curve.xs[0]))
    assert measured is not None
    return measured


def sync_overhead(cluster: Cluster) -> float:
    """Time (s) the step waits for the ranks' skew where it blocks right after computing: the
    measured `sync_overhead`, 0.0 where not measured."""
    return cluster.curves.sync_overhead or 0.0


def with_overhead(cluster: Cluster, seconds: float, op: str | None = None) -> float:
    """`seconds` of one op's compute, with the framework's work around it (`op_overhead_s`)
    added on CPU ranks, whose core does both; unchanged on GPUs, whose host works beside the
    kernels (`host_overhead`)."""
    return seconds + op_overhead_s(cluster, op) if cluster.backend == "gloo" else seconds


def host_overhead(cluster: Cluster, op: str | None = None) -> float:
    """On GPUs, the host's work to issue one op (`op_overhead_s`), which runs while the GPU
    computes earlier ones: a step takes at least the sum over its ops (`step_price.price_step`).
    0 on CPU ranks, where `with_overhead` adds it to the op."""
    return 0.0 if cluster.backend == "gloo" else op_overhead_s(cluster, op)


def op_overhead_s(cluster: Cluster, op: str | None = None) -> float:
    """The framework's work around one op, forward and backward: `op`'s own measured overhead
    ("aten.linear.default" ...; "view" for any view op) where the profile has it, else
    `op_overhead`; 0 where neither was measured."""
    curves = cluster.curves
    overhead = curves.op_overheads.get(op, curves.op_overhead) if op else curves.op_overhead
    return overhead or 0.0


@dataclass(frozen=True)
class Protocol:
    """A ring protocol's latencies and bandwidth as shares of Simple's (the files' own)."""

    call: float  # the alpha paid once a call
    intra_hop: float  # a step inside a node; `spanning_intra_hop` where the ring spans nodes
    spanning_intra_hop: float
    inter_hop: float  # a step between nodes
    bandwidth: float  # of the link's, where the ring spans nodes or all-reduces
    one_node_bandwidth: float  # of the link's, a gather or scatter inside one node


SIMPLE = Protocol(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
NCCL_LL = Protocol(3.6 / 8.4, 0.47 / 3.4, 1.8 * 0.47 / 3.4, 2.7 / 9.6, 1 / 4, 1 / 3)
RING_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter"})


def collective_time(
    cluster: Cluster, kind: str, nbytes: float, group_size: int, link: Link, num_nodes: int = 0
) -> float:
    """Time (s) of collective `kind` (one of COLLECTIVE_KINDS) over `group_size` ranks on
    `link` (the cluster's intra_node or inter_node link): the measured curve where it covers
    `nbytes`, else the alpha-beta model (`analytic_collective_time`), on NCCL the faster of
    its Simple and LL protocols for a ring. `num_nodes`: the nodes the group's ranks sit on,
    where `link` is the inter-node one (0: every step crosses one)."""
    crossing = num_nodes if link == cluster.inter_node else 0
    intra = cluster.intra_node.latency
    network = link == cluster.inter_node and link != cluster.intra_node
    if network and kind in RING_KINDS and 0 < num_nodes < group_size:
        link = Link(
            min(link.bandwidth * (group_size // num_nodes), cluster.intra_node.bandwidth),
            link.latency,
        )
    analytic = analytic_collective_time(kind, nbytes, group_size, link, crossing, intra)
    if cluster.backend == "nccl" and kind in RING_KINDS:
        ll = analytic_collective_time(
            kind, nbytes, group_size, link, crossing, intra, NCCL_LL, network
        )
        analytic = min(analytic, ll)
    if analytic == 0.0:  # nothing moves: zero bytes, or a group of one
        return analytic
    if link == cluster.intra_node:
        where = "intra"
    elif link == cluster.inter_node:
        where = "inter"
    else:
        return analytic
    size = 2 if kind == "send_recv" else group_size
    return _measured_or(cluster.curves.collectives.get((kind, where, size)), nbytes, analytic)


def analytic_collective_time(
    kind: str,
    nbytes: float,
    group_size: int,
    link: Link,
    num_nodes: int = 0,
    intra_latency: float = 0.0,
    protocol: Protocol = SIMPLE,
    network: bool = False,
) -> float:
    """Alpha-beta time (s) of collective `kind` over `group_size` ranks on `link`; see the
    module docstring for what `nbytes` means for each kind. A group on `num_nodes` nodes
    (0 < num_nodes < group_size) crosses `link` on its ring's steps between nodes alone, the
    others paying `intra_latency`. A ring's ``protocol`` scales the latencies and bandwidth,
    by its shares for the network where `link` is one (``network``)."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; expected one of {', '.join(COLLECTIVE_KINDS)}"
        )
    if nbytes < 0 or group_size < 1:
        raise ValueError(
            f"{kind}: nbytes must be >= 0 and group_size >= 1, got nbytes={nbytes!r}, "
            f"group_size={group_size!r}"
        )
    if nbytes == 0:
        return 0.0
    alpha, beta = link.latency, link.bandwidth
    if kind == "send_recv":
        return alpha + nbytes / beta
    n = group_size
    if n == 1:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    steps = passes * (n - 1)
    # Each ring step moves one 1/n chunk of nbytes per rank; all_reduce is a reduce_scatter
    # followed by an all_gather, hence twice the steps. One more alpha for issuing the call.
    spans = 0 < num_nodes < n
    crossing = passes * (num_nodes - 1) if spans else steps
    inside = protocol.spanning_intra_hop if spans else protocol.intra_hop
    hop = protocol.inter_hop if network else protocol.intra_hop  # of the steps on `link`
    latency = protocol.call * alpha + crossing * hop * alpha
    latency += (steps - crossing) * inside * intra_latency
    one_node = not network and kind != "all_reduce"
    share = protocol.one_node_bandwidth if one_node else protocol.bandwidth
    return latency + steps / n * nbytes / (beta * share)


def _measured_or(curve: Curve | None, x: float, analytic: float) -> float:
    measured = None if curve is None else curve(x)
    return analytic if measured is None else measured

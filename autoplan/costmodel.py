"""Analytic cost model: seconds for an operator's compute and for a collective, from a Cluster.

Pure functions of plain numbers and a `Cluster`; no torch. Units: FLOPs, bytes, seconds,
FLOP/s and bytes/s.

Compute (roofline). An operator doing `flops` floating-point operations and moving `bytes_moved`
bytes to and from device memory takes

    t = max(flops / (peak_flops[dtype] * compute_efficiency),
            bytes_moved / (memory_bandwidth * memory_efficiency))

where a dtype the cluster file does not list (int64, bool, float64) uses the float32 peak.

Collectives (alpha-beta, ring algorithms). For a group of n ranks on a link with latency
alpha (s) and bandwidth beta (bytes/s per device, one direction), with `nbytes` as noted:

    all_reduce      (2 (n-1) + 1) alpha + 2 (n-1)/n * nbytes / beta   nbytes = tensor size per rank
    all_gather        (  (n-1) + 1) alpha +   (n-1)/n * nbytes / beta   nbytes = gathered OUTPUT
    reduce_scatter    (  (n-1) + 1) alpha +   (n-1)/n * nbytes / beta   nbytes = full INPUT per rank
    all_to_all        (  (n-1) + 1) alpha +   (n-1)/n * nbytes / beta   nbytes = input (= output)
    send_recv                      alpha +             nbytes / beta   nbytes = message; n ignored

The extra alpha per group collective is the cost of issuing one call (launch and the group's
synchronization). Without it, an all-gather plus a reduce-scatter would cost exactly one
all-reduce, and the planner could not tell Megatron's one all-reduce per layer pair from two
gather/scatter pairs; real collectives pay per call, so fewer, larger ones win.

A group of one rank, or zero bytes, costs 0.0 (send_recv: only zero bytes). The link is chosen by
the caller (`Cluster.axis_link` / `Cluster.link_for_ranks`): a group that spans nodes runs at the
inter-node link's speed. The `cluster` argument is where profiled curves (`Cluster.measured`)
will replace these formulas; today only the link is used.
"""

from __future__ import annotations

from autoplan.cluster import Cluster, Link

__all__ = ["COLLECTIVE_KINDS", "collective_time", "compute_time"]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def compute_time(cluster: Cluster, flops: float, bytes_moved: float, dtype: str) -> float:
    """Roofline time (s) of one operator on one device of `cluster`: the larger of its
    compute-bound time for `flops` at `dtype` and its memory-bound time for `bytes_moved`."""
    if flops < 0 or bytes_moved < 0:
        raise ValueError(
            f"flops and bytes_moved must be >= 0, got flops={flops!r}, bytes_moved={bytes_moved!r}"
        )
    device = cluster.device
    compute_s = flops / (cluster.peak_flops(dtype) * device.compute_efficiency)
    memory_s = bytes_moved / (device.memory_bandwidth * device.memory_efficiency)
    return max(compute_s, memory_s)


def collective_time(
    cluster: Cluster, kind: str, nbytes: float, group_size: int, link: Link
) -> float:
    """Alpha-beta time (s) of collective `kind` (one of COLLECTIVE_KINDS) over `group_size`
    ranks on `link`; see the module docstring for what `nbytes` means for each kind.
    `cluster` is unused until measured curves exist; the analytic model needs only `link`."""
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
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    # Each ring step moves one 1/n chunk of nbytes per rank; all_reduce is a reduce_scatter
    # followed by an all_gather, hence twice the steps. One more alpha for issuing the call.
    return (steps + 1) * alpha + steps / n * nbytes / beta

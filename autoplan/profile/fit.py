"""The analytic constants of a profiled cluster, fitted to its measured curves (no torch).

The cost model uses the constants wherever no curve covers a size, so they come from the same
measurements and meet the curves at their largest sizes, where the formulas take over:

- `peak_flops[dtype]`: the rate (FLOPs / seconds) of the largest matmul measured, with
  `compute_efficiency` 1.0, so flops / peak equals the curve at its last point and the cost
  stays continuous past it (at the smallest sizes fixed costs dominate, so there the curve
  lies above the formula and the cost rises into the curve);
- `memory_bandwidth`: likewise the rate (bytes moved / seconds) of the largest float32
  element-wise op, with `memory_efficiency` 1.0 (tensors too big for the caches, unlike the
  small ones);
- each link: `analytic_collective_time`'s all_reduce formula, which is linear in alpha and
  1/beta, put through the smallest and the largest point of the all_reduce curve of the
  link's largest group (two equations, two unknowns). One node has no inter-node link, so
  `inter_node` repeats `intra_node` (and a node of one rank takes the inter-node fit);
- `memory_bytes`: given by the profiler.

A profile of one device measures no collectives: it takes a base cluster file (published
figures, e.g. `costmodels/h100-sxm-8.json`) and keeps its links, node shape and backend, so the
device's measured compute serves a cluster of many; its source also records each dtype's
largest matmul rate against the base's peak (the device's matmul efficiency).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from autoplan.cluster.hardware import Device, Link
from autoplan.cluster.model import Cluster
from autoplan.costmodel.timing import analytic_collective_time

__all__ = ["device_on_base", "fitted_cluster"]

Points = Sequence[Sequence[float]]


def fitted_cluster(
    *,
    name: str,
    backend: str,
    num_nodes: int,
    devices_per_node: int,
    memory_bytes: int,
    measured: Mapping[str, Any],
    how: str,
    cores_per_node: int | None = None,
) -> Cluster:
    """A cluster whose constants are fitted to `measured` (the `measured` section it keeps);
    `how` says how the curves were measured and starts the cluster's `source`."""
    device, rates = _fitted_device(measured, memory_bytes)
    links: dict[str, tuple[int, Points]] = {}  # link class -> its largest all_reduce group
    for key, points in measured["all_reduce"].items():
        link, _, size = key.partition("/")
        if link not in links or int(size) > links[link][0]:
            links[link] = (int(size), points)
    fits = {link: _fit_link(points, size) for link, (size, points) in links.items()}
    intra = fits.get("intra", fits.get("inter"))
    assert intra is not None, "a profile of several ranks has all_reduce curves"
    fitted = ", ".join(
        f"{link} alpha {fit.latency * 1e6:.1f} us, beta {fit.bandwidth / 1e9:.3g} GB/s "
        f"(all_reduce over {links[link][0]})"
        for link, fit in sorted(fits.items())
    )
    return Cluster(
        name=name,
        device=device,
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        intra_node=intra,
        inter_node=fits.get("inter", intra),
        backend=backend,
        source=(
            f"{how} Constants fitted to the curves (autoplan/profile/fit.py): {rates}, links "
            f"through the smallest and largest all_reduce of the largest group ({fitted}"
            f"{'' if 'inter' in fits else '; one node, so inter_node repeats intra_node'})."
        ),
        measured=measured,
        cores_per_node=cores_per_node,
    )


def device_on_base(
    *, name: str, base: Cluster, memory_bytes: int, measured: Mapping[str, Any], how: str
) -> Cluster:
    """`base` with its device replaced by the one device `measured` profiled (no collectives):
    links, node shape and backend stay the base's; the source records the measured matmul
    efficiency, each dtype's largest matmul rate against the base's peak."""
    device, rates = _fitted_device(measured, memory_bytes)
    peak = base.device.peak_flops
    efficiency = ", ".join(
        f"{dtype} {rate / peak[dtype]:.0%} of {peak[dtype] / 1e12:.3g}"
        for dtype, rate in sorted(device.peak_flops.items())
    )
    return dataclasses.replace(
        base,
        name=name,
        device=device,
        source=(
            f"{how} One device measures no collectives: links, node shape and backend are kept "
            f"from {base.name}. Constants fitted to the curves (autoplan/profile/fit.py): "
            f"{rates}; matmul efficiency against {base.name}'s peak (TFLOP/s): {efficiency}. "
            f"{base.name}'s source: {base.source}"
        ),
        measured=measured,
        cores_per_node=None,  # the one rank had its device (or the host's cores) to itself
    )


def _fitted_device(measured: Mapping[str, Any], memory_bytes: int) -> tuple[Device, str]:
    """The device whose peaks are the rates of the largest matmul and element-wise op, and
    those rates in words."""
    peak = {dtype: _last_rate(points) for dtype, points in measured["matmul"].items()}
    bandwidth = _last_rate(measured["elementwise"]["float32"])
    device = Device(
        kind=measured["fingerprint"]["device"],
        memory_bytes=memory_bytes,
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
    )
    rates = ", ".join(f"{dtype} {flops / 1e9:.3g} GFLOP/s" for dtype, flops in sorted(peak.items()))
    return device, (
        f"largest matmul's rate per dtype ({rates}), largest float32 element-wise op's rate "
        f"({bandwidth / 1e9:.3g} GB/s)"
    )


def _last_rate(points: Points) -> float:
    """Size per second at the curve's largest size."""
    x, seconds = points[-1]
    return x / seconds


def _fit_link(points: Points, group_size: int) -> Link:
    (x0, t0), (x1, t1) = points[0], points[-1]
    # t = a * alpha + b(x) / beta: read the coefficients off the formula with unit constants
    a = analytic_collective_time("all_reduce", x0, group_size, Link(math.inf, 1.0))
    b0, b1 = (
        analytic_collective_time("all_reduce", x, group_size, Link(1.0, 0.0)) for x in (x0, x1)
    )
    inv_beta = (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
    if inv_beta <= 0:
        # every size took the same time: latency-bound throughout, so the largest message
        # bounds the bandwidth from below
        inv_beta = t1 / b1
    alpha = max(0.0, (t0 - b0 * inv_beta) / a)
    return Link(bandwidth=1.0 / inv_beta, latency=alpha)

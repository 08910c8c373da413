"""Measured cost curves (the `measured` section of a cluster file) and the hardware they fit.

`autoplan profile` times real operations and stores, per operation class, a curve of points
`[x, seconds]` sorted by x; `Cluster.from_dict` validates them (field by field, see
`autoplan/cluster/fileio.py` and costmodels/README.md) into a `Measured`;
`autoplan.costmodel.timing` reads `Cluster.curves` and uses a curve wherever it has one and the
analytic constants elsewhere.
No torch here: plain numbers, so the cost model stays apart from torch.

Interpolation (`Curve`): piecewise linear in x between neighbouring measured points, exact at
every point, and `None` outside [first x, last x], where the caller uses the analytic model.
Linear rather than log-log because the costs being measured are affine in size between
breakpoints (alpha + bytes/beta; a fixed launch cost + flops/rate): linear interpolation
reproduces an affine segment exactly, while log-log bends it into a power law and
over-estimates the latency-to-bandwidth knee (by AM-GM, at the geometric mean of two sizes).
The points are non-decreasing in seconds (validated), so the interpolant is monotone
non-decreasing in x: a bigger message or matmul never costs less. Measured medians are noisy,
so the profiler makes them monotone with `monotone` (isotonic regression) before writing them.
At the ends of the measured range the cost switches to the analytic model, which may jump;
the profiler fits the analytic constants to the same measurements to keep that jump small.

Hardware fingerprint (`Fingerprint`): what the curves were measured on, so that a profile used
on other hardware is reported (`Cluster.load` warns, naming both; the curves are still used).
`device` is the GPU model (nvidia-smi) or the CPU model, `device_count` the GPUs on a host or
its logical CPUs, `torch` the torch version, `driver` the NVIDIA driver version ("none" for a
CPU cluster), `hosts` the sha256 prefixes of the profiled hosts' names (names are not stored).
This machine matches when its own fingerprint equals the stored one in the first four fields
and its host is one of `hosts`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "COLLECTIVE_KINDS",
    "LINK_CLASSES",
    "OP_OVERHEAD_KINDS",
    "OVERHEADS",
    "Curve",
    "Fingerprint",
    "Measured",
    "machine_fingerprint",
    "monotone",
]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# the measured scalars (seconds): what one more op and one blocking collective after compute
# (the ranks' skew) add
OVERHEADS = ("op_overhead", "sync_overhead")
# the ops whose overhead a profile measures apart (`Measured.op_overheads`): the common ones of
# transformers and MLPs, whose forward and backward launch more than an element-wise op's
# (a Linear's and a layer norm's several times a view's); "view"
# stands for every view op (transpose, view, reshape ...)
OP_OVERHEAD_KINDS = (
    "aten.linear.default",
    "aten.layer_norm.default",
    "aten.gelu.default",
    "aten.scaled_dot_product_attention.default",
    "view",
)
# A collective curve is keyed "<link class>/<group size>": "intra" for a group inside one node,
# "inter" for a group that spans nodes (the link Cluster.axis_link picks for it).
LINK_CLASSES = ("intra", "inter")
_HOST_HASH_CHARS = 12


@dataclass(frozen=True)
class Curve:
    """Seconds as a function of size x (FLOPs or bytes), from measured points.

    `xs` strictly increasing and > 0, `seconds` non-decreasing and >= 0, at least one point.
    """

    xs: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        assert self.xs and len(self.xs) == len(self.seconds)
        assert all(a < b for a, b in itertools.pairwise(self.xs))
        assert all(a <= b for a, b in itertools.pairwise(self.seconds))

    def __call__(self, x: float) -> float | None:
        """Interpolated seconds at `x`, or None outside the measured range."""
        xs, ys = self.xs, self.seconds
        if not xs[0] <= x <= xs[-1]:
            return None
        i = bisect.bisect_left(xs, x)
        if xs[i] == x:
            return ys[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def points(self) -> list[list[float]]:
        """The JSON form: [[x, seconds], ...]."""
        return [[x, s] for x, s in zip(self.xs, self.seconds, strict=True)]


def monotone(seconds: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `seconds` in least squares (isotonic regression
    by pooling adjacent violators): runs that dip are replaced by their mean. A sequence that
    is already non-decreasing comes back unchanged."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs, means non-decreasing
    for s in seconds:
        blocks.append([s, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


@dataclass(frozen=True)
class Fingerprint:
    """The hardware and software a profile was measured on (see the module docstring)."""

    device: str
    device_count: int
    torch: str
    driver: str
    hosts: tuple[str, ...]

    @property
    def id(self) -> str:
        """Short hash of all fields, to name this fingerprint in messages."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hosts"] = list(self.hosts)
        return data

    def matches(self, here: Fingerprint) -> bool:
        """Whether `here` (one machine's fingerprint) is hardware this profile describes."""
        same = (self.device, self.device_count, self.torch, self.driver) == (
            here.device,
            here.device_count,
            here.torch,
            here.driver,
        )
        return same and set(here.hosts) <= set(self.hosts)

    def describe(self) -> str:
        hosts = ",".join(self.hosts)
        return (
            f"{self.id} ({self.device} x{self.device_count}, torch {self.torch}, driver "
            f"{self.driver}, host(s) {hosts})"
        )


@dataclass(frozen=True)
class Measured:
    """`Cluster.measured`, validated: curves by dtype and by (kind, link class, group size)."""

    fingerprint: Fingerprint | None
    matmul: Mapping[str, Curve]  # dtype -> seconds of a matmul of x FLOPs
    elementwise: Mapping[str, Curve]  # dtype -> seconds of an element-wise op moving x bytes
    collectives: Mapping[tuple[str, str, int], Curve]  # seconds of x bytes (costmodel's nbytes)
    # dtype -> seconds of GELU's forward and backward over a tensor of x bytes
    activation: Mapping[str, Curve] = dataclasses.field(default_factory=dict)
    # seconds one more op adds to a step on top of its compute: forward and backward through
    # autograd of an op on a tiny tensor (None: not measured)
    op_overhead: float | None = None
    # the same, per op ("aten.linear.default" ...; "view": any view op), where measured apart
    op_overheads: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # seconds DTensor's redistribution of a tensor of x bytes adds to the collective it issues
    redistribute_overhead: Curve | None = None
    # seconds a blocking collective waits beyond its transfer when the ranks compute before it
    # (they arrive at different times)
    sync_overhead: float | None = None


def host_hash(name: str) -> str:
    """How a host name is stored: a sha256 prefix, so files do not reveal host names."""
    return hashlib.sha256(name.encode()).hexdigest()[:_HOST_HASH_CHARS]


@functools.cache
def machine_fingerprint(backend: str) -> Fingerprint:
    """This host's fingerprint for a cluster on `backend` ("nccl": its GPUs; else its CPU).

    Reads nvidia-smi rather than torch.cuda so that checking a file never initializes CUDA.
    """
    if backend == "nccl":
        gpus = _nvidia_smi()
        device = gpus[0][0] if gpus else "unknown GPU"
        driver = gpus[0][1] if gpus else "unknown"
        count = len(gpus)
    else:
        device, driver, count = _cpu_model(), "none", os.cpu_count() or 1
    return Fingerprint(
        device=device,
        device_count=count,
        torch=importlib.metadata.version("torch"),
        driver=driver,
        hosts=(host_hash(socket.gethostname()),),
    )


def _nvidia_smi() -> list[tuple[str, str]]:
    """(name, driver version) of each GPU on this host; [] without nvidia-smi."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [line.split(",") for line in out.stdout.splitlines() if line.strip()]
    return [(name.strip(), driver.strip()) for name, driver in rows]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"

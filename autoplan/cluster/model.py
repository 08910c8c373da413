"""Cluster description: devices, links between them, and how logical meshes map onto ranks.

A `Cluster` is plain, frozen data read from a JSON file in `costmodels/` (see the README there
for every field and its units). Units throughout: bytes, seconds, FLOP/s and bytes/s.

The node count is a parameter rather than a file per size: the file gives a default
`num_nodes` and `Cluster.load(path, num_nodes=N)` (CLI `--nodes N`) overrides it.

Ranks are numbered node-major: rank r lives on node r // devices_per_node. A logical mesh of
shape (d0, d1, ...) is laid row-major over ranks 0..N-1 with the last axis fastest, so the mesh
(2, 8) on 2 nodes of 8 devices puts mesh axis 1 inside a node (fast link) and mesh axis 0 across
nodes (slow link). `mesh_groups` and `Cluster.axis_link` encode that layout.

The `measured` field holds profiled curves (`autoplan profile`) beside the analytic constants:

    "measured": {
      "fingerprint": {"device": str, "device_count": int >= 1, "torch": str, "driver": str,
                      "hosts": [str, ...]},                 # required when anything is measured
      "matmul":      {"<dtype>": [[flops, seconds], ...]},
      "elementwise": {"<dtype>": [[bytes_moved, seconds], ...]},
      "activation":  {"<dtype>": [[tensor_bytes, seconds], ...]},   # GELU forward + backward
      "op_overhead": seconds,              # forward + backward of one more op, beyond compute
      "op_overheads": {"<aten op>|view": seconds},   # the same for that op (view: any view op)
      "redistribute_overhead": [[tensor_bytes, seconds], ...],  # DTensor's, beyond its collective
      "sync_overhead": seconds,            # a blocking collective after compute: the skew
      "<kind>":      {"<intra|inter>/<group size>": [[bytes, seconds], ...]}
    }

with <kind> one of autoplan.cluster.measured.COLLECTIVE_KINDS and bytes as
`autoplan.cluster.timing` defines them for that kind; send_recv curves have group size 2. Every
section is optional and `{}` means nothing is measured. Each curve is a non-empty list of
points with sizes > 0 strictly increasing and seconds >= 0 non-decreasing
(`autoplan.cluster.measured` says why and how they are interpolated). `Cluster.curves` is the
validated form. `Cluster.load` warns, naming both fingerprints, when the file's profile was
measured on other hardware than this machine.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from autoplan.cluster.measured import (
    COLLECTIVE_KINDS,
    LINK_CLASSES,
    OVERHEADS,
    Curve,
    Fingerprint,
    Measured,
    machine_fingerprint,
)
from autoplan.errors import ClusterFormatError, MeshShapeError

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "REQUIRED_DTYPES",
    "Cluster",
    "Device",
    "Link",
    "mesh_groups",
    "mesh_shapes",
]

BACKENDS = ("gloo", "nccl")
# Every cluster file must give peak FLOP/s for these dtypes; more (e.g. "float64") are allowed.
REQUIRED_DTYPES = ("bfloat16", "float16", "float32")
# The dtype whose peak stands in for any dtype the file does not list (int64 index math, bool
# masks, float64): such ops run on the vector units at roughly the fp32 rate, not the tensor cores.
FALLBACK_DTYPE = "float32"

_TOP_FIELDS = (
    "backend",
    "cores_per_node",
    "device",
    "devices_per_node",
    "inter_node",
    "intra_node",
    "measured",
    "name",
    "num_nodes",
    "source",
)
_DEVICE_FIELDS = (
    "compute_efficiency",
    "kind",
    "memory_bandwidth",
    "memory_bytes",
    "memory_efficiency",
    "peak_flops",
)
_LINK_FIELDS = ("bandwidth", "latency")
_BY_DTYPE = ("activation", "elementwise", "matmul")
_MEASURED_FIELDS = (
    *_BY_DTYPE,
    "fingerprint",
    *OVERHEADS,
    "op_overheads",
    "redistribute_overhead",
    *COLLECTIVE_KINDS,
)
_FINGERPRINT_FIELDS = ("device", "device_count", "driver", "hosts", "torch")


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU rank's share of a host).

    `peak_flops` maps torch dtype names ("float32", "bfloat16", "float16") to FLOP/s;
    `memory_bandwidth` is bytes/s; the efficiencies are the fractions of those peaks that a
    large matmul and an element-wise op reach (0 < x <= 1).
    """

    kind: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    compute_efficiency: float
    memory_efficiency: float

    def __post_init__(self) -> None:
        # Sorted, read-only copy with float values so equal devices compare, hash and
        # serialize identically whether built from JSON ints or Python floats.
        flops = {str(k): float(v) for k, v in sorted(self.peak_flops.items())}
        object.__setattr__(self, "peak_flops", types.MappingProxyType(flops))
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))
        object.__setattr__(self, "compute_efficiency", float(self.compute_efficiency))
        object.__setattr__(self, "memory_efficiency", float(self.memory_efficiency))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # mappingproxy cannot be pickled or deep-copied; rebuild from plain values instead.
        return (
            Device,
            (
                self.kind,
                self.memory_bytes,
                dict(self.peak_flops),
                self.memory_bandwidth,
                self.compute_efficiency,
                self.memory_efficiency,
            ),
        )

    def __hash__(self) -> int:
        return hash(
            (
                self.kind,
                self.memory_bytes,
                tuple(self.peak_flops.items()),
                self.memory_bandwidth,
                self.compute_efficiency,
                self.memory_efficiency,
            )
        )


@dataclass(frozen=True)
class Link:
    """A link class between devices: `bandwidth` in bytes/s per device in one direction,
    `latency` in seconds per message (the alpha of the alpha-beta model)."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", float(self.bandwidth))
        object.__setattr__(self, "latency", float(self.latency))


@dataclass(frozen=True)
class Cluster:
    """`num_nodes` nodes of `devices_per_node` identical devices.

    `intra_node` links devices of one node, `inter_node` devices of different nodes.
    `source` says where the numbers come from; `measured` holds profiled curves as JSON (`{}`
    if the cluster was not profiled) and `curves` the same, validated. Build one with
    `Cluster.load` or `Cluster.from_dict`, which validate every field.
    """

    name: str
    device: Device
    num_nodes: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    backend: str
    source: str
    measured: Mapping[str, Any]
    # CPU ranks: the cores a node's ranks share (None: every rank has a device of its own)
    cores_per_node: int | None = None
    curves: Measured = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Deep copy so a caller's later edits to its dict cannot change a frozen cluster.
        measured = copy.deepcopy(dict(self.measured))
        object.__setattr__(self, "curves", _measured(measured, f"cluster {self.name!r}"))
        object.__setattr__(self, "measured", types.MappingProxyType(measured))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # As Device.__reduce__: rebuild from plain values so pickle and deepcopy work.
        return (
            Cluster,
            (
                self.name,
                self.device,
                self.num_nodes,
                self.devices_per_node,
                self.intra_node,
                self.inter_node,
                self.backend,
                self.source,
                copy.deepcopy(dict(self.measured)),
                self.cores_per_node,
            ),
        )

    def __hash__(self) -> int:
        return hash(_canonical_json(self.to_dict()))

    # ---------------------------------------------------------------- size and ranks

    @property
    def num_devices(self) -> int:
        """Total number of devices (ranks)."""
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node that holds `rank` (ranks are numbered node-major)."""
        if not 0 <= rank < self.num_devices:
            raise MeshShapeError(
                f"rank {rank} is outside this cluster's ranks 0..{self.num_devices - 1} "
                f"({self.num_nodes} node(s) x {self.devices_per_node} devices)"
            )
        return rank // self.devices_per_node

    @property
    def shares_cores(self) -> bool:
        """Whether a node's ranks are more than its cores (CPU ranks, `cores_per_node`)."""
        return self.cores_per_node is not None and self.cores_per_node < self.devices_per_node

    def rank_speed(self, busy_ranks: int) -> float:
        """How fast a rank computes while ``busy_ranks`` ranks of its node compute, relative
        to all of them at once (as the profile measures and the device's constants say).
        Ranks that share fewer cores than they are (`cores_per_node`) each get a core's share:
        a rank whose neighbours wait (in a pipeline's bubble; gloo's waits sleep) runs
        faster, up to a whole core. 1.0 where every rank has a device of its own."""
        if self.cores_per_node is None:
            return 1.0
        cores, ranks = self.cores_per_node, self.devices_per_node
        return min(1.0, cores / max(1, busy_ranks)) / min(1.0, cores / ranks)

    def with_nodes(self, num_nodes: int) -> Cluster:
        """The same cluster with `num_nodes` nodes."""
        _check_num_nodes(num_nodes, "num_nodes", "Cluster.with_nodes")
        return replace(self, num_nodes=num_nodes)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of one device for `dtype` (a torch dtype name such as "bfloat16").

        A dtype the file does not list (int64 index math, bool masks, float64) uses the
        float32 peak: those ops run on the vector units, not the tensor cores.
        """
        return self.device.peak_flops[self.dtype_key(dtype)]

    def dtype_key(self, dtype: str) -> str:
        """The dtype whose peak and measured curves stand for `dtype`: itself if the file
        lists its peak, else float32."""
        return dtype if dtype in self.device.peak_flops else FALLBACK_DTYPE

    # ---------------------------------------------------------------- meshes

    def check_mesh_shape(self, shape: tuple[int, ...]) -> None:
        """Raise `MeshShapeError` unless `shape` covers exactly this cluster's devices."""
        ok = (
            len(shape) >= 1
            and all(_is_int(d) and d >= 1 for d in shape)
            and math.prod(shape) == self.num_devices
        )
        if ok:
            return
        ndims = sorted({1, 2, max(1, len(shape))})
        suggestions = [s for ndim in ndims for s in mesh_shapes(self.num_devices, ndim)]
        shown = ", ".join(_fmt_shape(s) for s in suggestions[:12])
        more = f" and {len(suggestions) - 12} more" if len(suggestions) > 12 else ""
        product = math.prod(shape) if all(_is_int(d) for d in shape) else "not an integer"
        raise MeshShapeError(
            f"mesh shape {_fmt_shape(shape)} has {product} devices but cluster "
            f"{self.name!r} has {self.num_devices} ({self.num_nodes} node(s) x "
            f"{self.devices_per_node}); every axis must be >= 1 and their product must be "
            f"{self.num_devices}, e.g. {shown}{more}"
        )

    def link_for_ranks(self, ranks: Iterable[int]) -> Link:
        """The link a collective (or send/recv) among `ranks` is limited by: `inter_node` if
        the ranks sit on more than one node, else `intra_node`."""
        nodes = {self.node_of(r) for r in ranks}
        return self.inter_node if len(nodes) > 1 else self.intra_node

    def axis_link(
        self, shape: tuple[int, ...], axis: int | tuple[int, ...], *, first_rank: int = 0
    ) -> Link:
        """The slowest link any rank group along mesh axis `axis` of `shape` uses (along
        several axes together, for a tuple: see `mesh_groups`).

        The mesh is laid row-major over ranks first_rank .. first_rank + prod(shape) - 1; with the
        default first_rank=0 and prod(shape) == num_devices it is the whole cluster. A submesh
        that starts on a node boundary (or lies inside one node) gives the same answer at
        first_rank=0, which is how the planner prices a stage before placing it.
        """
        if not shape or not all(_is_int(d) and d >= 1 for d in shape):
            raise MeshShapeError(f"mesh shape {_fmt_shape(shape)} must have integer axes >= 1")
        size = math.prod(shape)
        if first_rank < 0 or first_rank + size > self.num_devices:
            raise MeshShapeError(
                f"mesh shape {_fmt_shape(shape)} starting at rank {first_rank} needs ranks "
                f"{first_rank}..{first_rank + size - 1} but cluster {self.name!r} has ranks "
                f"0..{self.num_devices - 1}; use a smaller shape or at least "
                f"{-(-(first_rank + size) // self.devices_per_node)} node(s)"
            )
        for group in mesh_groups(shape, axis):
            if len({self.node_of(first_rank + r) for r in group}) > 1:
                return self.inter_node
        return self.intra_node

    # ---------------------------------------------------------------- (de)serialization

    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of everything that affects plans (all fields except
        `name` and `source`), in canonical JSON. Plans record it to detect a changed cluster."""
        data = self.to_dict()
        del data["name"], data["source"]
        return hashlib.sha256(_canonical_json(data).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; `Cluster.from_dict(c.to_dict()) == c`."""
        d = self.device
        shared = {} if self.cores_per_node is None else {"cores_per_node": self.cores_per_node}
        return {
            "name": self.name,
            "backend": self.backend,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": {
                "kind": d.kind,
                "memory_bytes": d.memory_bytes,
                "peak_flops": dict(d.peak_flops),
                "memory_bandwidth": d.memory_bandwidth,
                "compute_efficiency": d.compute_efficiency,
                "memory_efficiency": d.memory_efficiency,
            },
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "source": self.source,
            "measured": copy.deepcopy(dict(self.measured)),
            **shared,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "<dict>") -> Cluster:
        """Validate `data` (parsed JSON) and build a cluster. `where` names the source (a file
        path) in error messages; every error also names the field path and what is expected."""
        top = _require_object(data, "", where)
        _check_keys(top, _TOP_FIELDS, "", where)
        dev = _require_object(_get(top, "device", where), "device", where)
        _check_keys(dev, _DEVICE_FIELDS, "device", where)
        flops = _require_object(
            _get(dev, "peak_flops", where, "device"), "device.peak_flops", where
        )
        for dtype in REQUIRED_DTYPES:
            _get(flops, dtype, where, "device.peak_flops")
        peak = {
            str(k): _positive_float(v, f"device.peak_flops.{k}", where) for k, v in flops.items()
        }
        device = Device(
            kind=_string(_get(dev, "kind", where, "device"), "device.kind", where),
            memory_bytes=_positive_int(
                _get(dev, "memory_bytes", where, "device"), "device.memory_bytes", where
            ),
            peak_flops=peak,
            memory_bandwidth=_positive_float(
                _get(dev, "memory_bandwidth", where, "device"), "device.memory_bandwidth", where
            ),
            compute_efficiency=_fraction(
                _get(dev, "compute_efficiency", where, "device"), "device.compute_efficiency", where
            ),
            memory_efficiency=_fraction(
                _get(dev, "memory_efficiency", where, "device"), "device.memory_efficiency", where
            ),
        )
        backend = _string(_get(top, "backend", where), "backend", where)
        if backend not in BACKENDS:
            raise ClusterFormatError(
                f"{where}: field 'backend' is {backend!r}; expected one of {', '.join(BACKENDS)}"
            )
        measured = _get(top, "measured", where)
        _measured(measured, where)  # checked here so that errors name the file
        return cls(
            name=_string(_get(top, "name", where), "name", where),
            device=device,
            num_nodes=_check_num_nodes(_get(top, "num_nodes", where), "num_nodes", where),
            devices_per_node=_positive_int(
                _get(top, "devices_per_node", where), "devices_per_node", where
            ),
            intra_node=_link(_get(top, "intra_node", where), "intra_node", where),
            inter_node=_link(_get(top, "inter_node", where), "inter_node", where),
            backend=backend,
            source=_string(_get(top, "source", where), "source", where),
            measured=measured,
            cores_per_node=(
                None
                if top.get("cores_per_node") is None
                else _positive_int(top["cores_per_node"], "cores_per_node", where)
            ),
        )

    @classmethod
    def load(cls, path: str | Path, *, num_nodes: int | None = None) -> Cluster:
        """Read a cluster file. `num_nodes`, when given, overrides the file's default count."""
        where = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ClusterFormatError(
                f"cluster file {where!r} does not exist; pass the path of a cluster JSON file "
                f"(see costmodels/README.md for the bundled ones and their fields)"
            ) from None
        except OSError as exc:
            raise ClusterFormatError(f"cluster file {where!r} cannot be read: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterFormatError(
                f"{where}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
        cluster = cls.from_dict(data, where)
        if num_nodes is not None:
            _check_num_nodes(num_nodes, "num_nodes", f"{where} (num_nodes override)")
            cluster = replace(cluster, num_nodes=num_nodes)
        _warn_if_profiled_elsewhere(cluster, where)
        return cluster

    def save(self, path: str | Path) -> None:
        """Write JSON with sorted keys, indent 2 and a trailing newline."""
        text = json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"
        Path(path).write_text(text, encoding="utf-8")


# -------------------------------------------------------------------- mesh helpers


def mesh_groups(shape: tuple[int, ...], axis: int | tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The rank groups that communicate along mesh axis `axis` of a mesh of `shape` laid
    row-major over ranks 0..prod(shape)-1 (last axis fastest). Groups come in row-major order
    of the other axes; each group lists its ranks in increasing mesh coordinate. A tuple of
    axes gives the groups along all of them together (DeviceMesh's flattened groups).

    mesh_groups((2, 4), 1) == ((0, 1, 2, 3), (4, 5, 6, 7));
    mesh_groups((2, 4), 0) == ((0, 4), (1, 5), (2, 6), (3, 7));
    mesh_groups((2, 2, 2), (0, 2)) == ((0, 1, 4, 5), (2, 3, 6, 7)).
    """
    if not shape or not all(_is_int(d) and d >= 1 for d in shape):
        raise MeshShapeError(f"mesh shape {_fmt_shape(shape)} must have integer axes >= 1")
    axes = (axis,) if isinstance(axis, int) else axis
    for a in axes:
        if not -len(shape) <= a < len(shape):
            raise MeshShapeError(
                f"mesh axis {a} does not exist in mesh shape {_fmt_shape(shape)}; "
                f"use 0..{len(shape) - 1}"
            )
    ranks = np.arange(math.prod(shape)).reshape(shape)
    size = math.prod(shape[a] for a in axes)
    rows = np.moveaxis(ranks, axes, range(-len(axes), 0)).reshape(-1, size)
    return tuple(tuple(int(r) for r in row) for row in rows)


def mesh_shapes(num_devices: int, ndim: int) -> tuple[tuple[int, ...], ...]:
    """Every mesh shape with `ndim` axes (each >= 1) whose product is `num_devices`, in
    lexicographic order. mesh_shapes(4, 2) == ((1, 4), (2, 2), (4, 1))."""
    if ndim < 1 or num_devices < 1:
        return ()
    if ndim == 1:
        return ((num_devices,),)
    out: list[tuple[int, ...]] = []
    for first in range(1, num_devices + 1):
        if num_devices % first == 0:
            out.extend((first, *rest) for rest in mesh_shapes(num_devices // first, ndim - 1))
    return tuple(out)


# -------------------------------------------------------------------- validation helpers


def _canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _fmt_shape(shape: tuple[Any, ...]) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(str(d) for d in shape)})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _path(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def _get(obj: Mapping[str, Any], key: str, where: str, parent: str = "") -> Any:
    if key not in obj:
        raise ClusterFormatError(
            f"{where}: missing field {_path(parent, key)!r}; see costmodels/README.md for the "
            f"fields of a cluster file"
        )
    return obj[key]


def _require_object(value: Any, path: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        name = f"field {path!r}" if path else "the top level"
        raise ClusterFormatError(
            f"{where}: {name} must be a JSON object, got {type(value).__name__} {value!r:.60}"
        )
    return value


def _check_keys(obj: Mapping[str, Any], allowed: tuple[str, ...], parent: str, where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        names = ", ".join(repr(_path(parent, k)) for k in unknown)
        raise ClusterFormatError(
            f"{where}: unknown field(s) {names}; expected only {', '.join(allowed)}"
            + (f" under {parent!r}" if parent else "")
        )


def _string(value: Any, path: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ClusterFormatError(
            f"{where}: field {path!r} must be a non-empty string, got {value!r}"
        )
    return value


def _number(value: Any, path: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ClusterFormatError(f"{where}: field {path!r} must be a finite number, got {value!r}")
    return float(value)


def _seconds(value: Any, path: str, where: str) -> float:
    number = _number(value, path, where)
    if number < 0:
        raise ClusterFormatError(f"{where}: field {path!r} must be >= 0 s, got {value!r}")
    return number


def _positive_float(value: Any, path: str, where: str) -> float:
    number = _number(value, path, where)
    if number <= 0:
        raise ClusterFormatError(f"{where}: field {path!r} must be > 0, got {value!r}")
    return number


def _fraction(value: Any, path: str, where: str) -> float:
    number = _number(value, path, where)
    if not 0 < number <= 1:
        raise ClusterFormatError(
            f"{where}: field {path!r} is a fraction of peak and must be in (0, 1], got {value!r}"
        )
    return number


def _positive_int(value: Any, path: str, where: str) -> int:
    if not _is_int(value) or value < 1:
        raise ClusterFormatError(f"{where}: field {path!r} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_num_nodes(value: Any, path: str, where: str) -> int:
    return _positive_int(value, path, where)


def _link(value: Any, path: str, where: str) -> Link:
    obj = _require_object(value, path, where)
    _check_keys(obj, _LINK_FIELDS, path, where)
    bandwidth = _positive_float(_get(obj, "bandwidth", where, path), f"{path}.bandwidth", where)
    latency = _number(_get(obj, "latency", where, path), f"{path}.latency", where)
    if latency < 0:
        raise ClusterFormatError(f"{where}: field '{path}.latency' must be >= 0 s, got {latency!r}")
    return Link(bandwidth=bandwidth, latency=latency)


def _link_dict(link: Link) -> dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


# -------------------------------------------------------------------- the measured section


def _measured(value: Any, where: str) -> Measured:
    obj = _require_object(value, "measured", where)
    _check_keys(obj, _MEASURED_FIELDS, "measured", where)
    if not obj:
        return Measured(fingerprint=None, matmul={}, elementwise={}, collectives={})
    by_dtype = {
        section: {
            dtype: _curve(points, f"measured.{section}.{dtype}", where)
            for dtype, points in _section(obj, section, where).items()
        }
        for section in _BY_DTYPE
    }
    collectives = {}
    for kind in COLLECTIVE_KINDS:
        for key, points in _section(obj, kind, where).items():
            path = f"measured.{kind}.{key}"
            collectives[(kind, *_group_key(key, kind, path, where))] = _curve(points, path, where)
    return Measured(
        fingerprint=_fingerprint(_get(obj, "fingerprint", where, "measured"), where),
        matmul=by_dtype["matmul"],
        elementwise=by_dtype["elementwise"],
        collectives=collectives,
        activation=by_dtype["activation"],
        redistribute_overhead=_redistribute_overhead(obj.get("redistribute_overhead"), where),
        op_overheads={
            op: _seconds(seconds, f"measured.op_overheads.{op}", where)
            for op, seconds in _section(obj, "op_overheads", where).items()
        },
        **{
            name: None if obj.get(name) is None else _seconds(obj[name], f"measured.{name}", where)
            for name in OVERHEADS
        },
    )


def _redistribute_overhead(value: Any, where: str) -> Curve | None:
    path = "measured.redistribute_overhead"
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ClusterFormatError(
            f"{where}: field {path!r} is one number, as profiles written before 2026-11-22 "
            "stored it; it is now a curve by tensor size (a larger tensor's redistribution "
            "costs more): profile the cluster again (autoplan profile)"
        )
    return None if value is None else _curve(value, path, where)


def _section(obj: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    return _require_object(obj.get(name, {}), f"measured.{name}", where)


def _group_key(key: str, kind: str, path: str, where: str) -> tuple[str, int]:
    link, _, size = key.partition("/")
    canonical = size.isdecimal() and str(int(size)) == size
    pair = kind == "send_recv"  # one message between two ranks
    if not (link in LINK_CLASSES and canonical and (int(size) == 2 if pair else int(size) >= 2)):
        raise ClusterFormatError(
            f"{where}: field {path!r}: a {kind} curve is keyed '<link>/<group size>' with link "
            f"{' or '.join(LINK_CLASSES)} and group size {'2' if pair else 'an integer >= 2'}, "
            f"got {key!r}"
        )
    return link, int(size)


def _curve(value: Any, path: str, where: str) -> Curve:
    if not isinstance(value, list) or not value:
        raise ClusterFormatError(
            f"{where}: field {path!r} must be a non-empty list of [size, seconds] pairs, got "
            f"{value!r:.60}"
        )
    xs: list[float] = []
    seconds: list[float] = []
    for i, pair in enumerate(value):
        point = f"{path}[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise ClusterFormatError(
                f"{where}: field {point!r} must be a [size, seconds] pair, got {pair!r:.60}"
            )
        x = _positive_float(pair[0], f"{point}[0]", where)
        s = _seconds(pair[1], f"{point}[1]", where)
        if xs and x <= xs[-1]:
            raise ClusterFormatError(
                f"{where}: field {point!r}: sizes must increase, but {x!r} follows {xs[-1]!r}"
            )
        if seconds and s < seconds[-1]:
            raise ClusterFormatError(
                f"{where}: field {point!r}: seconds must not decrease with size (a curve is "
                f"monotone), but {s!r} follows {seconds[-1]!r}; profile the cluster again"
            )
        xs.append(x)
        seconds.append(s)
    return Curve(tuple(xs), tuple(seconds))


def _fingerprint(value: Any, where: str) -> Fingerprint:
    path = "measured.fingerprint"
    obj = _require_object(value, path, where)
    _check_keys(obj, _FINGERPRINT_FIELDS, path, where)
    hosts = _get(obj, "hosts", where, path)
    if not isinstance(hosts, list) or not hosts:
        raise ClusterFormatError(
            f"{where}: field '{path}.hosts' must be a non-empty list of host hashes, got "
            f"{hosts!r:.60}"
        )
    return Fingerprint(
        device=_string(_get(obj, "device", where, path), f"{path}.device", where),
        device_count=_positive_int(
            _get(obj, "device_count", where, path), f"{path}.device_count", where
        ),
        torch=_string(_get(obj, "torch", where, path), f"{path}.torch", where),
        driver=_string(_get(obj, "driver", where, path), f"{path}.driver", where),
        hosts=tuple(_string(h, f"{path}.hosts[{i}]", where) for i, h in enumerate(hosts)),
    )


def _warn_if_profiled_elsewhere(cluster: Cluster, where: str) -> None:
    stored = cluster.curves.fingerprint
    if stored is None:
        return
    here = machine_fingerprint(cluster.backend)
    if not stored.matches(here):
        # a profile without collectives measured one device, on a base cluster file
        how = (
            f"--nproc {cluster.devices_per_node} --nnodes {cluster.num_nodes}"
            if cluster.curves.collectives
            else "--nproc 1 --base BASE.json"
        )
        log.warning(
            "%s was profiled on %s but this machine is %s; its measured curves are still used. "
            "If they no longer describe the cluster, re-profile on it: autoplan profile %s -o %s",
            where,
            stored.describe(),
            here.describe(),
            how,
            where,
        )

"""The cluster: `num_nodes` nodes of identical devices, the links between them, and where a
logical mesh's rank groups fall on them.

A `Cluster` is plain, frozen data read from a JSON file in `costmodels/` (see the README there
for every field and its units). Units throughout: bytes, seconds, FLOP/s and bytes/s.

The node count is a parameter rather than a file per size: the file gives a default
`num_nodes` and `Cluster.load(path, num_nodes=N)` (CLI `--nodes N`) overrides it.

Ranks are numbered node-major and a mesh is laid row-major over them (`autoplan.cluster.mesh`);
`Cluster.axis_link` says which link a mesh axis's groups use.

Modules: its parts (`Device`, `Link`) are in `autoplan.cluster.hardware`, the file's reading,
validation and writing in `autoplan.cluster.fileio`, the rank groups of a mesh in
`autoplan.cluster.mesh`. `Cluster.from_dict`, `Cluster.load` and `Cluster.save` call the file
functions, which build the parts and return the constructor's fields; the file module never
imports this one, so the imports run one way.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoplan.cluster.fileio import (
    check_num_nodes,
    read_cluster,
    read_document,
    read_measured,
    warn_if_profiled_elsewhere,
    write_document,
)
from autoplan.cluster.hardware import FALLBACK_DTYPE, Device, Link
from autoplan.cluster.measured import Measured
from autoplan.cluster.mesh import check_axes, fmt_shape, is_int, mesh_groups, shape_examples
from autoplan.errors import MeshShapeError

__all__ = ["Cluster"]


@dataclass(frozen=True)
class Cluster:
    """`num_nodes` nodes of `devices_per_node` identical devices.

    `intra_node` links devices of one node, `inter_node` devices of different nodes.
    `source` says where the numbers come from; `measured` holds profiled curves as JSON (`{}`
    if the cluster was not profiled; its schema is in `autoplan.cluster.fileio`) and `curves`
    the same, validated. Build one with `Cluster.load` or `Cluster.from_dict`, which validate
    every field.
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
        object.__setattr__(self, "curves", read_measured(measured, f"cluster {self.name!r}"))
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
        check_num_nodes(num_nodes, "Cluster.with_nodes")
        return replace(self, num_nodes=num_nodes)

    def stage(self, size: int) -> Cluster:
        """The cluster a pipeline stage of ``size`` devices sees: its submesh, starting on a
        node boundary (part of one node, or whole nodes)."""
        m = self.devices_per_node
        if size <= m:
            return replace(self, num_nodes=1, devices_per_node=size, name=f"{self.name}[:{size}]")
        return self.with_nodes(size // m)

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
            and all(is_int(d) and d >= 1 for d in shape)
            and math.prod(shape) == self.num_devices
        )
        if ok:
            return
        product = math.prod(shape) if all(is_int(d) for d in shape) else "not an integer"
        raise MeshShapeError(
            f"mesh shape {fmt_shape(shape)} has {product} devices but cluster "
            f"{self.name!r} has {self.num_devices} ({self.num_nodes} node(s) x "
            f"{self.devices_per_node}); every axis must be >= 1 and their product must be "
            f"{self.num_devices}, e.g. {shape_examples(self.num_devices, len(shape))}"
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
        check_axes(shape)
        size = math.prod(shape)
        if first_rank < 0 or first_rank + size > self.num_devices:
            raise MeshShapeError(
                f"mesh shape {fmt_shape(shape)} starting at rank {first_rank} needs ranks "
                f"{first_rank}..{first_rank + size - 1} but cluster {self.name!r} has ranks "
                f"0..{self.num_devices - 1}; use a smaller shape or at least "
                f"{-(-(first_rank + size) // self.devices_per_node)} node(s)"
            )
        for group in mesh_groups(shape, axis):
            if len({self.node_of(first_rank + r) for r in group}) > 1:
                return self.inter_node
        return self.intra_node

    def axis_nodes(self, shape: tuple[int, ...], axis: int | tuple[int, ...]) -> int:
        """The most nodes any rank group along mesh axis `axis` of `shape` sits on (laid as
        `axis_link` lays it, from rank 0)."""
        check_axes(shape)
        groups = mesh_groups(shape, axis)
        return max((len({self.node_of(r) for r in group}) for group in groups), default=1)

    # ---------------------------------------------------------------- (de)serialization

    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of everything that affects plans (all fields except
        `name` and `source`), in canonical JSON. Plans record it to detect a changed cluster."""
        data = self.to_dict()
        del data["name"], data["source"]
        return hashlib.sha256(_canonical_json(data).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; `Cluster.from_dict(c.to_dict()) == c`."""
        shared = {} if self.cores_per_node is None else {"cores_per_node": self.cores_per_node}
        return {
            "name": self.name,
            "backend": self.backend,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "source": self.source,
            "measured": copy.deepcopy(dict(self.measured)),
            **shared,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "<dict>") -> Cluster:
        """Validate `data` (parsed JSON) and build a cluster. `where` names the source (a file
        path) in error messages; every error also names the field path and what is expected."""
        return cls(**read_cluster(data, where))

    @classmethod
    def load(cls, path: str | Path, *, num_nodes: int | None = None) -> Cluster:
        """Read a cluster file. `num_nodes`, when given, overrides the file's default count."""
        where = str(path)
        cluster = cls.from_dict(read_document(path), where)
        if num_nodes is not None:
            check_num_nodes(num_nodes, f"{where} (num_nodes override)")
            cluster = replace(cluster, num_nodes=num_nodes)
        warn_if_profiled_elsewhere(
            cluster.curves,
            where,
            backend=cluster.backend,
            num_nodes=cluster.num_nodes,
            devices_per_node=cluster.devices_per_node,
        )
        return cluster

    def save(self, path: str | Path) -> None:
        """Write JSON with sorted keys, indent 2 and a trailing newline."""
        write_document(path, self.to_dict())


def _canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))

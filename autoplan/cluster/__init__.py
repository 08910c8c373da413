"""The cluster: the cluster (`model`), its devices and links (`hardware`), how logical meshes
lie on ranks (`mesh`), the cluster file's reading, validation and writing (`fileio`), and
its `measured` curves. What compute and collectives take on it is `autoplan.costmodel`.
Modules of the package import one another, never this file."""

from autoplan.cluster.hardware import BACKENDS, REQUIRED_DTYPES, Device, Link
from autoplan.cluster.model import Cluster

__all__ = ["BACKENDS", "REQUIRED_DTYPES", "Cluster", "Device", "Link"]

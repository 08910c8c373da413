"""The cluster and its cost model: devices and links (`model`), how logical meshes lie on
ranks, the cluster file's reading and writing, what compute and collectives take on it
(`timing`, analytic constants or `measured` curves)."""

from autoplan.cluster.model import BACKENDS, REQUIRED_DTYPES, Cluster, Device, Link

__all__ = ["BACKENDS", "REQUIRED_DTYPES", "Cluster", "Device", "Link"]

"""How a logical mesh lies on ranks: its rank groups along each axis, and the shapes that fit.

Ranks are numbered node-major: rank r lives on node r // devices_per_node. A logical mesh of
shape (d0, d1, ...) is laid row-major over ranks 0..N-1 with the last axis fastest, so the mesh
(2, 8) on 2 nodes of 8 devices puts mesh axis 1 inside a node (fast link) and mesh axis 0 across
nodes (slow link). `mesh_groups` encodes that layout; `autoplan.cluster.model.Cluster`'s
`axis_link` and `check_mesh_shape` apply it to a cluster's nodes. Pure functions of shapes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from autoplan.errors import MeshShapeError

__all__ = ["check_axes", "fmt_shape", "is_int", "mesh_groups", "mesh_shapes", "shape_examples"]

_EXAMPLES_SHOWN = 12


def mesh_groups(shape: tuple[int, ...], axis: int | tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The rank groups that communicate along mesh axis `axis` of a mesh of `shape` laid
    row-major over ranks 0..prod(shape)-1 (last axis fastest). Groups come in row-major order
    of the other axes; each group lists its ranks in increasing mesh coordinate. A tuple of
    axes gives the groups along all of them together (DeviceMesh's flattened groups).

    mesh_groups((2, 4), 1) == ((0, 1, 2, 3), (4, 5, 6, 7));
    mesh_groups((2, 4), 0) == ((0, 4), (1, 5), (2, 6), (3, 7));
    mesh_groups((2, 2, 2), (0, 2)) == ((0, 1, 4, 5), (2, 3, 6, 7)).
    """
    check_axes(shape)
    axes = (axis,) if isinstance(axis, int) else axis
    for a in axes:
        if not -len(shape) <= a < len(shape):
            raise MeshShapeError(
                f"mesh axis {a} does not exist in mesh shape {fmt_shape(shape)}; "
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


def shape_examples(num_devices: int, ndim: int) -> str:
    """Mesh shapes of `num_devices` devices to suggest in place of a bad one of `ndim` axes:
    those of 1, 2 and `ndim` axes, the first few and how many more."""
    ndims = sorted({1, 2, max(1, ndim)})
    shapes = [s for n in ndims for s in mesh_shapes(num_devices, n)]
    shown = ", ".join(fmt_shape(s) for s in shapes[:_EXAMPLES_SHOWN])
    more = len(shapes) - _EXAMPLES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def check_axes(shape: tuple[int, ...]) -> None:
    """Raise `MeshShapeError` unless `shape` has at least one axis, each an integer >= 1."""
    if not shape or not all(is_int(d) and d >= 1 for d in shape):
        raise MeshShapeError(f"mesh shape {fmt_shape(shape)} must have integer axes >= 1")


def fmt_shape(shape: tuple[Any, ...]) -> str:
    """A shape as Python writes a tuple: "(4,)", "(2, 2)"."""
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(str(d) for d in shape)})"


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (numpy's included), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)

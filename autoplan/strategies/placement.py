"""Placements of a tensor over a logical mesh, and the collectives that change them.

A placement on one mesh axis is "R" (replicated), "P" (partial sums: the value is the sum over
the axis) or "S(d)" (split along tensor dim ``d``). A `Spec` is one placement per mesh axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Spec = tuple[str, ...]

R = "R"
P = "P"
_SHARD = re.compile(r"^S\((\d+)\)$")


def shard(dim: int) -> str:
    return f"S({dim})"


def shard_dim(placement: str) -> int | None:
    m = _SHARD.match(placement)
    return int(m.group(1)) if m else None


def is_placement(text: str) -> bool:
    return text in (R, P) or _SHARD.match(text) is not None


def replicated(num_axes: int) -> Spec:
    return (R,) * num_axes


def shard_factors(spec: Spec, ndim: int, mesh_shape: tuple[int, ...]) -> list[int]:
    """How many pieces each tensor dim is cut into."""
    factors = [1] * ndim
    for placement, size in zip(spec, mesh_shape, strict=True):
        d = shard_dim(placement)
        if d is not None:
            factors[d] *= size
    return factors


def is_valid(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Every split dim exists and divides evenly (uneven shards are not planned)."""
    for placement in spec:
        d = shard_dim(placement)
        if d is not None and d >= len(shape):
            return False
    factors = shard_factors(spec, len(shape), mesh_shape)
    return all(s % f == 0 for s, f in zip(shape, factors, strict=True))


def local_numel(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    n = 1
    for s, f in zip(shape, shard_factors(spec, len(shape), mesh_shape), strict=True):
        n *= s // f
    return n


def grad_spec(input_spec: Spec, output_spec: Spec) -> Spec:
    """Placement of the gradient an op sends back to one of its inputs.

    On an axis where the input is replicated but the output is not, each rank computed a
    different part of the output from the same input, so its gradient is a partial sum ("P").
    The gradient of a partial input is replicated (the sum's gradient reaches every term).
    Otherwise the gradient is placed like the input.
    """
    out = []
    for i, o in zip(input_spec, output_spec, strict=True):
        if i == R and o != R:
            out.append(P)
        elif i == P:
            out.append(R)
        else:
            out.append(i)
    return tuple(out)


def without_partial(spec: Spec) -> Spec:
    """Where a gradient must arrive for a tensor of this placement (gradients are never partial)."""
    return tuple(R if p == P else p for p in spec)


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    axis: int
    nbytes: int  # all_gather: gathered output; others: the input, per device


def redistribute(
    src: Spec,
    dst: Spec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
    all_to_all: bool = True,
) -> tuple[Collective, ...]:
    """The collectives that turn ``src`` into ``dst``, one mesh axis at a time.

    R->S and R->P are local (slice, or keep one copy and zero the rest) and cost nothing.
    Without ``all_to_all`` (gloo has none; DTensor then gathers and keeps its chunk), S(i)->S(j)
    is an all-gather of the whole of dim i.
    """
    current = list(src)
    found: list[Collective] = []
    for axis, (a, b) in enumerate(zip(src, dst, strict=True)):
        if a == b:
            continue
        before = local_numel(tuple(current), shape, mesh_shape) * itemsize
        current[axis] = b
        after = local_numel(tuple(current), shape, mesh_shape) * itemsize
        if a == P:
            kind = "all_reduce" if shard_dim(b) is None else "reduce_scatter"
            found.append(Collective(kind, axis, before))
        elif a == R:
            continue
        elif b in (R, P):
            found.append(Collective("all_gather", axis, after))
        elif all_to_all:
            found.append(Collective("all_to_all", axis, before))
        else:
            found.append(Collective("all_gather", axis, before * mesh_shape[axis]))
    return tuple(found)

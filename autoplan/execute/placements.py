"""Between plan placements ("R", "S(d)", "S(d)xk", "P") and DTensor placements: a strided
split "S(d)xk" is DTensor's ``_StridedShard(d, split_factor=k)``, whose shard of a tensor of
``k`` pieces is rank r's share of each (torch 2.13: distributed, redistributed to and from
"R" and "S(d)", made from a local shard)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.strategies.placement import P, R, fitted, pieces, shard, shard_dim, strided
from autoplan.torch_private import StridedShard


def to_dtensor(spec: Mapping[str, str], axes: Sequence[str]) -> tuple[Placement, ...]:
    """The DTensor placements of ``spec`` along ``axes``: one object per placement (they are
    immutable), so that the executor's comparisons of placements, once per op and step, are
    mostly identity checks."""
    return tuple(_placement(spec[axis]) for axis in axes)


def boundary_placements(
    boundary: Mapping[str, str], axes: Sequence[str], shape: Sequence[int]
) -> tuple[Placement, ...]:
    """How a tensor of ``shape`` crosses a pipeline stage boundary (`fitted`); a plan
    without stages has no boundary: nothing."""
    if not boundary:
        return ()
    spec = fitted([boundary[axis] for axis in axes], shape)
    return to_dtensor(dict(zip(axes, spec, strict=True)), axes)


@functools.cache
def _placement(text: str) -> Placement:
    d = shard_dim(text)
    if d is not None and pieces(text) > 1:
        return StridedShard(d, split_factor=pieces(text))
    if d is not None:
        return Shard(d)
    return Partial() if text == P else Replicate()


def from_dtensor(placements: Sequence[Placement]) -> tuple[str, ...]:
    out = []
    for p in placements:
        if isinstance(p, StridedShard):
            out.append(strided(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(shard(p.dim))
        elif isinstance(p, Partial):
            out.append(P)
        else:
            out.append(R)
    return tuple(out)


def reachable(current: Sequence[Placement], target: Sequence[Placement]) -> tuple[Placement, ...]:
    """The placement to redistribute to for ``target`` (with `torch_private.redistribute`):
    where the target is partial, a partial of any kind (such as the masked partial of a
    row-split embedding) stays as it is, and any other axis is made partial, a split one
    gathered first (the S->R->P the planner prices). The executor makes partials itself rather
    than leave an op's rule to: DTensor's rules differ between releases in which input they
    move (torch 2.11's add of a replicated and a partial tensor all-reduces the partial one)."""
    return tuple(
        (c if isinstance(c, Partial) else Partial()) if isinstance(t, Partial) else t
        for c, t in zip(current, target, strict=True)
    )


def split_dim(placement: Placement) -> int | None:
    """The tensor dim ``placement`` splits, plainly or strided; None for a whole or partial
    tensor."""
    return placement.dim if isinstance(placement, Shard | StridedShard) else None

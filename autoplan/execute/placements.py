"""Between plan placements ("R", "S(d)", "P") and DTensor placements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.strategies.placement import P, R, shard, shard_dim


def to_dtensor(spec: Mapping[str, str], axes: Sequence[str]) -> tuple[Placement, ...]:
    out: list[Placement] = []
    for axis in axes:
        text = spec[axis]
        d = shard_dim(text)
        if d is not None:
            out.append(Shard(d))
        elif text == P:
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def from_dtensor(placements: Sequence[Placement]) -> tuple[str, ...]:
    out = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(shard(p.dim))
        elif isinstance(p, Partial):
            out.append(P)
        else:
            out.append(R)
    return tuple(out)


def reachable(current: Sequence[Placement], target: Sequence[Placement]) -> tuple[Placement, ...]:
    """The target, except that an axis is never turned *into* a partial: DTensor allows that
    only inside its own op rules, which do it (locally, without communication) when the op
    needs it."""
    return tuple(
        c if isinstance(t, Partial) and not isinstance(c, Partial) else t
        for c, t in zip(current, target, strict=True)
    )

"""Between plan placements ("R", "S(d)", "S(d)xk", "P") and DTensor placements: a strided
split "S(d)xk" is DTensor's ``_StridedShard(d, split_factor=k)``, whose shard of a tensor of
``k`` pieces is rank r's share of each (torch 2.13: distributed, redistributed to and from
"R" and "S(d)", made from a local shard).

A strided split of unequal pieces ("S(d)x4:1:1") has no DTensor placement (``_StridedShard``
cuts equal pieces, and its subclasses do not survive DTensor's specs). Its tensors are held
as ``Shard(d)`` of the tensor *interleaved* (`interleave`: rank 0's share of every piece,
then rank 1's, ...), so that each rank's plain shard is its share of every piece. Only
parameters are so interleaved, when they are distributed (`held_layouts` says which); the
ops that keep the split run on local shards, and the plan never moves such a tensor
(`autoplan.strategies.placement.movable`). Whatever leaves the step whole (a state dict, a
checkpoint) is put back in the model's order (`logical`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.planfile.schema import Plan
from autoplan.strategies.placement import (
    P,
    R,
    fitted,
    pieces,
    shard,
    shard_dim,
    strided,
    unequal,
    widths,
)
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
    if d is not None and unequal(text):
        return Shard(d)  # of the interleaved tensor
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


# a parameter's interleaved dims: (mesh axis index, tensor dim, the pieces' widths), one per
# axis that splits it strided into unequal pieces
Layout = tuple[tuple[int, int, tuple[int, ...]], ...]


def held_layouts(plan: Plan) -> dict[str, Layout]:
    """The parameters whose storage is a strided split of unequal pieces, by FQN."""
    axes = plan.stage_axes
    found: dict[str, Layout] = {}
    for fqn, param in plan.params.items():
        layout = []
        for a, p in enumerate(param.storage[axis] for axis in axes):
            d = shard_dim(p)
            if d is not None and unequal(p):
                layout.append((a, d, widths(p)))
        if layout:
            found[fqn] = tuple(layout)
    return found


def _order(size: int, ws: tuple[int, ...], ranks: int) -> list[int]:
    """Interleaved position -> model position along a dim of ``size`` cut into pieces of
    relative widths ``ws``: rank 0's block of each piece, then rank 1's, ..."""
    unit = size // sum(ws)
    starts = [unit * sum(ws[:i]) for i in range(len(ws))]
    return [
        start + r * (unit * w // ranks) + j
        for r in range(ranks)
        for start, w in zip(starts, ws, strict=True)
        for j in range(unit * w // ranks)
    ]


def interleave(tensor: torch.Tensor, dim: int, ws: tuple[int, ...], ranks: int) -> torch.Tensor:
    """``tensor`` (the model's order along ``dim``) interleaved for ``ranks`` ranks."""
    index = torch.tensor(_order(tensor.shape[dim], ws, ranks), device=tensor.device)
    return tensor.index_select(dim, index)


def deinterleave(tensor: torch.Tensor, dim: int, ws: tuple[int, ...], ranks: int) -> torch.Tensor:
    """The inverse of `interleave`: the model's order back."""
    order = _order(tensor.shape[dim], ws, ranks)
    inverse = [0] * len(order)
    for held, model in enumerate(order):
        inverse[model] = held
    return tensor.index_select(dim, torch.tensor(inverse, device=tensor.device))


def logical(value: DTensor, layout: Layout) -> DTensor:
    """A parameter (or a tensor placed as one: its optimizer state) of ``layout`` in the
    model's order: split plainly along each interleaved dim."""
    return _reorder(value, layout, deinterleave)


def interleaved(value: DTensor, layout: Layout) -> DTensor:
    """The inverse of `logical`: a DTensor split plainly in the model's order, held
    interleaved (as the plan stores it)."""
    return _reorder(value, layout, interleave)


def _reorder(value: DTensor, layout: Layout, how: Callable[..., torch.Tensor]) -> DTensor:
    """``value`` gathered along each interleaved dim's axis, reordered by ``how`` locally, and
    split plainly again (a local chunk)."""
    mesh = value.device_mesh
    for axis, dim, ws in layout:
        whole = list(value.placements)
        whole[axis] = Replicate()
        gathered = value.redistribute(mesh, whole)
        local = how(gathered.to_local(), dim, ws, mesh.size(axis))
        value = DTensor.from_local(local, mesh, whole, shape=value.shape, stride=value.stride())
        split = [*whole[:axis], Shard(dim), *whole[axis + 1 :]]
        value = value.redistribute(mesh, split)
    return value


def gradient_to(mesh: DeviceMesh, planned: Sequence[Placement]) -> Callable[[Any], Any]:
    """A hook for an op's output: backward mirrors forward, so the output's gradient, summed
    over its users, is brought to the output's planned placement (a partial one reduced to
    replicated) before the op's backward runs, and DTensor's backward rules never choose
    another reduction."""
    goal = tuple(Replicate() if isinstance(p, Partial) else p for p in planned)

    def hook(grad: Any) -> Any:
        if isinstance(grad, DTensor) and tuple(grad.placements) != goal:
            return grad.redistribute(mesh, goal)
        return grad

    return hook

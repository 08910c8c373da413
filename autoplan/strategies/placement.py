"""Placements of a tensor over a logical mesh, and the collectives that change them.

A placement on one mesh axis is "R" (replicated), "P" (partial sums: the value is the sum over
the axis), "S(d)" (split along tensor dim ``d``) or "S(d)xk", a strided split: dim ``d`` is
``k`` equal pieces side by side (a fused projection's q|k|v) and each rank holds its share of
every piece, rank r of n the rows [j*w + r*w/n, j*w + (r+1)*w/n) of piece j of width w
(Megatron's interleaved layout; DTensor's ``_StridedShard(d, split_factor=k)``). Pieces of
unequal widths are written by their widths in lowest terms, "S(d)x4:1:1" (grouped-query
attention's q|k|v of 8 query and 2 key-value heads: pieces of 4/6, 1/6 and 1/6 of the dim),
each rank holding its share of every piece alike. Cut into its pieces, each piece is plainly
"S(d)", with no communication. A `Spec` is one placement per mesh axis.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

Spec = tuple[str, ...]

R = "R"
P = "P"
_SHARD = re.compile(r"^S\((\d+)\)(?:x([2-9]|[1-9]\d+|[1-9]\d*(?::[1-9]\d*)+))?$")


def shard(dim: int) -> str:
    return f"S({dim})"


def strided(dim: int, pieces: int | Sequence[int]) -> str:
    """The strided split of dim ``dim`` made of ``pieces`` equal pieces, or of pieces of
    these widths (in any unit: written in lowest terms)."""
    if isinstance(pieces, int):
        return f"S({dim})x{pieces}"
    unit = math.gcd(*pieces)
    if len(set(pieces)) == 1:
        return f"S({dim})x{len(pieces)}"
    return f"S({dim})x" + ":".join(str(w // unit) for w in pieces)


@functools.cache  # a handful of distinct placements, asked about millions of times
def shard_dim(placement: str) -> int | None:
    """The dim ``placement`` splits, plainly or strided; None for "R" and "P"."""
    m = _SHARD.match(placement)
    return int(m.group(1)) if m else None


@functools.cache
def widths(placement: str) -> tuple[int, ...]:
    """The widths of the pieces a strided split takes its share of, in lowest terms (equal
    pieces: ones); (1,) for any other placement."""
    m = _SHARD.match(placement)
    if not m or not m.group(2):
        return (1,)
    text = m.group(2)
    return tuple(int(w) for w in text.split(":")) if ":" in text else (1,) * int(text)


def pieces(placement: str) -> int:
    """How many pieces a strided split takes its share of; 1 for any other placement."""
    return len(widths(placement))


def unequal(placement: str) -> bool:
    """A strided split of pieces of unequal widths (which DTensor has no placement for)."""
    return len(set(widths(placement))) > 1


def is_placement(text: str) -> bool:
    return text in (R, P) or _SHARD.match(text) is not None


def movable(src: Spec, dst: Spec) -> bool:
    """Whether a tensor placed ``src`` can be moved to ``dst``: not on an axis where either is
    a strided split of unequal pieces and they differ (DTensor has no such placement)."""
    return all(a == b or not (unequal(a) or unequal(b)) for a, b in zip(src, dst, strict=True))


def replicated(num_axes: int) -> Spec:
    return (R,) * num_axes


def on_mesh(spec: Spec, mesh_shape: tuple[int, ...]) -> Spec:
    """``spec`` with "R" on every axis of size 1: on one rank, a split or a partial sum is the
    whole tensor, so every placement there is the same, and "R" is the one written."""
    return tuple(R if size == 1 else p for p, size in zip(spec, mesh_shape, strict=True))


def fitted(spec: Sequence[str], shape: Sequence[int]) -> Spec:
    """A placement given for many tensors (a pipeline stage's boundary) as one tensor of
    ``shape`` takes it: whole on an axis whose split dim it lacks (a scalar sent on with the
    batch split: a layer's load-balancing loss) or holds once (a tensor of batch 1 broadcast
    against the batch, the same on every rank: transformers' rotary tables, shaped (1, seq,
    head_dim), read by every decoder layer)."""

    def whole(placement: str) -> bool:
        d = shard_dim(placement)
        return d is not None and (d >= len(shape) or shape[d] == 1)

    return tuple(R if whole(p) else p for p in spec)


def shard_factors(spec: Spec, ndim: int, mesh_shape: tuple[int, ...]) -> list[int]:
    """How many pieces each tensor dim is cut into."""
    factors = [1] * ndim
    for placement, size in zip(spec, mesh_shape, strict=True):
        d = shard_dim(placement)
        if d is not None:
            factors[d] *= size
    return factors


@functools.lru_cache(maxsize=2**16)
def is_valid(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Every split dim exists and divides evenly (uneven shards are not planned); a strided
    split's every piece divides evenly, and no other mesh axis splits its dim."""
    dims = [shard_dim(placement) for placement in spec]
    if any(d is not None and d >= len(shape) for d in dims):
        return False
    factors = shard_factors(spec, len(shape), mesh_shape)
    for placement, d in zip(spec, dims, strict=True):
        k = sum(widths(placement))
        if k > 1 and (dims.count(d) > 1 or shape[d] % (k * factors[d])):  # type: ignore[index]
            return False
    return all(s % f == 0 for s, f in zip(shape, factors, strict=True))


def local_numel(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """The elements of the largest shard: a split that does not divide (a ZeRO state's,
    `autoplan.strategies.zero_state`) is cut as torch.chunk cuts it, ceil(n / k) a piece."""
    n = 1
    for s, f in zip(shape, shard_factors(spec, len(shape), mesh_shape), strict=True):
        n *= -(-s // f)
    return n


def grad_spec(input_spec: Spec, output_spec: Spec, kept: Spec | None = None) -> Spec:
    """Placement of the gradient an op sends back to one of its inputs.

    On an axis where the input is replicated but the output is not, each rank computed a
    different part of the output from the same input, so its gradient is a partial sum ("P").
    So it is where input and output are replicated and the op keeps its output's gradient
    partial (``kept``, see `Strategy.grad`): backward is linear in the gradient, and every
    rank runs it on the same saved values. The gradient of a partial input is replicated (the
    sum's gradient reaches every term). Otherwise the gradient is placed like the input.
    """
    kept = kept or (R,) * len(output_spec)
    out = []
    for i, o, k in zip(input_spec, output_spec, kept, strict=True):
        if i == R and (o != R or k == P):
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
    # the mesh axes whose ranks form the group: one for a redistribution step, several for a
    # gradient bucket all-reduced over them at once (strategies/buckets.py)
    axes: tuple[int, ...]
    nbytes: int  # all_gather: gathered output; others: the input, per device


def _transition(
    a: str,
    b: str,
    axis: int,
    before: int,
    after: int,
    mesh_shape: tuple[int, ...],
    all_to_all: bool,
) -> Collective | None:
    """The collective of one single-axis step a -> b; ``before``/``after`` are local bytes
    (of the largest shard: a split that does not divide is padded to it, as DTensor pads it
    for its reduce-scatters and all-gathers)."""
    axes = (axis,)
    # DTensor (2.13) moves to and from a strided split whole: P -> "S(d)xk" all-reduces, then
    # slices; "S(d)xk" <-> "S(d)" gathers, then slices
    plain = pieces(a) == 1 and pieces(b) == 1
    if a == P:
        split = shard_dim(b) is not None and plain
        if split:
            return Collective("reduce_scatter", axes, after * mesh_shape[axis])
        return Collective("all_reduce", axes, before)
    if a == R:
        return None  # R -> S slices, R -> P keeps one copy: both local
    if shard_dim(b) is None:
        return Collective("all_gather", axes, before * mesh_shape[axis])
    if all_to_all and plain:
        return Collective("all_to_all", axes, before)
    return Collective("all_gather", axes, before * mesh_shape[axis])  # gloo: gather, then chunk


def redistribute(
    src: Spec,
    dst: Spec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
    all_to_all: bool = True,
) -> tuple[Collective, ...]:
    """The collectives that turn ``src`` into ``dst``, in the order DTensor issues them.

    This follows DTensor's default (greedy) redistribution in torch 2.13: when ``src`` splits
    anything, visit the axes from inner to outer and move each to its target, except that a
    target split of dim d becomes a full gather first when the outer axes splitting d differ
    between now and the target (DTensor's splits of one dim nest, outer axis first); then visit
    the axes from outer to inner for what is left. Without ``all_to_all`` (gloo has none),
    S(i)->S(j) is an all-gather of dim i followed by a local chunk.
    """
    current = list(src)
    found: list[Collective] = []

    def step(axis: int, target: str) -> None:
        before = local_numel(tuple(current), shape, mesh_shape) * itemsize
        a = current[axis]
        current[axis] = target
        after = local_numel(tuple(current), shape, mesh_shape) * itemsize
        collective = _transition(a, target, axis, before, after, mesh_shape, all_to_all)
        if collective is not None:
            found.append(collective)

    if any(shard_dim(p) is not None for p in src):
        for axis in reversed(range(len(src))):
            target = dst[axis]
            d = shard_dim(target)
            if d is not None:
                outer_now = [i for i in range(axis) if shard_dim(current[i]) == d]
                outer_then = [i for i in range(axis) if shard_dim(dst[i]) == d]
                if outer_now != outer_then:
                    target = R
            if current[axis] != target:
                step(axis, target)
    for axis in range(len(src)):
        if current[axis] != dst[axis]:
            step(axis, dst[axis])
    return tuple(found)

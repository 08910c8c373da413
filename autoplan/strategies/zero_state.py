"""ZeRO stages 1 and 2: a parameter stored whole along some mesh axes (replicated, as data
parallelism keeps it) whose optimizer state is split along them.

Each rank updates only its shard of such a parameter: it keeps the shard's optimizer state and
a copy of the shard's values (the master shard the optimizer steps), and after the step the
updated shards are all-gathered back into the whole parameter that forward reads (phase
"update"). The gradient is synchronized either as stored (ZeRO-1: all-reduced whole, in a
bucket, then each rank takes its shard's part) or straight to the shard (ZeRO-2: reduce-
scattered, so that each rank keeps only its shard's gradient). ZeRO-3 is a storage placement
of its own (the parameter stored split, gathered before use), not this.

The state is split along one tensor dim that the storage leaves whole, on one mesh axis where
the parameter is stored whole, or on all of them together: the first such dim that divides
evenly, else the largest that has a piece for every rank, split unevenly as torch.chunk cuts
it (DTensor pads such a split for its collectives). Megatron's distributed optimizer and
DeepSpeed's ZeRO shard a flat buffer of all parameters, padded, so that no dim needs to
divide: without the uneven split, data parallelism over a degree that divides no dim of a
model's weights (48 ranks, dims that are powers of two) would keep every state whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from autoplan.graph.ir import Graph, itemsize
from autoplan.strategies.placement import R, Spec, is_valid, shard, shard_dim, shard_factors

FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})
CAST = "aten._to_copy.default"  # the cast ops autocast traces (`autoplan.precision`)


# asked for each parameter's storage candidates by the planner, and again by baselines and
# plan checks
@functools.lru_cache(maxsize=2**16)
def state_specs(
    storage: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[Spec, ...]:
    """The placements of a ZeRO-1/2 optimizer state for a parameter of ``shape`` stored
    ``storage``: split further along axes where it is stored whole (of more than one device)."""
    whole = [
        a
        for a, (p, size) in enumerate(zip(storage, mesh_shape, strict=True))
        if p == R and size > 1
    ]
    groups = [(a,) for a in whole] + ([tuple(whole)] if len(whole) > 1 else [])
    split_dims = {shard_dim(p) for p in storage} - {None}
    found = []
    for axes in groups:
        parts = math.prod(mesh_shape[a] for a in axes)
        free = [d for d, n in enumerate(shape) if d not in split_dims and n >= parts and n > 1]
        even = [d for d in free if shape[d] % parts == 0]
        dim = even[0] if even else max(free, key=lambda d: shape[d], default=None)
        if dim is None:
            continue
        spec = tuple(shard(dim) if a in axes else p for a, p in enumerate(storage))
        if is_valid_state(spec, shape, mesh_shape):
            found.append(spec)
    return tuple(found)


def is_valid_state(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether ``spec`` places a state of ``shape`` as `autoplan.strategies.placement.is_valid`
    asks of any tensor, but for evenness: each split dim is padded to a multiple of its pieces,
    as DTensor pads an uneven split."""
    dims = [shard_dim(p) for p in spec]
    if len(spec) != len(mesh_shape) or any(d is not None and d >= len(shape) for d in dims):
        return False
    factors = shard_factors(spec, len(shape), mesh_shape)
    padded = tuple(-(-n // f) * f for n, f in zip(shape, factors, strict=True))
    return is_valid(spec, padded, mesh_shape)


def gathered_dtype(stored: str, reads: Sequence[str | None]) -> str:
    """The dtype in which a ZeRO-1/2 parameter stored as ``stored`` is gathered after the
    optimizer step: the narrower float dtype that every one of its ``reads`` casts it to
    (mixed precision's cast to bf16 of a float32 master weight), as Megatron's distributed
    optimizer gathers the bf16 parameters; else ``stored``. A read is the dtype its op casts
    to, or None for any other op. Exact: such a read sees only the cast values, which the
    narrower gather carries unchanged."""
    targets = set(reads)
    if len(targets) != 1 or None in targets:
        return stored
    (target,) = targets
    assert target is not None
    narrower = itemsize(target) < itemsize(stored)
    floats = {target, stored} <= FLOAT_DTYPES
    return target if narrower and floats else stored


def param_gathered_dtype(graph: Graph, name: str) -> str:
    """`gathered_dtype` of the parameter node ``name`` of ``graph``, from its users."""
    reads = [
        user.output.dtype if user.op == CAST and len(user.outputs) == 1 else None
        for user in map(graph.node, graph.users(name))
    ]
    return gathered_dtype(graph.node(name).output.dtype, reads)

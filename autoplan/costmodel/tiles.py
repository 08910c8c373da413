"""Tile quantization of a matmul's work (`autoplan.costmodel.timing.tile_share`), from the
shapes of its shards: a GPU computes every result in whole tiles, so a shard whose rows or
columns are not whole tiles does part of its work for nothing."""

from __future__ import annotations

import math

from autoplan.costmodel.timing import tile_share
from autoplan.graph.ir import Node
from autoplan.strategies.placement import P, shard_factors
from autoplan.strategies.space import Strategy

# ops whose FLOPs a GPU computes in tensor-core tiles
MATMULS = frozenset({"linear", "mm", "addmm", "matmul", "bmm", "baddbmm"})


def matmul_tile_share(
    node: Node, strategy: Strategy, mesh_shape: tuple[int, ...], backward: bool = True
) -> float:
    """Of a matmul's work, the share inside its results' tiles, weighed by FLOPs: its
    forward's result (its output shard's rows x columns; a linear's leading dims are its rows)
    and, in ``backward``, the input's gradient (rows x the inner dim) and the weight's (inner
    dim x columns); a backward of one matmul makes the weight's where the op reads a
    parameter, else the input's. 1 for other ops."""
    name = node.op.split(".")[1] if node.op.startswith("aten.") else ""
    if name not in MATMULS or len(node.outputs) != 1:
        return 1.0
    out = node.output
    if not node.flops or not out.shape:
        return 1.0
    factors = shard_factors(strategy.output, len(out.shape), mesh_shape)
    local = [n // f for n, f in zip(out.shape, factors, strict=True)]
    rows = local[-2] if name in ("bmm", "baddbmm") else math.prod(local[:-1])
    cols = local[-1]
    # the inner dim, split where the output is a partial sum
    spec = zip(mesh_shape, strategy.output, strict=True)
    partial = math.prod(n for n, p in spec if p == P)
    inner = max(1, round(node.flops / (2 * out.numel * partial)))
    shares = [tile_share(rows, cols)]
    matmuls = round(node.bwd_flops / node.flops) if backward else 0
    if matmuls >= 2:
        shares += [tile_share(rows, inner), tile_share(inner, cols)]
    elif matmuls == 1:
        shares.append(tile_share(inner, cols) if node.params else tile_share(rows, inner))
    return len(shares) / sum(1 / s for s in shares)

"""Repeated layers: find the copies of a block (``blocks.0``, ``blocks.1`` ...) in the graph.

A block is the set of nodes whose module path starts with ``<name>.<index>``. Two blocks of
the same parent are copies when their nodes match one by one in op, shapes and wiring. The
planner gives copy ``k`` the decisions of copy ``k mod period`` (period 2 by default, so that
alternating patterns such as Megatron's column/row split of consecutive Linear layers stay
reachable), and a 96-layer model costs about as much to solve as two layers.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass

from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind

_LIFTED = re.compile(r"lifted_tensor_\d+$")
_INDEXED = re.compile(r"^(.*?\b[A-Za-z_]\w*)\.(\d+)(?:\.|$)")


def block_of(node: Node) -> str | None:
    """``"blocks.3"`` for a node inside the 4th block of a ModuleList, else None."""
    return _block_of_path(node.target if node.kind == NodeKind.PARAM else node.module_path)


@functools.cache  # asked millions of times by the planner and the conventional plans
def _block_of_path(path: str) -> str | None:
    m = _INDEXED.match(path)
    return f"{m.group(1)}.{m.group(2)}" if m else None


@dataclass(frozen=True)
class BlockSharing:
    blocks: dict[str, tuple[str, ...]]  # block name -> its node names in graph order
    canonical: dict[str, str]  # node in a repeated copy -> the same node in the first copy

    def count(self, name: str) -> int:
        """How many nodes share the decision of canonical node ``name``."""
        counts = self.__dict__.get("_counts")
        if counts is None:
            counts = defaultdict(lambda: 1)
            for rep in self.canonical.values():
                counts[rep] += 1
            object.__setattr__(self, "_counts", counts)
        return int(counts[name])

    def rep(self, name: str) -> str:
        return self.canonical.get(name, name)


def signature(graph: Graph, names: tuple[str, ...], prefix: str | None) -> tuple[Hashable, ...]:
    """What makes the nodes ``names`` one structure: ops, shapes and wiring by position, and
    module paths below ``prefix`` (left out when ``prefix`` is None)."""
    position = {n: i for i, n in enumerate(names)}

    def wire(value: object) -> object:
        if isinstance(value, Ref):
            if value.name in position:
                return ("in", position[value.name], value.index)
            return ("ext", graph.tensor(value))
        if isinstance(value, tuple):
            return tuple(wire(v) for v in value)
        return value

    sig = []
    for name in names:
        n = graph.node(name)
        path = n.target if n.kind == NodeKind.PARAM else n.module_path
        # export numbers the tensors made in forward across the model (lifted_tensor_0 in one
        # block, lifted_tensor_2 in the next): the number says nothing of the structure
        path = _LIFTED.sub("lifted_tensor", path)
        local = None if prefix is None else path.removeprefix(prefix)
        sig.append(
            (
                n.kind,
                n.op,
                local,
                n.outputs,
                n.needs_grad,
                n.flops,
                n.bwd_flops,
                wire(n.args),
                wire(n.kwargs),
            )
        )
    return tuple(sig)


def find_sharing(graph: Graph, period: int = 2) -> BlockSharing:
    blocks: dict[str, list[str]] = defaultdict(list)
    for n in graph:
        b = block_of(n)
        if b is not None:
            blocks[b].append(n.name)
    frozen = {b: tuple(names) for b, names in blocks.items()}
    copies: dict[tuple[str, tuple[Hashable, ...]], list[str]] = defaultdict(list)
    canonical: dict[str, str] = {}
    for b, names in frozen.items():
        parent = b.rsplit(".", 1)[0]
        same = copies[(parent, signature(graph, names, b))]
        if len(same) >= period:
            canonical.update(zip(names, frozen[same[len(same) % period]], strict=True))
        same.append(b)
    return BlockSharing(blocks=frozen, canonical=canonical)

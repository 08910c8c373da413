"""What backward keeps from forward: the tensors autograd saves, op by op, as torch's own
derivative formulas save them.

Each op that a gradient flows through runs once on fake CPU tensors (no memory) with its
inputs requiring a gradient as theirs do in the step, under a
``torch.autograd.graph.saved_tensors_hooks`` that sees every tensor its backward saves (a
composite op, such as ``linear`` or ``cross_entropy``, saves those of the ops it
decomposes into). A saved tensor is one of the op's inputs, one of its outputs (or a view of
either: the same storage), or a tensor of its own (a norm's statistics, an attention's
log-sum-exp, a loss's log-probabilities). A tensor is kept once however many ops save it,
until the backward of the first of them in graph order (the last to run) frees it; one saved
through a view is kept as the tensor the view reads.

CPU fakes pick the CPU kernels (scaled dot-product attention: the flash kernel, which keeps
queries, keys, values, output and log-sum-exp, as CUDA's flash and efficient kernels do).
An op that cannot run on fake tensors (a data-dependent shape) keeps its outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from autoplan.graph.ir import Graph, Node, Ref, TensorInfo
from autoplan.graph.recompute import FUSED_ATTENTION
from autoplan.modes import NodeKind
from autoplan.torch_private import FakeTensorMode

log = logging.getLogger(__name__)


def resolve(op: str) -> Any:
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor`` (any namespace); None if none."""
    found: Any = torch.ops
    for part in op.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def _key(node: Node, graph: Graph) -> tuple[str, Any, Any]:
    """The op with each tensor argument as (shape, dtype, needs grad, its position among the
    op's distinct tensors): one analysis for the identical ops of repeated blocks."""
    position = {r: i for i, r in enumerate(dict.fromkeys(node.refs))}

    def strip(value: Any) -> Any:
        if isinstance(value, Ref):
            producer = graph.node(value.name)
            return _Arg(producer.outputs[value.index], producer.needs_grad, position[value])
        if isinstance(value, tuple):
            return tuple(strip(v) for v in value)
        return value

    return node.op, strip(node.args), strip(node.kwargs)


@dataclass(frozen=True)
class _Arg:
    info: TensorInfo
    needs_grad: bool
    position: int


def _analyze(op: str, args: Any, kwargs: Any) -> _Saved | None:
    try:
        return _analyze_cached(op, args, kwargs)
    except TypeError:  # an unhashable argument
        return _analyze_uncached(op, args, kwargs)


_Saved = tuple[frozenset[int], frozenset[int], int]


def _analyze_uncached(op: str, args: Any, kwargs: Any) -> _Saved | None:
    """(saved inputs by position, saved outputs by index, bytes saved of neither), or None
    where the op does not run on fake tensors."""
    overload = resolve(op)
    if overload is None:
        return None
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    try:
        with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            made: dict[int, torch.Tensor] = {}

            def build(value: Any) -> Any:
                if isinstance(value, _Arg):
                    if value.position not in made:
                        t = torch.empty(value.info.shape, dtype=getattr(torch, value.info.dtype))
                        made[value.position] = t.requires_grad_(
                            value.needs_grad and (t.is_floating_point() or t.is_complex())
                        )
                    return made[value.position]
                if isinstance(value, tuple):
                    return tuple(build(v) for v in value)
                return value

            out = overload(*build(args), **dict(build(kwargs)))
    except Exception as e:  # any op torch cannot run on fakes: it keeps its outputs
        log.debug("%s does not run on fake tensors (%s): its outputs are kept", op, e)
        return None
    storage = StorageWeakRef
    ins = {storage(t.untyped_storage()): i for i, t in made.items()}
    outs = {
        storage(t.untyped_storage()): j
        for j, t in enumerate(x for x in tree_leaves(out) if isinstance(x, torch.Tensor))
    }
    saved_ins: set[int] = set()
    saved_outs: set[int] = set()
    own: dict[StorageWeakRef, int] = {}
    for t in packed:
        key = storage(t.untyped_storage())
        if key in ins:
            saved_ins.add(ins[key])
        elif key in outs:
            saved_outs.add(outs[key])
        else:
            own[key] = t.untyped_storage().nbytes()
    return frozenset(saved_ins), frozenset(saved_outs), sum(own.values())


_analyze_cached = lru_cache(maxsize=4096)(_analyze_uncached)


def _base(ref: Ref, aliases: Mapping[Ref, Ref]) -> Ref:
    """The tensor whose storage ``ref`` reads: through views, to the op that made it."""
    while ref in aliases:
        ref = aliases[ref]
    return ref


def _largest_input(graph: Graph, node: Node) -> int:
    """The index of the op's tensor input larger than its outputs and its other inputs, or
    -1 (its first output)."""
    size = max((o.numel for o in node.outputs), default=0)
    found = -1
    for i, ref in enumerate(node.refs):
        if graph.tensor(ref).numel > size:
            size, found = graph.tensor(ref).numel, i
    return found


def _keys_bytes(graph: Graph, node: Node) -> int:
    """An attention's keys' and values' bytes (`Node.keys_bytes`); 0 for other ops."""
    if not node.op.startswith(FUSED_ATTENTION):
        return 0
    return sum(graph.tensor(r).nbytes for r in node.refs[1:3])


def with_saved(graph: Graph, aliases: Mapping[Ref, Ref]) -> Graph:
    """``graph`` with each op's `Node.kept`, `Node.kept_by`, `Node.saves` and
    `Node.kept_extra_bytes`;
    ``aliases``: each op output that is a view of an input, as traced -> that input."""
    saver: dict[Ref, str] = {}  # a kept tensor -> its first saver in graph order
    extra: dict[str, int] = {}
    saves: dict[str, tuple[int, ...]] = {}  # by op: the positions in its refs it saves

    def keep(ref: Ref, by: str) -> None:
        saver.setdefault(_base(ref, aliases), by)

    for node in graph:
        if node.kind != NodeKind.OP or not node.needs_grad:
            continue
        found = _analyze(*_key(node, graph))
        if found is None:
            for j in range(len(node.outputs)):
                keep(Ref(node.name, j), node.name)
            continue
        ins, outs, own = found
        distinct = list(dict.fromkeys(node.refs))
        for i in sorted(ins):
            keep(distinct[i], node.name)
        saved_refs = {distinct[i] for i in ins}
        saves[node.name] = tuple(i for i, r in enumerate(node.refs) if r in saved_refs)
        for j in sorted(outs):
            keep(Ref(node.name, j), node.name)
        if own:
            extra[node.name] = own
    position = {n.name: i for i, n in enumerate(graph)}
    nodes = []
    for n in graph:
        if n.kind == NodeKind.OP:
            kept = tuple(j for j in range(len(n.outputs)) if Ref(n.name, j) in saver)
            by = min((saver[Ref(n.name, j)] for j in kept), key=position.__getitem__, default="")
            n = replace(
                n,
                kept=kept,
                kept_by=by,
                saves=saves.get(n.name, ()),
                kept_extra_bytes=extra.get(n.name, 0),
                kept_extra_like=_largest_input(graph, n) if n.name in extra else -1,
                keys_bytes=_keys_bytes(graph, n),
            )
        nodes.append(n)
    return replace(graph, nodes=tuple(nodes))

"""The graph IR: frozen nodes in graph order, with shapes, FLOPs, bytes and module paths.

The IR is what the planner reads. It is made once by `capture` and never mutated; the
buffers forward updates are its `Write` s, values the output node reads besides the loss. Tensor
arguments of a node appear in ``args`` as `Ref` to the producing node (``Ref(name, index)``
where ``index`` picks one output of a multi-output node). `Graph.dataflow` is the same graph as
a networkx DAG, for the graph algorithms the planner runs on it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import networkx as nx

from autoplan.modes import NodeKind

T = TypeVar("T")


_ITEMSIZE = {
    "complex128": 16,
    "complex64": 8,  # torchtitan's rotary embeddings: pairs of float32
    "complex32": 4,
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as torch names it without the prefix ("float32")."""
    return _ITEMSIZE.get(dtype, 4)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def is_differentiable(self) -> bool:
        """Floating point or complex (torchtitan's rotary embeddings): autograd makes its
        gradient."""
        return self.dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True)
class Ref:
    """A tensor argument: output ``index`` of node ``name``."""

    name: str
    index: int = 0


@dataclass(frozen=True)
class Node:
    name: str
    kind: str
    op: str  # "aten.linear.default"; the kind for non-op nodes
    args: tuple[Any, ...]  # fx args with tensors replaced by Ref
    kwargs: tuple[tuple[str, Any], ...]
    outputs: tuple[TensorInfo, ...]  # one per tensor output; empty for an output
    flops: float  # forward FLOPs of the whole (unsharded) op
    bwd_flops: float  # backward FLOPs
    bytes_moved: float  # forward bytes read + written
    module_path: str  # "blocks.3.attn.qkv"; "" at the top level
    target: str  # parameter/buffer FQN of a param, user input name of an input, else ""
    params: tuple[str, ...]  # FQNs of the parameters and buffers this op reads directly
    needs_grad: bool  # a gradient flows to this node's output in backward
    # the output aliases an input: no new memory, no compute (but a cast's, `bytes_moved`)
    is_view: bool
    # elements through which the forward evaluates a transcendental function (graph/flops.py)
    transcendental: float = 0.0
    # of an op: the outputs backward keeps, saved by it or by an op that reads them (views
    # resolved to the tensor they read; `autoplan.graph.saved`); None: not known, all of them
    kept: tuple[int, ...] | None = None
    kept_by: str = ""  # the op whose backward frees them (the first to save them); "": itself
    # of an op: the positions in `refs` of the inputs its own backward saves, as it reads them
    # (placed as it needs them: a redistributed input is kept redistributed)
    saves: tuple[int, ...] = ()
    kept_extra_bytes: float = 0.0  # what its backward saves that is no input or output, whole
    kept_extra_like: int = -1  # split as its tensor input of this index (-1: its output)
    # of an attention: its keys' and values' bytes, whole (kept gathered by the ranks that
    # split its queries along the sequence: context parallelism, `strategies.attention`)
    keys_bytes: float = 0.0

    def __hash__(self) -> int:
        # nodes key the planner's rule caches, asked a million times for a large model: the
        # hash of the fields (nested arguments and all) is made once
        cache = self.__dict__.get("_hash_cache")
        if cache is None:
            cache = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash_cache", cache)
        return cache

    @property
    def output(self) -> TensorInfo:
        assert len(self.outputs) == 1, f"{self.name} has {len(self.outputs)} outputs"
        return self.outputs[0]

    @property
    def refs(self) -> tuple[Ref, ...]:
        """Tensor arguments in argument order (lists flattened), then tensor kwargs."""
        cache = self.__dict__.get("_refs_cache")
        if cache is None:
            found: list[Ref] = []
            _collect_refs(self.args, found)
            _collect_refs(tuple(v for _, v in self.kwargs), found)
            cache = tuple(found)
            object.__setattr__(self, "_refs_cache", cache)
        return cache


def _collect_refs(value: Any, found: list[Ref]) -> None:
    if isinstance(value, Ref):
        found.append(value)
    elif isinstance(value, tuple | list):
        for v in value:
            _collect_refs(v, found)


@dataclass(frozen=True)
class Write:
    """A buffer that forward updates (batch norm's running statistics, a counter): after
    forward the step writes ``value`` into it, as one process's forward writes it in place.
    The value is also an input of the graph's output node, which the plan places replicated."""

    buffer: str  # the buffer's FQN
    value: Ref


@dataclass(frozen=True)
class Graph:
    """A traced train step (or forward), nodes in topological (graph) order."""

    nodes: tuple[Node, ...]
    fingerprint: str
    precision: str | None = None  # the mixed precision traced under (autoplan.precision)
    writes: tuple[Write, ...] = ()  # the buffers forward updates, in the output's order

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, name: str) -> Node:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, Node]:
        cache = self.__dict__.get("_by_name_cache")
        if cache is None:
            cache = {n.name: n for n in self.nodes}
            object.__setattr__(self, "_by_name_cache", cache)
        return cache

    @property
    def dataflow(self) -> nx.DiGraph:
        """The graph as a networkx DAG: an edge from each node to each node that reads it (one
        however many times it reads it); nodes, and each node's readers, in graph order."""
        cache = self.__dict__.get("_dataflow_cache")
        if cache is None:
            cache = nx.DiGraph()
            cache.add_nodes_from(n.name for n in self.nodes)
            cache.add_edges_from(
                (read, n.name) for n in self.nodes for read in dict.fromkeys(r.name for r in n.refs)
            )
            object.__setattr__(self, "_dataflow_cache", cache)
        return cache

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, made once per graph and ``key``: for facts that follow from the nodes
        alone and are asked for again and again (by every conventional plan, say)."""
        memos = self.__dict__.setdefault("_memos", {})
        if key not in memos:
            memos[key] = make()
        return memos[key]

    def users(self, name: str) -> tuple[str, ...]:
        """The nodes that read node ``name``, in graph order."""
        return tuple(self.dataflow.successors(name))

    def fan_out(self, ref: Ref) -> int:
        """How many op inputs read tensor ``ref`` (one read twice by one op counts twice); the
        other outputs of its node are other tensors, each redistributed on its own."""
        return max(
            1, sum(1 for user in self.users(ref.name) for r in self.node(user).refs if r == ref)
        )

    @property
    def params(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.kind == NodeKind.PARAM)

    @property
    def num_params(self) -> int:
        return sum(n.output.numel for n in self.params)

    def tensor(self, ref: Ref) -> TensorInfo:
        return self.node(ref.name).outputs[ref.index]

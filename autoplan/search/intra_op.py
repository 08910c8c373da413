"""Intra-operator planning: turn (graph, strategies, costs) into an ILP, solve it, decode it.

Variables are *groups* of nodes that share one decision:
* every copy of a repeated layer uses the decision of the first copy (`graph.layers`), with
  costs multiplied by the number of copies;
* a *follower* (an op with one tensor input from an op of the same layer: views,
  element-wise ops) is merged into its producer: for each producer strategy it takes its own
  cheapest strategy given that producer strategy, as Alpa does.
Its costs are those `costmodel.step_price` charges the plan: a tensor read once is an edge
(moving it, and its gradient back); a tensor read by several ops is moved once per placement
they read it in and its gradients reduced once per such placement (a shared cost each); a
parameter's bucketed gradient costs its bytes, and the buckets of each mesh axes their latency
each, counted as DDP fills them (a bucket cost). What the ILP cannot see exactly (which
gradients share a bucket, ops waiting once for several moved inputs) is why the planner also
prices the conventional plans of the shape it found (`autoplan.api`). A move that would mix
a routed region's local rows with the one-process tensor's shards (`strategies.routing`)
costs more than any plan without one (`autoplan.solvers.forbidden`).
The ILP itself lives in `solve.ilp` and never sees a node; `evaluate` rechecks its answer.
A mesh's problem is built, solved and priced by `search.mesh_plans`.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pricer import Pricer
from autoplan.graph.blocks import BlockSharing, block_of
from autoplan.graph.ir import Graph, Node, Ref
from autoplan.modes import NodeKind
from autoplan.phases import timed
from autoplan.solvers.evaluate import evaluate
from autoplan.solvers.forbidden import priced_forbidden
from autoplan.solvers.ilp import solve_intra_op
from autoplan.solvers.problem import (
    BucketCost,
    Edge,
    Grouping,
    IntraOpProblem,
    IntraOpSolution,
    SharedCost,
)
from autoplan.strategies import routing
from autoplan.strategies.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from autoplan.strategies.placement import Spec, grad_spec
from autoplan.strategies.space import (
    NodeStrategies,
    Strategy,
    input_grad,
)
from autoplan.strategies.zero_state import param_gathered_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntraOpResult:
    mesh_shape: tuple[int, ...]
    assignment: dict[str, Strategy]  # every node of the graph
    solution: IntraOpSolution
    problem: IntraOpProblem


Reader = tuple[str, int]  # (canonical consumer, input index)
Read = tuple[str, int, tuple[Reader, ...]]  # (canonical producer, output index, its readers)


def _reads(
    graph: Graph, layers: BlockSharing
) -> tuple[dict[tuple[str, str, int], int], dict[Read, int]]:
    """How the graph's tensors are read, by canonical node, each with its number of copies:
    tensors read once as edges ``(producer, consumer, input index)``, tensors read more than
    once (`Read`)."""
    readers: dict[Ref, list[Reader]] = defaultdict(list)
    for node in graph:
        for i, ref in enumerate(node.refs):
            readers[ref].append((layers.rep(node.name), i))
    edges: dict[tuple[str, str, int], int] = defaultdict(int)
    shared: dict[Read, int] = defaultdict(int)
    for ref, found in readers.items():
        if len(found) == 1:
            edges[(layers.rep(ref.name), *found[0])] += 1
        else:
            shared[(layers.rep(ref.name), ref.index, tuple(found))] += 1
    return edges, shared


def _edge_matrix(
    graph: Graph,
    space: Mapping[str, NodeStrategies],
    pricer: Pricer,
    key: tuple[str, str, int],
    once: float,
) -> list[list[float]]:
    u, v, i = key
    producer, consumer = graph.node(u), graph.node(v)
    tensor = graph.tensor(consumer.refs[i])
    found = routing.graph_region(graph)
    routed = u in found.inside
    counted = v in found.inside and consumer.op in routing.COUNTS
    return [
        [
            math.inf  # made a cost above any plan's (`autoplan.solvers.forbidden`)
            if (routed and routing.moves_routed_rows(su.output, sv.inputs[i]))
            or (counted and routing.makes_counts(su.output, sv.inputs[i]))
            else pricer.edge(producer, tensor, su, consumer, sv, i, once)
            for sv in space[v].strategies
        ]
        for su in space[u].strategies
    ]


def _shared_costs(
    graph: Graph,
    space: Mapping[str, NodeStrategies],
    pricer: Pricer,
    grouping: Grouping,
    read: Read,
    count: int,
    once: float,
) -> list[SharedCost]:
    """A tensor read more than once, as the executor runs it (`price_step`): moved once per
    placement its readers read it in, and their gradients summed and brought back once per
    such placement and gradient placement (exact unless readers in one placement send
    gradients placed differently, then reduced apart). One shared cost each, ``count``
    times (the copies of a repeated layer)."""
    name, index, readers = read
    producer = graph.node(name)
    tensor = producer.outputs[index]
    sources = [space[name].strategies[k] for k in grouping.pick[name]]
    moves: dict[Spec, list[tuple[int, int]]] = defaultdict(list)
    grads: dict[tuple[Spec, Spec], list[tuple[int, int]]] = defaultdict(list)
    region = routing.graph_region(graph)
    counted: set[Spec] = set()  # placements a routed region's ops read it in
    for consumer, i in readers:
        group = grouping.group_of[consumer]
        reader = graph.node(consumer)
        for k, j in enumerate(grouping.pick[consumer]):
            dst = space[consumer].strategies[j]
            moves[dst.inputs[i]].append((group, k))
            if consumer in region.inside and reader.op in routing.COUNTS:
                counted.add(dst.inputs[i])
            if producer.needs_grad:
                grads[(dst.inputs[i], input_grad(reader, dst, i))].append((group, k))
    src = grouping.group_of[name]
    routed = name in region.inside

    def read_s(s: Strategy, p: Spec) -> float:
        if routed and routing.moves_routed_rows(s.output, p):
            return math.inf
        if p in counted and routing.makes_counts(s.output, p):
            return math.inf
        return count * pricer.read_s(tensor, s, p)

    found = [
        SharedCost(src, tuple(read_s(s, p) for s in sources), tuple(when))
        for p, when in moves.items()
    ]
    found += [
        SharedCost(
            src,
            tuple(count * pricer.grad_s(producer, tensor, s, g, once) for s in sources),
            tuple(when),
        )
        for (_, g), when in grads.items()
    ]
    return found


def _follower_producer(node: Node, graph: Graph) -> str | None:
    """The producer a follower merges into, or None if ``node`` is not a follower."""
    if node.kind != NodeKind.OP or len({r.name for r in node.refs}) != 1 or len(node.refs) != 1:
        return None
    producer = graph.node(node.refs[0].name)
    if producer.kind != NodeKind.OP or block_of(producer) != block_of(node):
        return None
    return producer.name


def _exact_follow(
    producer: NodeStrategies, follower: NodeStrategies, producer_pick: tuple[int, ...]
) -> tuple[int, ...] | None:
    """For each producer strategy, the follower strategy that takes its output as is.

    None unless every producer strategy has one: merging a follower that would need a
    reshard for some producer strategy could hide a cheaper plan from the ILP.
    """
    by_input: dict[Spec, int] = {}
    for j, s in enumerate(follower.strategies):
        by_input.setdefault(s.inputs[0], j)
    follow = []
    for k in producer_pick:
        if producer.strategies[k].output not in by_input:
            return None
        follow.append(by_input[producer.strategies[k].output])
    return tuple(follow)


def _bucket_costs(
    graph: Graph,
    layers: BlockSharing,
    space: Mapping[str, NodeStrategies],
    pricer: Pricer,
    grouping: Grouping,
    reads: Mapping[Reader, tuple[Reader, ...]],
    once: float,
) -> list[BucketCost]:
    """The gradient buckets of each axes and dtype: the latency of each (`Pricer.bucket_line`),
    for the bytes of the gradients that parameters and their readers choose to put in them.
    ``reads``: each trained parameter (canonical name, output 0) and its canonical readers;
    its bytes count once, with its first reader, times its copies."""
    found: dict[tuple[tuple[int, ...], str], dict[tuple[int, int, int, int], float]]
    found = defaultdict(lambda: defaultdict(float))
    for (name, index), readers in reads.items():
        producer = graph.node(name)
        tensor = producer.outputs[index]
        for r, (consumer, i) in enumerate(readers):
            for kp, jp in enumerate(grouping.pick[name]):
                src = space[name].strategies[jp]
                for kc, jc in enumerate(grouping.pick[consumer]):
                    dst = space[consumer].strategies[jc]
                    grad = grad_spec(dst.inputs[i], dst.output, dst.grad)
                    sync = pricer.bucketed(producer, tensor, src, grad)
                    if sync is None:
                        continue
                    assert sync.bucket_axes is not None
                    pair = (grouping.group_of[name], kp, grouping.group_of[consumer], kc)
                    nbytes = sync.collectives[0].nbytes * layers.count(name) if r == 0 else 0
                    found[(sync.bucket_axes, sync.dtype)][pair] += nbytes
    return [
        BucketCost(
            once * pricer.bucket_line(axes)[0],
            FIRST_BUCKET_BYTES,
            BUCKET_BYTES,
            tuple((*pair, nbytes) for pair, nbytes in sorted(pairs.items())),
            whole=once == 1.0,
        )
        for (axes, _), pairs in sorted(found.items())
    ]


def build_problem(
    graph: Graph,
    layers: BlockSharing,
    space: Mapping[str, NodeStrategies],
    pricer: Pricer,
    memory_limit: float,
    once: float = 1.0,
    in_flight: float = 1.0,
) -> tuple[IntraOpProblem, Grouping]:
    """The ILP of ``graph`` over its candidate strategies ``space``, in decision groups (the
    module docstring), and how its groups decide each node. ``once`` weighs the work done
    once per step (parameters' updates and gradient synchronization) against the rest: 1
    for a whole step, 1 / microbatches for a pipeline stage's layer (`Pricer.grad_s`).
    ``in_flight`` counts the ops' activations so many times against ``memory_limit``: a
    pipeline stage keeps one set per microbatch in flight."""
    reps = [n for n in graph if n.name not in layers.canonical]
    edge_counts, shared_reads = _reads(graph, layers)
    matrices = {key: _edge_matrix(graph, space, pricer, key, once) for key in edge_counts}

    group_of: dict[str, int] = {}
    pick: dict[str, tuple[int, ...]] = {}
    roots: list[str] = []
    node_costs: list[list[float]] = []
    node_memory: list[list[float]] = []
    merged_edges: set[tuple[str, str, int]] = set()
    for node in reps:
        strategies = space[node.name].strategies
        count = layers.count(node.name)
        weight = count * (once if node.kind == NodeKind.PARAM else 1.0)
        ins = tuple(graph.tensor(r) for r in node.refs)
        gathered = param_gathered_dtype(graph, node.name) if node.kind == NodeKind.PARAM else None
        own_time = [
            (pricer.node_time(node, s) + pricer.internal_time(node, s, ins, gathered)) * weight
            for s in strategies
        ]
        copies = count * (in_flight if node.kind == NodeKind.OP else 1.0)
        own_mem = [
            (pricer.node_memory(node, s) + pricer.bucket_memory(node, s)) * copies
            for s in strategies
        ]
        producer = _follower_producer(node, graph)
        follow = (
            _exact_follow(space[producer], space[node.name], pick[producer]) if producer else None
        )
        if producer is not None and follow is not None:
            g = group_of[producer]
            for k, j in enumerate(follow):
                node_costs[g][k] += own_time[j]
                node_memory[g][k] += own_mem[j]
            group_of[node.name] = g
            pick[node.name] = follow
            merged_edges.add((producer, node.name, 0))
            continue
        group_of[node.name] = len(roots)
        pick[node.name] = tuple(range(len(strategies)))
        roots.append(node.name)
        node_costs.append(own_time)
        node_memory.append(own_mem)

    grouped: dict[tuple[int, int], list[list[float]]] = {}
    for key, n_edges in edge_counts.items():
        if key in merged_edges:
            continue
        u, v, _ = key
        gu, gv = group_of[u], group_of[v]
        matrix = matrices[key]
        rows, cols = len(node_costs[gu]), len(node_costs[gv])
        acc = grouped.setdefault((gu, gv), [[0.0] * cols for _ in range(rows)])
        for a in range(rows):
            for b in range(cols):
                acc[a][b] += matrix[pick[u][a]][pick[v][b]] * n_edges

    grouping = Grouping(group_of, pick)
    shared = [
        c
        for read, count in shared_reads.items()
        for c in _shared_costs(graph, space, pricer, grouping, read, count, once)
    ]
    param_reads: dict[Reader, set[Reader]] = defaultdict(set)
    for u, v, i in edge_counts:
        param_reads[(u, 0)].add((v, i))
    for u, index, readers in shared_reads:
        param_reads[(u, index)].update(readers)
    trained = {
        key: tuple(sorted(r for r in readers if graph.node(r[0]).kind != NodeKind.OUTPUT))
        for key, readers in param_reads.items()
        if graph.node(key[0]).kind == NodeKind.PARAM and graph.node(key[0]).needs_grad
    }
    if routing.graph_region(graph).inside:
        grouped, shared = priced_forbidden(node_costs, grouped, shared)
    problem = IntraOpProblem(
        names=tuple(roots),
        node_costs=tuple(tuple(c) for c in node_costs),
        node_memory=tuple(tuple(m) for m in node_memory),
        edges=tuple(
            Edge(gu, gv, tuple(tuple(r) for r in m)) for (gu, gv), m in sorted(grouped.items())
        ),
        memory_limit=memory_limit,
        shared=tuple(shared),
        buckets=tuple(_bucket_costs(graph, layers, space, pricer, grouping, trained, once)),
    )
    return problem, grouping


def decode(
    graph: Graph,
    layers: BlockSharing,
    space: Mapping[str, NodeStrategies],
    grouping: Grouping,
    choice: tuple[int, ...],
) -> dict[str, Strategy]:
    assignment = {}
    for node in graph:
        rep = layers.rep(node.name)
        k = grouping.pick[rep][choice[grouping.group_of[rep]]]
        assignment[node.name] = space[rep].strategies[k]
    return assignment


def solve_problem(
    graph: Graph,
    layers: BlockSharing,
    space: Mapping[str, NodeStrategies],
    problem: IntraOpProblem,
    grouping: Grouping,
    mesh_shape: tuple[int, ...],
    time_limit_s: float,
) -> IntraOpResult:
    log.info("mesh %s: %d decision groups for %d nodes", mesh_shape, problem.num_groups, len(graph))
    with timed("solve"):
        solution = solve_intra_op(problem, time_limit_s=time_limit_s)
    check = evaluate(problem, solution.choice, solution.recomputed)
    assert check.feasible, check.violations
    assignment = decode(graph, layers, space, grouping, solution.choice)
    return IntraOpResult(mesh_shape, assignment, solution, problem)


def candidate_meshes(cluster: Cluster) -> list[tuple[int, ...]]:
    """The logical meshes tried when none is pinned: the flat mesh, and 2-D meshes whose
    inner axis stays inside a node (Alpa's choice of logical views of a physical mesh)."""
    n = cluster.num_devices
    meshes: list[tuple[int, ...]] = [(n,)]
    for inner in range(2, min(cluster.devices_per_node, n // 2) + 1):
        if cluster.devices_per_node % inner == 0 and n % inner == 0:
            meshes.append((n // inner, inner))
    return meshes

"""Plain data for the intra-operator sharding problem; no torch, no fx.

A problem has one *group* per set of graph nodes that share a decision (a node, a node with
its merged followers, or the same node in every copy of a repeated layer). Group ``v`` has
``len(node_costs[v])`` candidate strategies. Costs are seconds per training step and already
multiplied by how many graph nodes the group stands for; memory is bytes per device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edge:
    """A data dependency between two groups.

    ``cost[i][j]`` is the resharding time (forward and backward) when ``src`` takes strategy
    ``i`` and ``dst`` takes strategy ``j``. ``src == dst`` is allowed (a layer's output feeding
    the same position of the next copy); then only the diagonal ``cost[i][i]`` can occur.
    """

    src: int
    dst: int
    cost: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class IntraOpProblem:
    """Choose one strategy per group to minimize node + edge costs within a memory limit."""

    names: tuple[str, ...]
    node_costs: tuple[tuple[float, ...], ...]
    node_memory: tuple[tuple[float, ...], ...]
    edges: tuple[Edge, ...]
    memory_limit: float

    def __post_init__(self) -> None:
        assert len(self.names) == len(self.node_costs) == len(self.node_memory)
        for v, (costs, mem) in enumerate(zip(self.node_costs, self.node_memory, strict=True)):
            assert len(costs) == len(mem) > 0, f"group {v} has no strategies"
        for e in self.edges:
            assert len(e.cost) == len(self.node_costs[e.src])
            assert all(len(row) == len(self.node_costs[e.dst]) for row in e.cost)

    @property
    def num_groups(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class IntraOpSolution:
    """One strategy index per group, and how the solver got there."""

    choice: tuple[int, ...]
    objective: float
    status: str  # "optimal" | "time_limit"
    solve_time_s: float
    num_variables: int
    num_constraints: int

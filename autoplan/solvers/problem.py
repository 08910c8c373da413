"""Plain data for the intra-operator sharding problem; no torch, no fx.

A problem has one *group* per set of graph nodes that share a decision (a node, a node with
its merged followers, or the same node in every copy of a repeated layer). Group ``v`` has
``len(node_costs[v])`` candidate strategies. Costs are seconds per training step and already
multiplied by how many graph nodes the group stands for; memory is bytes per device. A cost
depends on one group's strategy (node costs), on two groups' (edges), on one group's and
whether any of several others take given strategies (shared costs), or on which of several
pairs of groups take given strategies (bucket costs). A problem may also choose how many
copies of its layers recompute their forward in backward (`Recomputation`), trading time for
memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


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
class SharedCost:
    """A cost paid once however many groups incur it: ``cost[i]`` when group ``src`` takes
    strategy ``i`` and any ``(group, strategy)`` of ``when`` is chosen.

    A tensor read by several ops is redistributed once per placement they read it in: one
    shared cost per placement, ``src`` its producer, ``when`` the readers' strategies that
    read it so (`autoplan.search.intra_op`). ``src`` may be among the groups of ``when``.
    """

    src: int
    cost: tuple[float, ...]
    when: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BucketCost:
    """Buckets that the chosen pairs of ``when`` fill, at ``cost`` each: ``(g, k, h, l,
    nbytes)``, group ``g`` taking strategy ``k`` and group ``h`` strategy ``l`` (``g == h``
    with ``k == l``: one group), puts ``nbytes`` in them. One bucket if any pair is chosen,
    holding ``first`` bytes, and one more per ``capacity`` bytes past those (`count`). Where
    a step's buckets cost little (a pipeline stage's, once per step against many
    microbatches), the ILP may count those past the first in fractions (``whole=False``),
    which solves several times faster.

    DDP all-reduces gradients in buckets, each paying a collective's latency: one bucket cost
    per mesh axes, its pairs a parameter and its reader choosing a bucketed reduction along
    them (`autoplan.search.intra_op`; the bytes' own time is in the edges)."""

    cost: float
    first: float
    capacity: float
    when: tuple[tuple[int, int, int, int, float], ...]
    whole: bool = True  # the ILP counts the buckets past the first whole, or in fractions

    def count(self, nbytes: float) -> int:
        """How many buckets ``nbytes`` fill, from the chosen pairs (0 when none is)."""
        return 1 + max(0, math.ceil((nbytes - self.first) / self.capacity))


@dataclass(frozen=True)
class Recomputation:
    """Recomputing some of ``copies`` identical layers in one way (a mode): the problem
    chooses how many, ``n``. Each group's strategy ``k`` then costs ``n / copies`` of
    ``time[v][k]`` more and holds ``n / copies`` of ``freed[v][k]`` less (both are what all
    the copies recomputed would add and free). While ``n > 0`` the step holds ``held[v][k]``
    again during one copy's backward, the largest such copy of all its recomputations (a
    pipeline stage's layer, planned alone, leaves that to its stage: all zero). Those of
    one ``unit`` share its copies: a layer recomputes in one way at most."""

    name: str  # how the layers recompute (the planner's mode)
    unit: int
    copies: int
    time: tuple[tuple[float, ...], ...]
    freed: tuple[tuple[float, ...], ...]
    held: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class IntraOpProblem:
    """Choose one strategy per group (and how many layers recompute each way) to minimize
    node + edge + shared + bucket (+ recomputation) costs within a memory limit."""

    names: tuple[str, ...]
    node_costs: tuple[tuple[float, ...], ...]
    node_memory: tuple[tuple[float, ...], ...]
    edges: tuple[Edge, ...]
    memory_limit: float
    shared: tuple[SharedCost, ...] = ()
    buckets: tuple[BucketCost, ...] = ()
    recompute: tuple[Recomputation, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.names) == len(self.node_costs) == len(self.node_memory)
        for v, (costs, mem) in enumerate(zip(self.node_costs, self.node_memory, strict=True)):
            assert len(costs) == len(mem) > 0, f"group {v} has no strategies"
        for e in self.edges:
            assert len(e.cost) == len(self.node_costs[e.src])
            assert all(len(row) == len(self.node_costs[e.dst]) for row in e.cost)
        for c in self.shared:
            assert len(c.cost) == len(self.node_costs[c.src])
            assert all(0 <= k < len(self.node_costs[g]) for g, k in c.when)
        for b in self.buckets:
            assert all(
                0 <= k < len(self.node_costs[g]) and 0 <= m < len(self.node_costs[h])
                for g, k, h, m, _ in b.when
            )
        for r in self.recompute:
            shapes = [len(c) for c in self.node_costs]
            assert r.copies > 0
            assert [len(t) for t in r.time] == [len(f) for f in r.freed] == shapes
            assert [len(h) for h in r.held] == shapes

    @property
    def num_groups(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class IntraOpSolution:
    """One strategy index per group, how many copies recompute each way (one count per
    `Recomputation` of the problem), and how the solver got there."""

    choice: tuple[int, ...]
    objective: float
    status: str  # "optimal" | "time_limit"
    solve_time_s: float
    num_variables: int
    num_constraints: int
    recomputed: tuple[int, ...] = ()
    # "time_limit": the solver's relative gap when it stopped, a fraction (the optimum is at
    # least ``(1 - gap) * objective``); None where it did not say (CBC) and when optimal
    gap: float | None = None


def gap_text(gap: float | None) -> str:
    """A stopped solve's gap (`IntraOpSolution.gap`) for people: "gap <= 3.15%", rounded up
    to a hundredth of a percent so that it stays a bound, or that the solver did not say."""
    if gap is None:
        return "gap unknown"
    hundredths = max(math.ceil(round(gap * 10_000, 6)), 1)  # round: 0.0315 is 315.00000000000006
    return f"gap <= {hundredths / 100:.2f}%"


# what became of a part of the search whose ILP ran into its time limit (`Unproven`)
Outcome = Literal["stopped", "skipped"]
STOPPED: Outcome = "stopped"  # its best plan found was kept, not proven optimal
SKIPPED: Outcome = "skipped"  # it found no plan, and the search went on without that part
OUTCOMES: tuple[Outcome, ...] = (STOPPED, SKIPPED)


@dataclass(frozen=True)
class Unproven:
    """A part of the search whose ILP ran into its time limit (a mesh of a one-stage plan;
    the layers of a pipeline's configuration): the plan found may not be the fastest by as
    much as ``gap`` there, or a part skipped may have had a faster plan. Raising the time
    limit (``PlanOptions.time_limit_s``, ``--time-limit``) gives the solver longer. The plan
    lists them (`autoplan.planfile.sections.SolverInfo.unproven`)."""

    part: str  # "mesh (32, 2)"
    outcome: Outcome
    time_limit_s: float
    # stopped: the solver's relative gap, a fraction (the part's optimum is at least
    # ``1 - gap`` times its plan's ILP objective); None where it did not say, or skipped
    gap: float | None = None

    def describe(self) -> str:
        """One line for people: "mesh (32, 2): stopped at the 60 s time limit, gap <= 3.10%"."""
        limit = f"the {self.time_limit_s:g} s time limit"
        if self.outcome == SKIPPED:
            return f"{self.part}: skipped, no plan found within {limit}"
        return f"{self.part}: stopped at {limit}, {gap_text(self.gap)}"


@dataclass(frozen=True)
class Grouping:
    """Which group decides each (canonical) node, and how: node strategy = pick[node][k]."""

    group_of: dict[str, int]
    pick: dict[str, tuple[int, ...]]  # for each strategy k of the group, the node's strategy


def optimum_gap(solution: IntraOpSolution) -> float:
    """How far below its plan its problem's optimum may lie, a fraction: 0 where proven, the
    solver's gap where stopped, 1 where it did not say."""
    if solution.status == "optimal":
        return 0.0
    return 1.0 if solution.gap is None else min(solution.gap, 1.0)


def lower_bound(solution: IntraOpSolution) -> float:
    """The least objective of any plan of its problem (`optimum_gap` below its own)."""
    return (1.0 - optimum_gap(solution)) * solution.objective

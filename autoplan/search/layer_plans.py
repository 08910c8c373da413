"""Per-layer plans for the stage DP: a layer range priced as the sum of its layers' intra-op
plans, each layer's ILP solved once per structure and memory budget.

A layer range is priced by composition: each layer is planned as a stage graph of its own (the
ILP of `autoplan.search.intra_op`, memoized by structure, so identical blocks are solved once)
with the tensors between layers at the boundary placement (`autoplan.search.stage_layout`),
and a range costs the sum of its layers. The union of the layers' plans is a valid plan of the
range (the placements agree where layers meet), so a range never costs less than its ILP
would find; in exchange the DP's table costs one ILP per distinct layer instead of one per
range. A layer is planned within each memory budget (`Budget`) the search asks for: the
fastest plans within the whole memory first, then lighter ones for ranges of several layers
(within ``memory_limit / level``, ``level`` = 2, 4, ...) or for stages with many
microbatches in flight (their activations counted so many times); a budget that a looser
budget's plan already meets reuses that plan without an ILP, and a budget within which some
layers have no plan still serves the ranges of the others. Where the planner chooses
recomputation, each layer's ILP chooses it too (`autoplan.search.recompute_ilp`), counting
the activations a recomputed layer holds again during its backward at its share of a
balanced stage, which holds one layer's at a time (`RangeCost.of`). A layer's ILP weighs its
once-per-step work (parameters' updates, gradient synchronization) at 1 / microbatches of its
work per microbatch, as the stage DP amortizes it.

A time limit never loses a layer's plan: an ILP stopped at it keeps its best plan (its gap
reported, `StageSolver.unproven`); one that chose recomputation and found no plan by then is
solved again with the layer recomputed whole (the least memory; its strategies alone chosen,
a plain ILP), that plan kept as not proven the best, as a one-stage mesh is
(`autoplan.api`); a stage recomputing more layers than it needs is trimmed afterwards
(`autoplan.search.recompute_choice`). Only a layer whose plain ILP found none is skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Literal

from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import (
    SolvedStage,
    SolverStats,
    own_decisions,
    priced_stage,
    send_time,
    sent_bytes,
)
from autoplan.costmodel.pricer import Pricer
from autoplan.costmodel.step_price import price_step
from autoplan.errors import SolverTimeLimitError
from autoplan.graph.blocks import find_sharing, signature
from autoplan.graph.cut import Layer, StageGraph, stage_graph
from autoplan.graph.ir import Graph
from autoplan.graph.recompute import Recompute, recomputed_ops
from autoplan.modes import NodeKind
from autoplan.phases import timed
from autoplan.progress import Tally
from autoplan.search.mesh_plans import MeshPlan, solve_mesh
from autoplan.search.recompute_ilp import RecomputeChoice
from autoplan.search.stage_layout import boundary_assignment, pin_boundary
from autoplan.side_by_side import mapped
from autoplan.solvers.problem import SKIPPED, STOPPED, Unproven
from autoplan.strategies.placement import Spec, fitted, is_valid, replicated
from autoplan.strategies.space import NodeStrategies

log = logging.getLogger(__name__)

# what became of a layer's ILP that ran into its time limit (`StageSolver.unproven`): stopped
# with a plan, planned again recomputed whole (choosing its recomputation found none in time),
# or skipped (its plain ILP found none)
CutShort = Literal["stopped", "recomputed whole", "skipped"]
RECOMPUTED_WHOLE: CutShort = "recomputed whole"


@dataclass(frozen=True)
class LayerGraphs:
    """A step's layers, each as a stage graph of its own (`stage_graph`), and its structure:
    layers of one structure are planned once per logical mesh and boundary placement. A
    layer's key is the first layer of its structure (signatures are long tuples, slow to hash
    as often as the stage DP looks layers up)."""

    graph: Graph
    layers: tuple[Layer, ...]
    stages: tuple[StageGraph, ...]
    keys: tuple[int, ...]

    @staticmethod
    def of(graph: Graph, layers: tuple[Layer, ...]) -> LayerGraphs:
        stages = tuple(stage_graph(graph, layers, i, i + 1) for i in range(len(layers)))
        first: dict[Hashable, int] = {}
        keys = tuple(
            first.setdefault(signature(st.graph, tuple(n.name for n in st.graph), None), i)
            for i, st in enumerate(stages)
        )
        return LayerGraphs(graph, layers, stages, keys)

    @property
    def num_structures(self) -> int:
        return len(set(self.keys))


@dataclass(frozen=True)
class Budget:
    """What a layer's ILP may use: its parameters' and inputs' memory, plus ``in_flight``
    times its activations (one set per microbatch a pipeline stage holds), within
    ``memory_limit / level``."""

    level: int = 1
    in_flight: int = 1

    def bytes(self, memory_limit: float) -> float:
        return memory_limit / self.level

    def tighter(self) -> Budget:
        return Budget(2 * self.level, self.in_flight)

    def within(self, other: Budget) -> bool:
        """Whether every plan within this budget is within ``other``."""
        return other.level <= self.level and other.in_flight <= self.in_flight

    def describe(self) -> str:
        """How the progress reports it: nothing for the full budget."""
        share = f" in 1/{self.level} of the memory" * (self.level > 1)
        return share + f", {self.in_flight} microbatches in flight" * (self.in_flight > 1)


FULL_BUDGET = Budget()


@dataclass(frozen=True)
class RangeCost:
    """A layer range priced as the sum of its layers (what the DP's cost table holds)."""

    time_s: float
    extra_s: float
    memory_bytes: float
    activation_bytes: float

    @staticmethod
    def of(parts: list[SolvedStage]) -> RangeCost:
        """The layers' plans added up; one recomputed layer's activations are held at a
        time, the largest."""
        transient = max(p.recompute_bytes for p in parts)
        return RangeCost(
            time_s=sum(p.time_s for p in parts),
            extra_s=sum(p.extra_s for p in parts),
            memory_bytes=sum(p.memory_bytes - p.recompute_bytes for p in parts) + transient,
            activation_bytes=sum(p.activation_bytes for p in parts),
        )


class StageSolver:
    """Plans layers on one stage size, logical mesh and boundary placement, and prices layer
    ranges from them (module docstring): `cost` for the DP's table, `stage` for a range it
    chose."""

    def __init__(
        self,
        parts: LayerGraphs,
        cluster: Cluster,
        pricer: Pricer,
        boundary: Spec,
        num_microbatches: int,
        memory_limit: float,
        time_limit_s: float,
        tally: Tally,
        label: str,
        float32_grads: bool = False,
        recompute: RecomputeChoice | None = None,
    ) -> None:
        self.graph = parts.graph
        self.num_microbatches = num_microbatches  # the layers' ILPs amortize work over them
        self.cluster = cluster
        self.layers = parts.layers
        self.pricer = pricer
        self.boundary = boundary
        self.memory_limit = memory_limit
        self.time_limit_s = time_limit_s
        self.tally = tally  # one ILP per structure at the full budget is expected of us
        self.label = label  # what the tally reports the layers' ILPs as part of
        self.float32_grads = float32_grads  # every gradient reduced in float32
        # what each layer's ILP may recompute (else ``pricer`` say what every layer does)
        self.recompute = recompute
        layers = [(la.name, la.nodes) for la in recompute.layers] if recompute else []
        layers += [(name, ops) for name, _, ops in pricer.recompute.layers]
        self._recompute_layer = {n: name for name, nodes in layers for n in nodes}
        # (structure, budget) -> its plan
        self._memo: dict[tuple[int, Budget], SolvedStage | None] = {}
        # what the ILP counts of each plan: its parameters' and inputs', its activations'
        self._ilp_memory: dict[tuple[int, Budget], tuple[float, float]] = {}
        self._reused: set[tuple[int, Budget]] = set()  # plans of the looser budget, kept
        self._stages = parts.stages
        self._keys = parts.keys
        self._structures = sorted(set(parts.keys))  # the first layer of each structure
        self._sends: dict[int, float] = {}  # stop -> send_s(stop); the stage DP asks often
        self._ranges: dict[tuple[int, int, Budget], RangeCost | None] = {}
        # the layers' ILPs that ran into the time limit: what became of each, and its gap
        # (appended from the threads of `_plan_together`; only counted, so in any order)
        self._cut_short: list[tuple[CutShort, float | None]] = []

    def unplanned(self) -> int:
        """How many structures were never planned at the full budget (the DP never needed
        them, or an earlier layer ruled its ranges out)."""
        planned = [key for key in self._memo if key[1] == FULL_BUDGET]
        return len(self._structures) - len(planned)

    def unproven(self) -> tuple[Unproven, ...]:
        """The layers' ILPs that ran into the time limit, counted by what became of them:
        those stopped with a plan (at most the largest gap from their optimum; unknown if
        one's is), those planned again recomputed whole (a plan, its gap from the plan the
        ILP choosing recomputation would have found unknown), those skipped without one."""
        found = []
        for kind, outcome in ((STOPPED, STOPPED), (RECOMPUTED_WHOLE, STOPPED), (SKIPPED, SKIPPED)):
            gaps = [gap for cut, gap in self._cut_short if cut == kind]
            if not gaps:
                continue
            known = [g for g in gaps if g is not None]
            gap = max(known) if len(known) == len(gaps) else None
            part = f"{self.label}, {len(gaps)} layer ILP{'s' * (len(gaps) > 1)}"
            part += ", recomputed whole" * (kind == RECOMPUTED_WHOLE)
            found.append(Unproven(part, outcome, self.time_limit_s, gap))
        return tuple(found)

    def send_s(self, stop: int) -> float:
        """Sending what crosses the boundary after layer ``stop - 1`` (and gradients back)."""
        if stop not in self._sends:
            sent = sent_bytes(self._stages[stop - 1], self.pricer.mesh_shape, self.boundary)
            self._sends[stop] = send_time(self.cluster, sent)
        return self._sends[stop]

    def infeasible(self, budget: Budget) -> bool:
        """Whether no layer has a plan within ``budget`` (then no tighter budget has one
        either; ranges of the layers that have one may use it)."""
        self._plan_together(self._structures, budget)
        return all(self._memo[(i, budget)] is None for i in self._structures)

    def repeats(self, budget: Budget) -> bool:
        """Whether every layer's plan within ``budget`` is its plan within a looser one:
        those plans met ``budget`` already."""
        self._plan_together(self._structures, budget)
        return all((i, budget) in self._reused for i in self._structures)

    def cost(self, start: int, stop: int, budget: Budget) -> RangeCost | None:
        """Layers ``[start, stop)`` as the sum of their plans within ``budget``; None if a
        layer has none."""
        key = (start, stop, budget)
        if key not in self._ranges:
            self._plan_together(self._structures, budget)
            parts = [self._layer(i, budget) for i in range(start, stop)]
            done = [p for p in parts if p is not None]
            self._ranges[key] = RangeCost.of(done) if len(done) == len(parts) else None
        return self._ranges[key]

    def stage(self, start: int, stop: int, budget: Budget) -> SolvedStage:
        """The plan of layers ``[start, stop)``, the union of its layers' plans within
        ``budget``, priced whole."""
        assert self.cost(start, stop, budget) is not None, "the DP chose a range with no plan"
        stage = stage_graph(self.graph, self.layers, start, stop)
        parts = [self._renamed(i, budget) for i in range(start, stop)]
        assignment, rules = own_decisions(parts)
        output = stage.graph.nodes[-1]
        whole = replicated(len(self.pricer.mesh_shape))
        loss = tuple(whole for _ in output.refs[len(stage.sent) :])
        assignment.update(boundary_assignment(stage, self.boundary, loss))
        rules.update(dict.fromkeys(stage.received, "boundary"))
        rules[output.name] = "output"
        recomputed = Recompute.mixed(self.graph, (r for p in parts for r in p.recomputed))
        pricer = self.pricer.recomputing(recomputed)
        with timed("pricing"):
            step = price_step(stage.graph, assignment, pricer)
        solver = SolverStats.total(p.solver for p in parts)
        return priced_stage(
            start, stop, stage, assignment, step, rules, pricer, self.send_s(stop), solver
        )

    def _layer(self, i: int, budget: Budget) -> SolvedStage | None:
        self._plan_together([i], budget)
        return self._memo[(self._keys[i], budget)]

    def _plan_together(self, layers: Iterable[int], budget: Budget) -> None:
        """Plan the structures of ``layers`` not yet planned within ``budget``, their ILPs
        side by side on the machine's cores (HiGHS lets go of Python's lock while it
        solves); a structure whose plan within a looser budget meets this one keeps it."""
        todo: dict[int, int] = {}  # structure -> a layer of it
        for i in layers:
            if (self._keys[i], budget) not in self._memo:
                todo.setdefault(self._keys[i], i)
        for key in list(todo):
            if self._hopeless(key, budget):
                self._memo[(key, budget)] = None
                self._ilp_memory[(key, budget)] = (math.inf, math.inf)
                del todo[key]
                continue
            kept = self._kept_plan(key, budget)
            if kept is not None:
                self._memo[(key, budget)] = self._memo[(key, kept)]
                self._ilp_memory[(key, budget)] = self._ilp_memory[(key, kept)]
                self._reused.add((key, budget))
                del todo[key]
        if not todo:
            return
        solved = mapped(lambda i: self._solve(i, budget), todo.values())
        for (key, i), (found, memory) in zip(todo.items(), solved, strict=True):
            if budget != FULL_BUDGET:  # the full budget's were announced with the search
                self.tally.expect(1)
            self._memo[(key, budget)] = found
            self._ilp_memory[(key, budget)] = memory
            self.tally.did(f"{self.label}: layer {i}{budget.describe()}")

    def _hopeless(self, key: int, budget: Budget) -> bool:
        """Whether structure ``key`` has no plan within a looser budget than ``budget``."""
        return any(
            other == key and found is None and budget.within(looser)
            for (other, looser), found in self._memo.items()
        )

    def _kept_plan(self, key: int, budget: Budget) -> Budget | None:
        """A looser budget (every plan within ``budget`` is within it) whose plan of
        structure ``key`` meets ``budget`` by the ILP's own count: that plan is then the
        tighter ILP's optimum too."""
        for (other, looser), found in self._memo.items():
            if other != key or found is None or not budget.within(looser):
                continue
            static, active = self._ilp_memory[(key, looser)]
            if static + budget.in_flight * active <= budget.bytes(self.memory_limit):
                return looser
        return None

    def _renamed(self, i: int, budget: Budget) -> SolvedStage:
        """Layer ``i``'s plan, possibly solved on another layer of the same structure."""
        found = self._layer(i, budget)
        assert found is not None
        stage = self._stages[i]
        if found.stage is stage:
            return found
        names = (n.name for n in stage.graph)
        rename = dict(zip((n.name for n in found.stage.graph), names, strict=True))
        return replace(
            found,
            start=i,
            stop=i + 1,
            stage=stage,
            assignment={rename[k]: v for k, v in found.assignment.items()},
            rules={rename[k]: v for k, v in found.rules.items()},
            recomputed=tuple(self._renamed_layer(r, rename) for r in found.recomputed),
        )

    def _renamed_layer(
        self, layer: tuple[str, str, tuple[str, ...]], rename: dict[str, str]
    ) -> tuple[str, str, tuple[str, ...]]:
        """A recomputed layer of a plan solved on another layer of the same structure, as
        the same layer of this one."""
        ops = tuple(rename[n] for n in layer[2])
        return self._recompute_layer[ops[0]], layer[1], ops

    def _solve(self, i: int, budget: Budget) -> tuple[SolvedStage | None, tuple[float, float]]:
        """Layer ``i``'s plan within ``budget`` (None if none fits), and the memory the ILP
        counts for it."""
        stage = self._stages[i]
        graph = stage.graph
        mesh, boundary = self.pricer.mesh_shape, self.boundary
        crossing = (*stage.received, *stage.sent)
        shapes = [graph.node(n).output.shape for n in crossing]
        if not all(is_valid(fitted(boundary, shape), shape, mesh) for shape in shapes):
            return None, (math.inf, math.inf)

        def restrict(space: dict[str, NodeStrategies]) -> dict[str, NodeStrategies]:
            return pin_boundary(space, stage, boundary)

        choice = self.recompute and self.recompute.within(frozenset(stage.nodes))
        attempts = [(self.pricer, choice)]
        if choice is not None:  # the least memory, with the strategies alone chosen
            layers = [(la.name, recomputed_ops(self.graph, la)) for la in choice.layers]
            attempts.append((self.pricer.recomputing(Recompute.of(self.graph, layers)), None))
        for pricer, ways in attempts:
            try:
                found = solve_mesh(
                    graph,
                    find_sharing(graph),
                    pricer,
                    budget.bytes(self.memory_limit),
                    self.time_limit_s,
                    restrict,
                    once=1.0 / self.num_microbatches,
                    float32_grads=self.float32_grads,
                    in_flight=budget.in_flight,
                    recompute=ways,
                    # the plan within the whole memory is the fastest plan where that fits; a
                    # tighter budget is asked for only where it does not fit (`_kept_plan`)
                    relaxed_first=budget == FULL_BUDGET,
                )
            except SolverTimeLimitError:
                # a layer's ILP stops at LAYER_TIME_LIMIT_S; one choosing recomputation that
                # found no plan by then is planned again recomputed whole, as a one-stage
                # mesh is; a plain ILP without a plan leaves this budget to the others
                log.warning(
                    "layer %d on %s%s: the ILP found no plan in %g s; %s",
                    i, mesh, budget.describe(), self.time_limit_s,
                    "not planned within it" if ways is None else "planned recomputed whole",
                )  # fmt: skip
                continue
            break
        else:
            self._cut_short.append((SKIPPED, None))
            return None, (math.inf, math.inf)
        whole = ways is None and choice is not None
        log.debug(
            "layer %d on %s, boundary %s%s: %s",
            i,
            mesh,
            boundary,
            budget.describe(),
            "does not fit" if not isinstance(found, MeshPlan) else "planned",
        )
        if not isinstance(found, MeshPlan):
            return None, (math.inf, math.inf)
        solution = found.result.solution
        if whole:
            self._cut_short.append((RECOMPUTED_WHOLE, None))
        elif solution.status != "optimal":
            self._cut_short.append((STOPPED, solution.gap))
        solver = SolverStats(
            solution.solve_time_s,
            solution.num_variables,
            solution.num_constraints,
            found.result.problem.num_groups,
        )
        assignment, pricer = found.result.assignment, found.pricer
        static = sum(
            pricer.node_memory(n, assignment[n.name])
            for n in graph
            if n.kind in (NodeKind.PARAM, NodeKind.INPUT)
        )
        if self.recompute is None:  # a mode given: the ILP counts dropped activations at a share
            active = sum(
                pricer.node_memory(n, assignment[n.name]) for n in graph if n.kind == NodeKind.OP
            )
        else:  # as the price counts it: the activations held again whole, where the ILP
            # counted a stage's share of them, so that a plan kept meets the tighter budget
            static += found.step.recompute_bytes
            active = sum(
                pricer.node_memory(n, assignment[n.name])
                for n in graph
                if n.kind == NodeKind.OP and not pricer.recompute.drops(n.name)
            )
        return priced_stage(
            i, i + 1, stage, assignment, found.step, found.rules, pricer, self.send_s(i + 1),
            solver,
        ), (static, active)  # fmt: skip

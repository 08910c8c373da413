"""Per-layer plans for the stage DP: a layer range priced as the sum of its layers' intra-op
plans, each layer's ILP solved once per structure.

A layer range is priced by composition: each layer is planned as a stage graph of its own (the
ILP of `autoplan.search.intra_op`, memoized by structure, so identical blocks are solved once)
with the tensors between layers at the boundary placement (`autoplan.search.stage_layout`),
and a range costs the sum of its layers. The union of the layers' plans is a valid plan of the
range (the placements agree where layers meet), so a range never costs less than its ILP
would find; in exchange the DP's table costs one ILP per distinct layer instead of one per
range. When the fastest layer plans do not fit together, each layer is planned again within
``memory_limit / level`` for ``level`` = 2, 4, ... until the range fits. A layer's ILP weighs
its once-per-step work (parameters' updates, gradient synchronization) at 1 / microbatches of
its work per microbatch, as the stage DP amortizes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from autoplan.cluster.model import Cluster
from autoplan.graph.blocks import find_sharing, signature
from autoplan.graph.cut import Layer, StageGraph, stage_graph
from autoplan.graph.ir import Graph
from autoplan.progress import Tally
from autoplan.search.intra_op import MeshPlan, solve_mesh
from autoplan.search.pipeline_price import (
    SolvedStage,
    SolverStats,
    own_decisions,
    priced_stage,
    send_time,
    sent_bytes,
)
from autoplan.search.stage_layout import boundary_assignment, pin_boundary
from autoplan.search.step_price import price_step
from autoplan.strategies.placement import Spec, fitted, is_valid, replicated
from autoplan.strategies.pricing import Pricer
from autoplan.strategies.space import NodeStrategies

log = logging.getLogger(__name__)


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
class RangeCost:
    """A layer range priced as the sum of its layers (what the DP's cost table holds)."""

    time_s: float
    extra_s: float
    memory_bytes: float
    activation_bytes: float
    level: int  # each layer was planned within memory_limit / level


class StageSolver:
    """Plans layers on one stage size, logical mesh and boundary placement, and prices layer
    ranges from them (module docstring): `cost` for the DP's table, `stage` for a range it
    chose."""

    def __init__(
        self,
        parts: LayerGraphs,
        cluster: Cluster,
        costs: Pricer,
        boundary: Spec,
        num_microbatches: int,
        memory_limit: float,
        time_limit_s: float,
        tally: Tally,
        label: str,
        float32_grads: bool = False,
    ) -> None:
        self.graph = parts.graph
        self.num_microbatches = num_microbatches  # the layers' ILPs amortize work over them
        self.cluster = cluster
        self.layers = parts.layers
        self.costs = costs
        self.boundary = boundary
        self.memory_limit = memory_limit
        self.time_limit_s = time_limit_s
        self.tally = tally  # one ILP per structure at the full budget is expected of us
        self.label = label  # what the tally reports the layers' ILPs as part of
        self.float32_grads = float32_grads  # every gradient reduced in float32
        # (structure, mesh, boundary, level) -> its plan
        self._memo: dict[tuple[int, tuple[int, ...], Spec, int], SolvedStage | None] = {}
        self._stages = parts.stages
        self._keys = parts.keys
        self._structures = sorted(set(parts.keys))  # the first layer of each structure
        self._sends: dict[int, float] = {}  # stop -> send_s(stop); the stage DP asks often

    def unplanned(self) -> int:
        """How many structures were never planned at the full budget (the DP never needed
        them, or an earlier layer ruled its ranges out)."""
        planned = [key for key in self._memo if key[-1] == 1]
        return len(self._structures) - len(planned)

    def send_s(self, stop: int) -> float:
        """Sending what crosses the boundary after layer ``stop - 1`` (and gradients back)."""
        if stop not in self._sends:
            sent = sent_bytes(self._stages[stop - 1], self.costs.mesh_shape, self.boundary)
            self._sends[stop] = send_time(self.cluster, sent)
        return self._sends[stop]

    def cost(self, start: int, stop: int) -> RangeCost | None:
        """Layers ``[start, stop)`` as the sum of their plans within ``memory_limit / level``
        for the first level at which they fit together; None if none does."""
        level = 1
        while level <= 2 * (stop - start):
            # the full budget's plans are all asked for sooner or later: plan them together
            self._plan_together(self._structures if level == 1 else range(start, stop), level)
            parts = [self._layer(i, level) for i in range(start, stop)]
            if any(p is None for p in parts):
                return None  # a tighter budget cannot help
            done = [p for p in parts if p is not None]
            # one recomputed layer's activations at a time: the largest
            transient = max(p.recompute_bytes for p in done)
            found = RangeCost(
                time_s=sum(p.time_s for p in done),
                extra_s=sum(p.extra_s for p in done),
                memory_bytes=sum(p.memory_bytes - p.recompute_bytes for p in done) + transient,
                activation_bytes=sum(p.activation_bytes for p in done),
                level=level,
            )
            if found.memory_bytes + found.activation_bytes <= self.memory_limit:
                return found
            level *= 2
        return None

    def stage(self, start: int, stop: int) -> SolvedStage:
        """The plan of layers ``[start, stop)``: the union of its layers' plans, priced whole."""
        found = self.cost(start, stop)
        assert found is not None, "the DP chose a range it was told does not fit"
        stage = stage_graph(self.graph, self.layers, start, stop)
        parts = [self._renamed(i, found.level) for i in range(start, stop)]
        assignment, rules = own_decisions(parts)
        output = stage.graph.nodes[-1]
        whole = replicated(len(self.costs.mesh_shape))
        loss = tuple(whole for _ in output.refs[len(stage.sent) :])
        assignment.update(boundary_assignment(stage, self.boundary, loss))
        rules.update(dict.fromkeys(stage.received, "boundary"))
        rules[output.name] = "output"
        step = price_step(stage.graph, assignment, self.costs)
        solver = SolverStats.total(p.solver for p in parts)
        return priced_stage(
            start, stop, stage, assignment, step, rules, self.costs, self.send_s(stop), solver
        )

    def _layer(self, i: int, level: int) -> SolvedStage | None:
        self._plan_together([i], level)
        return self._memo[self._key(i, level)]

    def _key(self, i: int, level: int) -> tuple[int, tuple[int, ...], Spec, int]:
        return (self._keys[i], self.costs.mesh_shape, self.boundary, level)

    def _plan_together(self, layers: Iterable[int], level: int) -> None:
        """Plan the structures of ``layers`` not yet planned within ``memory_limit / level``,
        their ILPs side by side on the machine's cores (HiGHS lets go of Python's lock while
        it solves)."""
        todo: dict[tuple[int, tuple[int, ...], Spec, int], int] = {}
        for i in layers:
            todo.setdefault(self._key(i, level), i)
        todo = {key: i for key, i in todo.items() if key not in self._memo}
        if not todo:
            return
        workers = min(len(todo), os.cpu_count() or 1)
        if workers == 1:
            solved = [self._solve(i, level) for i in todo.values()]
        else:
            with ThreadPoolExecutor(workers) as pool:
                solved = list(pool.map(lambda i: self._solve(i, level), todo.values()))
        for (key, i), found in zip(todo.items(), solved, strict=True):
            if level > 1:
                self.tally.expect(1)
            self._memo[key] = found
            budget = "" if level == 1 else f" in 1/{level} of the memory"
            self.tally.did(f"{self.label}: layer {i}{budget}")

    def _renamed(self, i: int, level: int) -> SolvedStage:
        """Layer ``i``'s plan, possibly solved on another layer of the same structure."""
        found = self._layer(i, level)
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
        )

    def _solve(self, i: int, level: int) -> SolvedStage | None:
        stage = self._stages[i]
        graph = stage.graph
        mesh, boundary = self.costs.mesh_shape, self.boundary
        crossing = (*stage.received, *stage.sent)
        shapes = [graph.node(n).output.shape for n in crossing]
        if not all(is_valid(fitted(boundary, shape), shape, mesh) for shape in shapes):
            return None

        def restrict(space: dict[str, NodeStrategies]) -> dict[str, NodeStrategies]:
            return pin_boundary(space, stage, boundary)

        found = solve_mesh(
            graph,
            find_sharing(graph),
            self.costs,
            self.memory_limit / level,
            self.time_limit_s,
            restrict,
            once=1.0 / self.num_microbatches,
            float32_grads=self.float32_grads,
        )
        log.debug(
            "layer %d on %s, boundary %s, 1/%d of memory: %s",
            i,
            mesh,
            boundary,
            level,
            "does not fit" if not isinstance(found, MeshPlan) else "planned",
        )
        if not isinstance(found, MeshPlan):
            return None
        solution = found.result.solution
        solver = SolverStats(
            solution.solve_time_s,
            solution.num_variables,
            solution.num_constraints,
            found.result.problem.num_groups,
        )
        return priced_stage(
            i, i + 1, stage, found.result.assignment, found.step, found.rules, self.costs,
            self.send_s(i + 1), solver,
        )  # fmt: skip

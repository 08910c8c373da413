"""The stage DP's search over the cap ``t_max``: the optimal stage plan of a `StageProblem`
(notation of `autoplan.solvers.stage_problem`), running the dynamic program for one cap
(`autoplan.solvers.stage_dp`) for as few caps as the bound below allows.

Search over t_max (:class:`_CapSearch`)
    A cap's answer is ``F(t_max) + (B - 1) * t_max``; Alpa takes the least over every distinct
    stage time, which is what :func:`solve_stages_plain` does. ``F`` never increases with the
    cap, so every cap in ``[lo, hi]`` scores at least ``F(hi) + (B - 1) * lo``, and evaluating
    cap ``hi`` settles all of ``[t_act, hi]``, where ``t_act`` is the largest stage time of
    the plan found. :func:`solve_stages` first gallops up from a device-count lower bound
    (:func:`_device_lower_bound`) to a feasible cap, then pops intervals of caps from a heap
    by that bound, evaluates each at its top, clipped to ``best / (B - 1)`` (Alpa's break), and
    pushes back the unsettled ``[lo, t_act)`` in two halves; it stops when the smallest bound
    exceeds the best total. It returns the same plan as the plain search.

Cost: ``O(L^2 K)`` calls of ``cost`` (each once, `autoplan.solvers.stage_tables.build_tables`),
and per cap the dynamic program's (`autoplan.solvers.stage_dp`). Costs are seconds; memory is
bytes per device.
"""

from __future__ import annotations

import heapq
import logging
import math

import numpy as np

from autoplan.solvers.stage_dp import CappedDP, CappedPlan, device_windows
from autoplan.solvers.stage_problem import (
    InfeasibleStagesError,
    StagePlan,
    StageProblem,
    StageSolution,
    pipeline_time,
)
from autoplan.solvers.stage_tables import StageTables, build_tables
from autoplan.units import fmt_bytes

logger = logging.getLogger(__name__)

# Relative slack when comparing a bound to the best total, for float rounding.
_BOUND_RTOL = 1e-9


def solve_stages(problem: StageProblem) -> StageSolution:
    """The optimal stage plan, evaluating only caps whose bound can beat the best total.

    Raises :class:`InfeasibleStagesError` when no plan fits in ``problem.memory_limit``.
    """
    tables = build_tables(problem)
    solver = _CapSearch(tables, problem.num_microbatches)
    solver.run_pruned()
    return solver.solution(problem)


def solve_stages_plain(problem: StageProblem) -> StageSolution:
    """The same optimum as :func:`solve_stages`, evaluating every distinct stage time as cap."""
    tables = build_tables(problem)
    solver = _CapSearch(tables, problem.num_microbatches)
    for cap in tables.candidate_caps():
        solver.evaluate(float(cap))
    return solver.solution(problem)


class _CapSearch:
    """Runs the capped DP for caps (each once) and keeps the best plan by total, then fewer
    stages, then smaller ``(stop, m)`` pairs in stage order."""

    def __init__(self, tables: StageTables, num_microbatches: int) -> None:
        self.tables = tables
        self.num_microbatches = num_microbatches
        self.best: tuple[float, int, tuple[tuple[int, int], ...]] | None = None
        self.best_plan: CappedPlan | None = None
        self.evaluated: dict[float, CappedPlan | None] = {}
        # The DP's F(cap) depends only on which stage times are <= cap; without sends those
        # are the stage times, so caps snap down to one of them.
        self.stage_times = None if tables.send is not None else tables.stage_times()

    @property
    def best_total(self) -> float:
        return math.inf if self.best is None else self.best[0]

    def evaluate(self, cap: float) -> CappedPlan | None:
        if cap in self.evaluated:
            return self.evaluated[cap]
        plan = self.evaluated[cap] = CappedDP(self.tables, cap).solve()
        logger.debug("stage DP: t_max %.6g s -> %s", cap, "none" if plan is None else plan.total)
        if plan is not None:
            total = pipeline_time(plan.times, self.num_microbatches)
            moves = tuple((stop, m) for _, stop, m in plan.stages)
            key = (total, len(plan.stages), moves)
            if self.best is None or key < self.best:
                self.best, self.best_plan = key, plan
        return plan

    def run_pruned(self) -> None:
        """Best-first search over intervals of caps (module docstring)."""
        lo, cap, first = self._first_feasible()
        if first is None:
            return
        heap: list[tuple[float, float, float, float]] = []  # (bound, lo, hi, F lower bound)
        self._push_below(heap, lo, first)
        self._push(heap, float(np.nextafter(cap, math.inf)), math.inf, 0.0)
        while heap:
            bound, lo, hi, _ = heapq.heappop(heap)
            if bound > self._prune_level():
                break
            cap = self._snap_down(min(hi, self._alpa_cap()))
            if cap < lo:
                continue
            plan = self.evaluate(cap)
            if plan is not None and plan.max_time >= lo:
                self._push_below(heap, lo, plan)

    def _first_feasible(self) -> tuple[float, float, CappedPlan | None]:
        """Gallop up from the device lower bound to the first cap with a plan.

        Returns ``lo`` (no cap below it has a plan), that cap and its plan."""
        caps = self.tables.stage_times()
        lo = _device_lower_bound(self.tables, caps)
        caps = caps[caps >= lo]
        if self.tables.send is not None:
            caps = np.append(caps, math.inf)  # sends may push every stage time past all T
        index, step = 0, 1
        while index < len(caps):
            cap = float(caps[index])
            plan = self.evaluate(cap)
            if plan is not None:
                return lo, cap, plan
            lo = float(np.nextafter(cap, math.inf))
            if index == len(caps) - 1:
                break
            index, step = min(index + step, len(caps) - 1), step * 2
        return lo, math.inf, None

    def _push_below(
        self, heap: list[tuple[float, float, float, float]], lo: float, plan: CappedPlan
    ) -> None:
        """Queue ``[lo, t_act)`` in two halves; every cap there has ``F >= plan.total``."""
        hi = float(np.nextafter(plan.max_time, -math.inf))
        if lo > hi:
            return
        mid = self._split_point(lo, hi)
        if mid is None or self.num_microbatches == 1:
            self._push(heap, lo, hi, plan.total)
        else:
            self._push(heap, lo, mid, plan.total)
            self._push(heap, float(np.nextafter(mid, math.inf)), hi, plan.total)

    def _push(
        self, heap: list[tuple[float, float, float, float]], lo: float, hi: float, f_lower: float
    ) -> None:
        lo = max(lo, 0.0)
        bound = f_lower + (self.num_microbatches - 1) * lo
        heapq.heappush(heap, (bound, lo, hi, f_lower))

    def _split_point(self, lo: float, hi: float) -> float | None:
        """A cap between ``lo`` and ``hi`` (a stage time without sends); None if none fits."""
        if self.stage_times is None:
            mid = lo + (hi - lo) / 2 if math.isfinite(hi) else None
            return mid if mid is not None and lo <= mid < hi else None
        first = int(np.searchsorted(self.stage_times, lo, side="left"))
        last = int(np.searchsorted(self.stage_times, hi, side="right"))
        if last - first < 2:
            return None
        return float(self.stage_times[(first + last) // 2 - 1])

    def _snap_down(self, cap: float) -> float:
        if self.stage_times is None:
            return cap
        index = int(np.searchsorted(self.stage_times, cap, side="right")) - 1
        return float(self.stage_times[index]) if index >= 0 else -math.inf

    def _alpa_cap(self) -> float:
        """No plan with a larger stage time can beat the best total (Alpa's break)."""
        if self.num_microbatches == 1:
            return math.inf
        return self._prune_level() / (self.num_microbatches - 1)

    def _prune_level(self) -> float:
        return self.best_total * (1 + _BOUND_RTOL)

    def solution(self, problem: StageProblem) -> StageSolution:
        if self.best_plan is None:
            raise _infeasible_error(self.tables)
        plan = self.best_plan
        num_stages = len(plan.stages)
        stages = tuple(
            StagePlan(
                start=k,
                stop=j,
                submesh=self.tables.submeshes[m],
                time_s=t,
                memory_bytes=float(
                    self.tables.memory[k, j, m] + (num_stages - s) * self.tables.activation[k, j, m]
                ),
                variant=m % self.tables.variants,
            )
            for s, ((k, j, m), t) in enumerate(zip(plan.stages, plan.times, strict=True))
        )
        solution = StageSolution(
            stages=stages,
            objective=pipeline_time(plan.times, problem.num_microbatches),
            max_stage_time=plan.max_time,
            num_microbatches=problem.num_microbatches,
            evaluated_t_max=len(self.evaluated),
        )
        logger.debug(
            "stage DP: %d stages, %.6g s per step after %d caps",
            num_stages,
            solution.objective,
            len(self.evaluated),
        )
        return solution


def _device_lower_bound(tables: StageTables, caps: np.ndarray) -> float:
    """The smallest cap at which the stages fitting under it could cover all layers with at
    most ``D`` devices (memory and the exact device count relaxed); binary search over caps."""
    usable = tables.max_left >= 1
    first, last = 0, len(caps) - 1
    while first < last:
        middle = (first + last) // 2
        live = usable & (tables.time <= caps[middle])
        if device_windows(live, tables.sizes, tables.num_devices)[0, 0] <= tables.num_devices:
            last = middle
        else:
            first = middle + 1
    return float(caps[first]) if len(caps) else math.inf


def _infeasible_error(tables: StageTables) -> InfeasibleStagesError:
    limit = tables.memory_limit
    seen = tables.min_memory_seen
    smallest = (
        f"the smallest per-stage memory seen (one microbatch in flight) is {seen:.6g} bytes "
        f"({fmt_bytes(seen)})"
        if math.isfinite(seen)
        else "the cost function reported no feasible stage"
    )
    return InfeasibleStagesError(
        f"no pipeline stage plan fits in memory_limit={limit:.6g} bytes "
        f"({fmt_bytes(limit)}) per device; {smallest}; raise the memory limit or give "
        "the stages more devices"
    )

"""Inter-operator stage DP on hand-built cost tables with hand-computed optima, a brute-force
cross-check on small random problems, and a timing guard at 96 layers x 1024 devices."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from autoplan.errors import AutoplanError, InfeasiblePlanError
from autoplan.solvers.stage_problem import (
    InfeasibleStagesError,
    SendTimeFn,
    StageCost,
    StageProblem,
    StageSolution,
    Submesh,
    pipeline_time,
    submesh_choices,
)
from autoplan.solvers.stages import solve_stages, solve_stages_plain

ONE = Submesh(1, 1)
TWO = Submesh(1, 2)
INFEASIBLE = StageCost(0.0, 0.0, feasible=False)

CostTable = dict[tuple[int, int, Submesh], StageCost]


def table_cost(table: CostTable) -> Callable[[int, int, Submesh], StageCost]:
    """A cost function over a table; stages missing from it are infeasible."""
    return lambda i, j, submesh: table.get((i, j, submesh), INFEASIBLE)


def two_layer_problem(
    table: CostTable,
    num_microbatches: int = 4,
    memory_limit: float = math.inf,
    send_time: SendTimeFn | None = None,
) -> StageProblem:
    """2 layers on 1 node x 2 devices: one stage on (1, 2), or two stages on (1, 1) each."""
    return StageProblem(2, 1, 2, num_microbatches, memory_limit, table_cost(table), send_time)


# One stage [0, 2) on (1, 2) takes 3 s; [0, 1) and [1, 2) on (1, 1) take 2 s each.
BASE: CostTable = {
    (0, 2, TWO): StageCost(3.0, 5.0, True, 3.0),
    (0, 1, ONE): StageCost(2.0, 4.0, True, 3.0),
    (1, 2, ONE): StageCost(2.0, 4.0, True, 3.0),
}


def layout(solution: StageSolution) -> list[tuple[int, int, Submesh]]:
    return [(s.start, s.stop, s.submesh) for s in solution.stages]


def check_solution(problem: StageProblem, solution: StageSolution) -> None:
    """Recompute everything about ``solution`` from the problem's callables."""
    stages = solution.stages
    assert stages[0].start == 0 and stages[-1].stop == problem.num_layers
    assert all(a.stop == b.start and a.start < a.stop for a, b in itertools.pairwise(stages))
    assert sum(s.submesh.num_devices for s in stages) == problem.num_devices
    allowed = submesh_choices(problem.num_nodes, problem.devices_per_node)
    times = []
    for s, stage in enumerate(stages):
        assert stage.submesh in allowed
        cost = problem.cost(stage.start, stage.stop, stage.submesh)
        memory = cost.memory_bytes + (len(stages) - s) * cost.activation_bytes
        assert cost.feasible and memory <= problem.memory_limit
        assert stage.memory_bytes == pytest.approx(memory)
        t = cost.time_s
        if problem.send_time is not None and s + 1 < len(stages):
            t += problem.send_time(stage.stop, stage.submesh, stages[s + 1].submesh)
        assert stage.time_s == pytest.approx(t)
        times.append(t)
    assert solution.max_stage_time == pytest.approx(max(times))
    assert solution.objective == pytest.approx(pipeline_time(times, problem.num_microbatches))


# ---------------------------------------------------------------- hand-built tables


def test_submesh_choices() -> None:
    assert submesh_choices(3, 8) == (
        Submesh(1, 1),
        Submesh(1, 2),
        Submesh(1, 4),
        Submesh(1, 8),
        Submesh(2, 8),
        Submesh(3, 8),
    )
    # M not a power of two: (1, M) itself joins the powers of two below it.
    assert [s.num_devices for s in submesh_choices(2, 6)] == [1, 2, 4, 6, 12]
    assert submesh_choices(1, 1) == (Submesh(1, 1),)


def test_two_stages_beat_one_with_many_microbatches() -> None:
    # B = 4. One stage on (1, 2): 3 + 3 * 3 = 12 s. Two stages on (1, 1): (2 + 2) + 3 * 2 = 10 s.
    problem = two_layer_problem(BASE)
    solution = solve_stages(problem)
    assert layout(solution) == [(0, 1, ONE), (1, 2, ONE)]
    assert solution.objective == pytest.approx(10.0)
    assert solution.max_stage_time == pytest.approx(2.0)
    assert solution.num_microbatches == 4
    # In-flight microbatches under 1F1B: stage 0 keeps 2, stage 1 keeps 1 (act = 3 bytes).
    assert [s.memory_bytes for s in solution.stages] == [4.0 + 2 * 3.0, 4.0 + 1 * 3.0]
    check_solution(problem, solution)


def test_one_stage_wins_with_one_microbatch() -> None:
    # B = 1: the step is the sum of stage times: one stage 3 s, two stages 2 + 2 = 4 s.
    solution = solve_stages(two_layer_problem(BASE, num_microbatches=1))
    assert layout(solution) == [(0, 2, TWO)]
    assert solution.objective == pytest.approx(3.0)


def test_tie_prefers_fewer_stages() -> None:
    # B = 1: one stage of 2 s and two stages of 1 s each both take 2 s.
    table = {
        (0, 2, TWO): StageCost(2.0, 0.0),
        (0, 1, ONE): StageCost(1.0, 0.0),
        (1, 2, ONE): StageCost(1.0, 0.0),
    }
    for solve in (solve_stages, solve_stages_plain):
        solution = solve(two_layer_problem(table, num_microbatches=1))
        assert layout(solution) == [(0, 2, TWO)]
        assert solution.objective == 2.0


def test_in_flight_activations_rule_out_the_split() -> None:
    # Limit 8 bytes. Two stages: stage 0 keeps 2 microbatches, 4 + 2 * 3 = 10 > 8 (stage 1,
    # with 1 in flight, would fit: 4 + 3 = 7). One stage: 5 + 1 * 3 = 8 <= 8 fits, so the
    # 12 s one-stage plan beats the 10 s split that does not fit.
    problem = two_layer_problem(BASE, memory_limit=8.0)
    solution = solve_stages(problem)
    assert layout(solution) == [(0, 2, TWO)]
    assert solution.objective == pytest.approx(12.0)
    assert solution.stages[0].memory_bytes == 8.0
    check_solution(problem, solution)


def test_in_flight_count_depends_on_position() -> None:
    # Limit 9 bytes. Stage [0, 1) holds 2 microbatches: 3 + 2 * 3 = 9 fits; stage [1, 2) holds
    # 1: 6 + 3 = 9 fits. Swapping the memories (6 first) would need 6 + 2 * 3 = 12 > 9.
    table = dict(BASE)
    table[0, 1, ONE] = StageCost(2.0, 3.0, True, 3.0)
    table[1, 2, ONE] = StageCost(2.0, 6.0, True, 3.0)
    assert layout(solve_stages(two_layer_problem(table, memory_limit=9.0))) == [
        (0, 1, ONE),
        (1, 2, ONE),
    ]
    table[0, 1, ONE], table[1, 2, ONE] = table[1, 2, ONE], table[0, 1, ONE]
    assert layout(solve_stages(two_layer_problem(table, memory_limit=9.0))) == [(0, 2, TWO)]


def test_nothing_fits_names_limit_and_smallest_memory() -> None:
    # Limit 6 bytes; the smallest memory + one microbatch of activations is 4 + 3 = 7 bytes.
    for solve in (solve_stages, solve_stages_plain):
        with pytest.raises(InfeasibleStagesError) as info:
            solve(two_layer_problem(BASE, memory_limit=6.0))
        assert "memory_limit=6 bytes" in str(info.value)
        assert "is 7 bytes" in str(info.value)
    assert issubclass(InfeasibleStagesError, InfeasiblePlanError)
    assert issubclass(InfeasibleStagesError, ValueError)


def test_no_feasible_stage_at_all() -> None:
    with pytest.raises(InfeasibleStagesError, match="no feasible stage"):
        solve_stages(two_layer_problem({}))


def test_large_send_time_favors_one_stage() -> None:
    # B = 4, send from stage 0 to stage 1 takes 1.5 s, so t_0 = 2 + 1.5 = 3.5 s and the split
    # takes (3.5 + 2) + 3 * 3.5 = 16 s, worse than one stage: 3 + 3 * 3 = 12 s.
    problem = two_layer_problem(BASE, send_time=lambda j, a, b: 1.5)
    for solve in (solve_stages, solve_stages_plain):
        solution = solve(problem)
        assert layout(solution) == [(0, 2, TWO)]
        assert solution.objective == pytest.approx(12.0)


def test_small_send_time_is_charged_to_the_sender() -> None:
    # Send 0.25 s: t_0 = 2.25, t_1 = 2; (2.25 + 2) + 3 * 2.25 = 11 s < 12 s.
    problem = two_layer_problem(BASE, send_time=lambda j, a, b: 0.25)
    solution = solve_stages(problem)
    assert layout(solution) == [(0, 1, ONE), (1, 2, ONE)]
    assert [s.time_s for s in solution.stages] == [2.25, 2.0]
    assert solution.objective == pytest.approx(11.0)
    check_solution(problem, solution)


def test_bad_inputs_raise() -> None:
    with pytest.raises(AutoplanError, match="num_layers=0"):
        StageProblem(0, 1, 2, 4, math.inf, table_cost(BASE))
    with pytest.raises(AutoplanError, match="memory_limit"):
        StageProblem(2, 1, 2, 4, 0.0, table_cost(BASE))
    negative = dict(BASE)
    negative[0, 2, TWO] = StageCost(-1.0, 0.0)
    with pytest.raises(AutoplanError, match=r"time_s = -1\.0"):
        solve_stages(two_layer_problem(negative))


# ---------------------------------------------------------------- brute force


def brute_force(problem: StageProblem) -> float | None:
    """The least objective over every contiguous partition and every submesh assignment that
    uses exactly all devices, scored by the formula; None if nothing fits."""
    num_layers = problem.num_layers
    submeshes = submesh_choices(problem.num_nodes, problem.devices_per_node)
    best = None
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), num_layers]
        num_stages = len(bounds) - 1
        for meshes in itertools.product(submeshes, repeat=num_stages):
            if sum(m.num_devices for m in meshes) != problem.num_devices:
                continue
            times = []
            for s in range(num_stages):
                cost = problem.cost(bounds[s], bounds[s + 1], meshes[s])
                in_flight = num_stages - s
                memory = cost.memory_bytes + in_flight * cost.activation_bytes
                if not cost.feasible or memory > problem.memory_limit:
                    break
                t = cost.time_s
                if problem.send_time is not None and s + 1 < num_stages:
                    t += problem.send_time(bounds[s + 1], meshes[s], meshes[s + 1])
                times.append(t)
            else:
                total = pipeline_time(times, problem.num_microbatches)
                best = total if best is None else min(best, total)
    return best


def random_problem(seed: int) -> StageProblem:
    """At most 5 layers on at most 4 devices; about 10% of stages infeasible, memory that
    binds often, sends on half of the problems."""
    rng = np.random.RandomState(seed)
    num_layers = int(rng.randint(1, 6))
    num_nodes, devices_per_node = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (4, 1)][
        rng.randint(7)
    ]
    num_microbatches = int(rng.randint(1, 9))
    memory_limit = [math.inf, 6.0, 8.0][rng.randint(3)]
    submeshes = submesh_choices(num_nodes, devices_per_node)
    table = {}
    for i in range(num_layers):
        for j in range(i + 1, num_layers + 1):
            for mesh in submeshes:
                # Integer times on some problems, to exercise ties.
                t = rng.uniform(0.1, 1.0) * (j - i) / mesh.num_devices**0.7
                t = float(round(4 * t)) if seed % 3 == 0 else float(t)
                mem, act = float(rng.uniform(0, 6)), float(rng.uniform(0, 2))
                table[i, j, mesh] = StageCost(t, mem, bool(rng.rand() > 0.1), act)
    sends = {
        (j, a, b): float(rng.uniform(0, 0.3))
        for j in range(1, num_layers)
        for a in submeshes
        for b in submeshes
    }
    send_time = (lambda j, a, b: sends[j, a, b]) if rng.rand() < 0.5 else None
    return StageProblem(
        num_layers,
        num_nodes,
        devices_per_node,
        num_microbatches,
        memory_limit,
        table_cost(table),
        send_time,
    )


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed: int) -> None:
    problem = random_problem(seed)
    expected = brute_force(problem)
    if expected is None:
        for solve in (solve_stages, solve_stages_plain):
            with pytest.raises(InfeasibleStagesError):
                solve(problem)
        return
    pruned, plain = solve_stages(problem), solve_stages_plain(problem)
    assert pruned.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert plain.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert pruned.stages == plain.stages
    check_solution(problem, pruned)


def test_pruned_agrees_with_plain_on_a_larger_problem() -> None:
    rng = np.random.RandomState(7)
    work = rng.uniform(0.5, 1.5, size=8)

    def cost(i: int, j: int, mesh: Submesh) -> StageCost:
        d = mesh.num_devices
        t = work[i:j].sum() / d + 0.05 * (j - i) * math.log2(d) + 0.2 * (mesh.num_nodes > 1)
        return StageCost(float(t), 2.0 * (j - i) / d, True, (j - i) / d)

    for send_time in (None, lambda j, a, b: 0.02 * (1 + (a.num_nodes > 1) + (b.num_nodes > 1))):
        problem = StageProblem(8, 2, 4, 16, 6.0, cost, send_time)
        pruned, plain = solve_stages(problem), solve_stages_plain(problem)
        assert pruned.stages == plain.stages
        assert pruned.objective == plain.objective
        assert pruned.evaluated_t_max < plain.evaluated_t_max
        check_solution(problem, pruned)


# ---------------------------------------------------------------- memoization and scale


def test_cost_called_at_most_once_per_stage() -> None:
    calls: Counter[tuple[int, int, Submesh]] = Counter()
    sends: Counter[tuple[int, Submesh, Submesh]] = Counter()
    rng = np.random.RandomState(3)
    times = rng.uniform(0.5, 1.5, size=(7, 8, 4))

    def cost(i: int, j: int, mesh: Submesh) -> StageCost:
        calls[i, j, mesh] += 1
        m = submesh_choices(2, 4).index(mesh)
        return StageCost(float(times[i, j, m]) * (j - i) / mesh.num_devices, 1.0, True, 1.0)

    def send_time(j: int, a: Submesh, b: Submesh) -> float:
        sends[j, a, b] += 1
        return 0.1

    for send in (None, send_time):
        calls.clear()
        solution = solve_stages(StageProblem(7, 2, 4, 8, 5.0, cost, send))
        assert solution.evaluated_t_max > 1
        assert max(calls.values()) == 1
        assert len(calls) <= 7 * 8 // 2 * len(submesh_choices(2, 4))
    assert max(sends.values()) == 1


@pytest.mark.slow
def test_96_layers_on_1024_devices() -> None:
    """Guard, not a benchmark: the biggest problem the planner is meant for stays fast."""
    num_layers, num_nodes, devices_per_node = 96, 128, 8
    work = np.concatenate([[0.0], np.cumsum(np.random.RandomState(0).uniform(0.5, 1.5, 96))])

    def cost(i: int, j: int, mesh: Submesh) -> StageCost:
        d = mesh.num_devices
        # Compute splits over devices; collectives cost more on more devices and across nodes.
        comm = 0.002 * (j - i) * math.log2(d) + 0.01 * (j - i) * (mesh.num_nodes > 1)
        t = (work[j] - work[i]) / d + comm + 0.001
        return StageCost(float(t), 1e9 * (j - i) / d, True, 1e8 * (j - i) / d)

    # 4e8 bytes per device makes the in-flight activations bind for the early stages.
    problem = StageProblem(num_layers, num_nodes, devices_per_node, 64, 4e8, cost)
    start = time.perf_counter()
    solution = solve_stages(problem)
    elapsed = time.perf_counter() - start
    assert elapsed < 60.0, f"stage DP took {elapsed:.1f} s"
    check_solution(problem, solution)
    assert 1 < len(solution.stages) < num_layers


def test_each_stage_takes_the_fastest_variant_that_fits_its_microbatches_in_flight() -> None:
    # two layers on two devices, one stage each; each stage comes as variant 0 (fast, heavy in
    # activations) or 1 (slower, light: recomputed). Under 1F1B the first stage holds two
    # microbatches in flight, the second one: 4 + 2 * 3 > 9 rules variant 0 out for the first
    # stage only.
    fast, light = StageCost(2.0, 4.0, True, 3.0), StageCost(2.5, 4.0, True, 1.0)

    def cost(i: int, j: int, submesh: Submesh) -> tuple[StageCost, StageCost]:
        return (fast, light) if submesh == ONE and j == i + 1 else (INFEASIBLE, INFEASIBLE)

    for solve in (solve_stages, solve_stages_plain):
        problem = StageProblem(2, 1, 2, 4, 9.0, cost, variants=2)
        solution = solve(problem)
        assert [(s.start, s.variant) for s in solution.stages] == [(0, 1), (1, 0)]
        assert solution.objective == pytest.approx(2.5 + 2.0 + 3 * 2.5)
        assert [s.memory_bytes for s in solution.stages] == [4.0 + 2 * 1.0, 4.0 + 3.0]
    unlimited = solve_stages(StageProblem(2, 1, 2, 4, math.inf, cost, variants=2))
    assert [s.variant for s in unlimited.stages] == [0, 0]
    with pytest.raises(AutoplanError, match=r"gave 2 cost\(s\); the problem has 3 variant"):
        solve_stages(StageProblem(2, 1, 2, 4, 9.0, cost, variants=3))

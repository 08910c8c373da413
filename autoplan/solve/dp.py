"""Inter-operator stage partitioning: Alpa's dynamic program over layers, devices and t_max.

Notation: layers ``0..L-1``; a cluster of ``N`` nodes x ``M`` devices, ``D = N * M``; ``B``
microbatches; memory limit ``mem_max`` bytes per device. Submesh choices ``m``
(:func:`submesh_choices`, smallest first): ``(1, 1), (1, 2), (1, 4), ..., (1, M)`` and
``(n, M)`` for ``n = 2..N``, ``K`` of them; ``|m|`` is a submesh's device count. A stage runs
layers ``[k, j)`` on submesh ``m``; ``cost(k, j, m)`` gives its time ``T[k, j, m]`` (one
microbatch, forward + backward), memory ``mem[k, j, m]`` and the activation memory of one
in-flight microbatch ``act[k, j, m]``, per device. ``send(j, a, b)`` is the time to send the
activations at boundary ``j`` from a stage on ``a`` to the next stage, on ``b`` (0 without
``send_time``).

Plan and objective (:func:`pipeline_time`)
    Stages ``s = 0..S-1`` cover the layers contiguously and in order, and their submeshes use
    exactly ``D`` devices: ``sum_s |m_s| == D`` (Alpa's constraint). Stage ``s`` takes
    ``t_s = T[s] + send(stop_s, m_s, m_(s+1))`` (the send is the sender's; none after the last
    stage) and a 1F1B step takes ``sum_s t_s + (B - 1) * max_s t_s``.

Memory (:func:`_max_stages_left`)
    Under 1F1B stage ``s`` keeps ``S - s`` microbatches in flight: ``mem + (S - s) * act <=
    mem_max``. With ``R[k, j, m]`` the largest ``r`` such that ``mem + r * act <= mem_max``
    this reads ``S - s <= R``; ``R = 0`` marks a stage that never fits or that ``cost``
    reports infeasible.

Dynamic program for one cap ``t_max`` (:class:`_CappedDP`)
    ``H(r, k, d)``: the least ``sum t_s`` over plans for layers ``k..L-1`` on exactly ``d``
    devices with at most ``r`` stages, every ``t_s <= t_max``, every stage within memory for
    its real count of stages left. Counting stages *remaining* makes the memory check exact:
    ``H(r, L, 0) = 0``, ``H(0, k < L, d) = inf`` and (:meth:`_CappedDP._fill_rows`)

        ``H(r, k, d) = min_(j, m) T[k, j, m] + H(min(r, R[k, j, m]) - 1, j, d - |m|)``

    over stages with ``T[k, j, m] <= t_max``. The answer ``F(t_max)`` is ``H(L, 0, D)``.
    ``H(r, k, .)`` equals ``H(c_k, k, .)`` for ``r >= c_k = min(L - k, max R from k)``, so
    levels are capped (:meth:`_CappedDP._next_levels`) and only those the top state reaches
    are computed (:meth:`_CappedDP._needed_levels`): one per layer when memory never binds.
    Where the plan of a higher level at the same ``k`` has at most ``r`` stages it is also
    the plan of level ``r`` and is copied (:meth:`_CappedDP._copy_unconstrained`). With sends
    the state also holds the submesh ``a`` of the stage starting at ``k``:

        ``G(r, k, a, d) = min_(j, b) T[k, j, a] + send(j, a, b) + G(r', j, b, d - |a|)``

    with ``T[k, j, a] + send(j, a, b) <= t_max``, ``r' = min(r, R[k, j, a]) - 1``, and the
    answer is ``min_a G(L, 0, a, D)``. Device counts are limited to the window
    ``[devmin(k..L), D - devmin(0..k)]`` (:func:`_device_windows`: the fewest devices that
    capped stages need for the layers after and before ``k``), and a stage is tried only if
    it can join two windows (:meth:`_CappedDP._fits_between_windows`). Ties go to fewer
    stages, then to lexicographically smaller ``(stop, m)`` stage by stage
    (:meth:`_CappedDP._relax`), so a problem always gives the same plan.

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

Cost: ``O(L^2 K)`` calls of ``cost`` (each once), and per cap ``O(L^2 K W)`` element
operations per level, ``W <= D + 1`` the window width; with sends ``K`` times more. Costs
are seconds; memory is bytes per device.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from autoplan.errors import AutoplanError, InfeasiblePlanError

logger = logging.getLogger(__name__)

GIB = float(2**30)
# Larger than any device count, small enough that sums of two never overflow int64.
_NO_DEVICES = 2**40
# Elements of one (candidates x devices) block in the DP; bounds the memory of one step.
_BLOCK_ELEMENTS = 1 << 20
# Relative slack when comparing a bound to the best total, for float rounding.
_BOUND_RTOL = 1e-9


class InfeasibleStagesError(InfeasiblePlanError):
    """No partition into stages fits in device memory (a ValueError)."""


@dataclass(frozen=True)
class Submesh:
    """``num_nodes`` nodes x ``devices_per_node`` devices of each."""

    num_nodes: int
    devices_per_node: int

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class StageCost:
    """Layers ``[i, j)`` as one stage on a submesh with its best logical mesh.

    ``time_s``: one microbatch through the stage, forward + backward. ``memory_bytes``: per
    device, without in-flight activations; ``activation_bytes``: per device, for each
    microbatch in flight.
    """

    time_s: float
    memory_bytes: float
    feasible: bool = True
    activation_bytes: float = 0.0


StageCostFn = Callable[[int, int, Submesh], StageCost]
SendTimeFn = Callable[[int, Submesh, Submesh], float]


@dataclass(frozen=True)
class StageProblem:
    """Split ``num_layers`` layers into pipeline stages on a ``num_nodes x devices_per_node``
    cluster. ``cost(i, j, submesh)`` costs layers ``[i, j)``; ``send_time(j, a, b)`` is the
    time to send the activations at boundary ``j`` from a stage on ``a`` to one on ``b``."""

    num_layers: int
    num_nodes: int
    devices_per_node: int
    num_microbatches: int
    memory_limit: float
    cost: StageCostFn = field(repr=False)
    send_time: SendTimeFn | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_nodes", "devices_per_node", "num_microbatches"):
            value = getattr(self, name)
            if value < 1:
                raise AutoplanError(f"StageProblem.{name}={value}; it must be at least 1")
        if not self.memory_limit > 0:
            raise AutoplanError(f"StageProblem.memory_limit={self.memory_limit}; must be > 0")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class StagePlan:
    """Layers ``[start, stop)`` on ``submesh``. ``time_s`` includes the send to the next stage;
    ``memory_bytes`` includes the activations of the microbatches in flight under 1F1B."""

    start: int
    stop: int
    submesh: Submesh
    time_s: float
    memory_bytes: float


@dataclass(frozen=True)
class StageSolution:
    """The stages in order; ``objective = sum(time_s) + (B - 1) * max_stage_time`` seconds.
    ``evaluated_t_max`` counts the caps the dynamic program was run for."""

    stages: tuple[StagePlan, ...]
    objective: float
    max_stage_time: float
    num_microbatches: int
    evaluated_t_max: int


def submesh_choices(num_nodes: int, devices_per_node: int) -> tuple[Submesh, ...]:
    """Alpa's submesh shapes, smallest first: ``(1, 2^i)`` up to ``(1, M)``, then ``(n, M)``."""
    widths = []
    width = 1
    while width < devices_per_node:
        widths.append(width)
        width *= 2
    widths.append(devices_per_node)
    one_node = [Submesh(1, w) for w in widths]
    return (*one_node, *(Submesh(n, devices_per_node) for n in range(2, num_nodes + 1)))


def pipeline_time(stage_times: Iterable[float], num_microbatches: int) -> float:
    """``sum(t) + (B - 1) * max(t)``: one 1F1B step over stages with these times."""
    times = list(stage_times)
    return sum(times) + (num_microbatches - 1) * max(times)


def solve_stages(problem: StageProblem) -> StageSolution:
    """The optimal stage plan, evaluating only caps whose bound can beat the best total.

    Raises :class:`InfeasibleStagesError` when no plan fits in ``problem.memory_limit``.
    """
    tables = _build_tables(problem)
    solver = _CapSearch(tables, problem.num_microbatches)
    solver.run_pruned()
    return solver.solution(problem)


def solve_stages_plain(problem: StageProblem) -> StageSolution:
    """The same optimum as :func:`solve_stages`, evaluating every distinct stage time as cap."""
    tables = _build_tables(problem)
    solver = _CapSearch(tables, problem.num_microbatches)
    for cap in tables.candidate_caps():
        solver.evaluate(float(cap))
    return solver.solution(problem)


# ---------------------------------------------------------------- cost tables


@dataclass(frozen=True)
class _Tables:
    """Every stage's cost as arrays indexed ``[k, j, m]`` (layers ``[k, j)``, submesh ``m``)."""

    submeshes: tuple[Submesh, ...]
    sizes: np.ndarray  # (K,) devices of each submesh, ascending
    time: np.ndarray  # (L, L+1, K) seconds; inf where the stage is unusable
    memory: np.ndarray  # (L, L+1, K) bytes per device, without in-flight activations
    activation: np.ndarray  # (L, L+1, K) bytes per device per microbatch in flight
    max_left: np.ndarray  # (L, L+1, K) R: most stages from this one to the last; 0 = unusable
    send: np.ndarray | None  # (L+1, K, K) seconds, send[j, a, b]
    memory_limit: float
    min_memory_seen: float  # least memory + activation of a feasible stage (inf if none)

    @property
    def num_layers(self) -> int:
        return int(self.time.shape[0])

    @property
    def num_devices(self) -> int:
        return int(self.sizes[-1])

    def stage_times(self) -> np.ndarray:
        """The distinct times ``T`` of usable stages, ascending (sends not added)."""
        return np.unique(self.time[self.max_left >= 1])

    def candidate_caps(self) -> np.ndarray:
        """Every distinct stage time ``t_s`` a plan can have (including sends), ascending."""
        usable = self.max_left >= 1
        times = [self.time[usable]]
        if self.send is not None:
            k, j, a = np.nonzero(usable[:, :-1, :])
            times.append((self.time[k, j, a][:, None] + self.send[j, a, :]).ravel())
        return np.unique(np.concatenate(times))


def _build_tables(problem: StageProblem) -> _Tables:
    """Call ``cost`` once per stage (and ``send_time`` once per boundary and pair)."""
    num_layers, num_devices = problem.num_layers, problem.num_devices
    submeshes = submesh_choices(problem.num_nodes, problem.devices_per_node)
    sizes = np.array([s.num_devices for s in submeshes], dtype=np.int64)
    shape = (num_layers, num_layers + 1, len(submeshes))
    time = np.full(shape, np.inf)
    memory = np.full(shape, np.inf)
    activation = np.zeros(shape)
    feasible = np.zeros(shape, dtype=bool)
    for k in range(num_layers):
        for j in range(k + 1, num_layers + 1):
            # Every other stage needs at least one device.
            spare = num_devices - (k > 0) - (j < num_layers)
            for m, submesh in enumerate(submeshes):
                if submesh.num_devices > spare:
                    break
                c = problem.cost(k, j, submesh)
                if not c.feasible:
                    continue
                if not c.time_s >= 0:
                    raise _bad_time(c.time_s, f"cost({k}, {j}, {submesh}).time_s")
                time[k, j, m], memory[k, j, m] = c.time_s, c.memory_bytes
                activation[k, j, m] = c.activation_bytes
                feasible[k, j, m] = True
    max_left = _max_stages_left(memory, activation, problem.memory_limit, num_layers)
    max_left[~feasible | ~np.isfinite(time)] = 0
    time[max_left == 0] = np.inf
    min_memory_seen = float((memory + activation)[feasible].min()) if feasible.any() else math.inf
    send = None if problem.send_time is None else _send_table(problem, submeshes)
    return _Tables(
        submeshes=submeshes,
        sizes=sizes,
        time=time,
        memory=memory,
        activation=activation,
        max_left=max_left,
        send=send,
        memory_limit=problem.memory_limit,
        min_memory_seen=min_memory_seen,
    )


def _max_stages_left(
    memory: np.ndarray, activation: np.ndarray, memory_limit: float, num_layers: int
) -> np.ndarray:
    """``R``: the largest ``r <= L`` with ``memory + r * activation <= limit``; 0 if none."""
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.floor((memory_limit - memory) / activation)
    guess = np.where(activation > 0, guess, num_layers)
    left = np.nan_to_num(np.clip(guess, 0, num_layers), nan=0.0).astype(np.int64)
    # The division may round either way; settle on the exact inequality used to score plans.
    for _ in range(2):
        left = np.where(memory + left * activation > memory_limit, left - 1, left)
        left = np.maximum(left, 0)
        grow = (left < num_layers) & (memory + (left + 1) * activation <= memory_limit)
        left = np.where(grow, left + 1, left)
    left[~(memory + activation <= memory_limit)] = 0
    return left


def _send_table(problem: StageProblem, submeshes: tuple[Submesh, ...]) -> np.ndarray:
    assert problem.send_time is not None
    num_layers, num_devices = problem.num_layers, problem.num_devices
    send = np.zeros((num_layers + 1, len(submeshes), len(submeshes)))
    for j in range(1, num_layers):
        for a, src in enumerate(submeshes):
            for b, dst in enumerate(submeshes):
                if src.num_devices + dst.num_devices > num_devices:
                    break
                value = problem.send_time(j, src, dst)
                if not value >= 0:
                    raise _bad_time(value, f"send_time({j}, {src}, {dst})")
                send[j, a, b] = value
    return send


def _bad_time(value: float, what: str) -> AutoplanError:
    return AutoplanError(f"{what} = {value}; times must be >= 0 seconds")


# ---------------------------------------------------------------- one cap


@dataclass(frozen=True)
class _CappedPlan:
    """The least-sum plan for one cap: stages ``(start, stop, m)``, their times and sum."""

    stages: tuple[tuple[int, int, int], ...]
    times: tuple[float, ...]
    total: float  # F(t_max) as the DP computed it

    @property
    def max_time(self) -> float:
        return max(self.times)


def _device_windows(live: np.ndarray, sizes: np.ndarray, num_devices: int) -> np.ndarray:
    """``[lo[k], hi[k]]``: the devices that layers ``k..L-1`` can use in a plan of ``live``
    stages; ``lo`` is the fewest the suffix needs, ``D - hi`` the fewest the prefix needs."""
    num_layers = live.shape[0]
    has = live.any(axis=2)
    min_size = np.where(has, sizes[live.argmax(axis=2)], _NO_DEVICES)  # sizes ascend
    suffix = np.full(num_layers + 1, _NO_DEVICES, dtype=np.int64)
    suffix[num_layers] = 0
    for k in range(num_layers - 1, -1, -1):
        suffix[k] = np.min(min_size[k, k + 1 :] + suffix[k + 1 :])
    prefix = np.full(num_layers + 1, _NO_DEVICES, dtype=np.int64)
    prefix[0] = 0
    for j in range(1, num_layers + 1):
        prefix[j] = np.min(prefix[:j] + min_size[:j, j])
    lo = np.minimum(suffix, _NO_DEVICES)
    hi = num_devices - np.minimum(prefix, _NO_DEVICES)
    lo[0] = max(lo[0], num_devices)  # the first stage starts with the whole cluster
    return np.stack([lo, hi], axis=1)


class _CappedDP:
    """``H`` (or ``G`` with sends) of the module docstring for one cap ``t_max``.

    A row is a state ``(r, k)`` (``(r, k, a)`` with sends) over device counts ``d``: ``value``
    is ``H``, ``stages`` the stage count of its plan, ``choice`` its first move ``j * K + m``.
    """

    def __init__(self, tables: _Tables, cap: float) -> None:
        self.tables = tables
        self.cap = cap
        num_layers = tables.num_layers
        self.num_layers, self.num_devices = num_layers, tables.num_devices
        self.num_submeshes = len(tables.sizes)
        usable = (tables.max_left >= 1) & (tables.time <= cap)
        self.windows = _device_windows(usable, tables.sizes, self.num_devices)
        self.live = usable & self._fits_between_windows()
        layers_left = num_layers - np.arange(num_layers + 1)
        most_left = np.append(np.where(self.live, tables.max_left, 0).max(axis=(1, 2)), 0)
        self.level_cap = np.minimum(layers_left, most_left)

    def _fits_between_windows(self) -> np.ndarray:
        """Stages ``(k, j, m)`` with some ``d`` in ``k``'s window and ``d - |m|`` in ``j``'s."""
        lo, hi = self.windows[:, 0], self.windows[:, 1]
        size = self.tables.sizes[None, None, :]
        k_lo, k_hi = lo[:-1, None, None], hi[:-1, None, None]
        j_lo, j_hi = lo[None, :, None], hi[None, :, None]
        return (k_lo <= k_hi) & (j_lo <= j_hi) & (k_lo - size <= j_hi) & (k_hi - size >= j_lo)

    def solve(self) -> _CappedPlan | None:
        """The least-sum plan with every stage time within the cap, or None if none exists."""
        lo, hi = self.windows[0]
        if lo > hi or self.level_cap[0] < 1:
            return None
        self._allocate_rows(self._needed_levels())
        self._fill_rows()
        return self._best_plan()

    def _next_levels(
        self, level: int | np.ndarray, k: int, js: np.ndarray, ms: np.ndarray
    ) -> np.ndarray:
        """Normalized ``min(r, R) - 1`` at ``j`` after stage ``(k, j, m)``; -1 if not allowed.

        ``level`` may be an array of shape ``(n, 1)`` for ``n`` levels at once."""
        following = np.minimum(
            np.minimum(level, self.tables.max_left[k, js, ms]) - 1, self.level_cap[js]
        )
        return np.where(following >= (js < self.num_layers), following, -1)

    def _needed_levels(self) -> np.ndarray:
        """``needed[r, k]``: level ``r`` at layer ``k`` is reachable from the top state."""
        num_layers = self.num_layers
        needed = np.zeros((num_layers + 1, num_layers + 1), dtype=bool)
        needed[self.level_cap[0], 0] = True
        for k in range(num_layers):
            levels = np.flatnonzero(needed[:, k])
            if levels.size == 0:
                continue
            js, ms = np.nonzero(self.live[k])
            following = self._next_levels(levels[:, None], k, js, ms)
            ok = following >= 0
            needed[following[ok], np.broadcast_to(js, following.shape)[ok]] = True
        return needed

    def _allocate_rows(self, needed: np.ndarray) -> None:
        """One row per needed state, in the order they are filled: ``k`` descending, then level
        descending. ``row[r, k, a]`` finds it (for every ``a`` without sends).

        ``value`` and ``stages`` are flat: row ``i`` holds ``d = 0..D`` at
        ``i * width + D + 1 + d``, after ``D + 1`` padding entries (inf value) that ``d < 0``
        lands in."""
        num_layers, num_devices = self.num_layers, self.num_devices
        self.row = np.full((num_layers + 1, num_layers + 1, self.num_submeshes), -1, np.int64)
        self.row_states: list[tuple[int, int, int]] = []  # (level, k, a); a = -1 for any
        for k in range(num_layers, -1, -1):
            levels = np.flatnonzero(needed[:, k])[::-1]
            starts = np.array([-1])
            if k < num_layers and self.tables.send is not None:
                starts = np.flatnonzero(self.live[k].any(axis=0))
            if levels.size == 0 or starts.size == 0:
                continue
            first = len(self.row_states)
            rows = first + np.arange(levels.size * starts.size).reshape(levels.size, -1)
            if starts[0] < 0:
                self.row[levels, k, :] = rows
            else:
                self.row[levels[:, None], k, starts[None, :]] = rows
            self.row_states += [(int(r), k, int(a)) for r in levels for a in starts]
        num_rows = len(self.row_states)
        self.width = 2 * (num_devices + 1)
        self.value = np.full(num_rows * self.width, np.inf)
        self.stages = np.zeros(num_rows * self.width, dtype=np.int16)
        self.choice = np.full((num_rows, num_devices + 1), -1, dtype=np.int32)
        self.value[self._at(int(self.row[0, num_layers, 0]), 0)] = 0.0

    def _at(self, row: int, devices: int) -> int:
        """Index of state ``(row, devices)`` in the flat ``value`` and ``stages``."""
        return row * self.width + self.num_devices + 1 + devices

    def _at_many(self, row: int, devices: np.ndarray) -> np.ndarray:
        return row * self.width + self.num_devices + 1 + devices

    def _fill_rows(self) -> None:
        """Fill every row from rows of later layers; a lower level first reuses what it can
        of the row one level up for the same ``(k, a)``."""
        tables, num_layers = self.tables, self.num_layers
        moves: dict[int, tuple[np.ndarray, ...]] = {}
        higher: dict[tuple[int, int], int] = {}  # (k, a) -> row of the last (higher) level
        for row, (level, k, a) in enumerate(self.row_states):
            if k == num_layers:
                continue
            lo, hi = self.windows[k]
            if a >= 0:
                lo = max(lo, int(tables.sizes[a]))
            devices = np.arange(lo, hi + 1)
            if (k, a) in higher:
                devices = self._copy_unconstrained(higher[k, a], row, level, devices)
            higher[k, a] = row
            if devices.size == 0:
                continue
            if k not in moves:
                moves[k] = np.nonzero(self.live[k])
            js, ms = moves[k]
            if a >= 0:
                js, ms = self._next_submeshes(js[ms == a], a)
            stage_m = ms if a < 0 else np.full_like(js, a)
            following = self._next_levels(level, k, js, stage_m)
            next_rows = self.row[np.maximum(following, 0), js, ms]
            cost = tables.time[k, js, stage_m]
            if a >= 0:
                assert tables.send is not None
                cost = cost + tables.send[js, a, ms]
            keep = (following >= 0) & (next_rows >= 0) & (cost <= self.cap)
            shifts = tables.sizes[stage_m[keep]]
            codes = js[keep] * self.num_submeshes + ms[keep]
            self._relax(row, devices, cost[keep], next_rows[keep], shifts, codes)

    def _copy_unconstrained(
        self, source: int, row: int, level: int, devices: np.ndarray
    ) -> np.ndarray:
        """Where the plan of a higher level has at most ``level`` stages it is optimal for
        ``level`` too: copy it and return the device counts still to compute."""
        at_source, at_row = self._at_many(source, devices), self._at_many(row, devices)
        fits = self.stages[at_source] <= level
        self.value[at_row[fits]] = self.value[at_source[fits]]
        self.stages[at_row[fits]] = self.stages[at_source[fits]]
        self.choice[row, devices[fits]] = self.choice[source, devices[fits]]
        return devices[~fits]

    def _next_submeshes(self, js: np.ndarray, a: int) -> tuple[np.ndarray, np.ndarray]:
        """With sends: pair each stop ``j`` with every submesh ``b`` the next stage may start
        on (``ms`` is then ``b``); ``j = L`` has no next stage and keeps ``b = a``."""
        nexts = self.live[np.minimum(js, self.num_layers - 1)].any(axis=1)  # (n, K) by start j
        nexts[js == self.num_layers] = False
        nexts[js == self.num_layers, a] = True
        pair_j, pair_b = np.nonzero(nexts)
        return js[pair_j], pair_b

    def _relax(
        self,
        row: int,
        devices: np.ndarray,
        cost: np.ndarray,
        next_rows: np.ndarray,
        shifts: np.ndarray,
        codes: np.ndarray,
    ) -> None:
        """``H(row, d) = min_c cost[c] + H(next_rows[c], d - shifts[c])`` for ``d`` in
        ``devices``; ties go to fewer stages, then to the earlier candidate (smaller code)."""
        if devices.size == 0:
            return
        columns = np.arange(devices.size)
        best = np.full(devices.size, np.inf)
        best_stages = np.zeros(devices.size, dtype=np.int64)
        best_code = np.full(devices.size, -1, dtype=np.int64)
        sources = self._at(0, 0) + next_rows * self.width - shifts  # index of d = 0, per move
        step = max(1, _BLOCK_ELEMENTS // devices.size)
        for first in range(0, cost.size, step):
            block = slice(first, first + step)
            at = devices[:, None] + sources[None, block]  # (devices, moves)
            vals = np.take(self.value, at)
            vals += cost[None, block]
            pick = vals.argmin(axis=1)
            val = vals[columns, pick]
            tied = np.count_nonzero(vals == val[:, None], axis=1) > 1
            ties = np.flatnonzero(tied & np.isfinite(val))
            if ties.size:
                counts = np.take(self.stages, at[ties])
                counts[vals[ties] != val[ties, None]] = np.iinfo(np.int16).max
                pick[ties] = counts.argmin(axis=1)
            num_stages = 1 + np.take(self.stages, at[columns, pick]).astype(np.int64)
            better = (val < best) | ((val == best) & (num_stages < best_stages))
            best = np.where(better, val, best)
            best_stages = np.where(better, num_stages, best_stages)
            best_code = np.where(better, codes[block][pick], best_code)
        self.value[self._at_many(row, devices)] = best
        self.stages[self._at_many(row, devices)] = best_stages
        self.choice[row, devices] = best_code

    def _best_plan(self) -> _CappedPlan | None:
        """Follow the recorded choices from the top state (with sends: its best first submesh)."""
        top_level, num_devices = int(self.level_cap[0]), self.num_devices
        rows = self.row[top_level, 0]
        rows = rows[rows >= 0] if self.tables.send is not None else rows[-1:]
        tops = []
        for row in rows.tolist():
            at = self._at(row, num_devices)
            if np.isfinite(self.value[at]):
                first_stop = int(self.choice[row, num_devices]) // self.num_submeshes
                a = self.row_states[row][2]
                tops.append((float(self.value[at]), int(self.stages[at]), first_stop, a, row))
        if not tops:
            return None
        total, *_, row = min(tops)
        stages = self._trace(row)
        return _CappedPlan(stages, _stage_times(self.tables, stages), total)

    def _trace(self, row: int) -> tuple[tuple[int, int, int], ...]:
        """The stages ``(start, stop, m)`` of the plan recorded for ``(row, D)``."""
        stages = []
        devices = self.num_devices
        level, k, a = self.row_states[row]
        while k < self.num_layers:
            j, m = divmod(int(self.choice[row, devices]), self.num_submeshes)
            stage_m = a if a >= 0 else m
            stages.append((k, j, stage_m))
            following = self._next_levels(level, k, np.array([j]), np.array([stage_m]))
            devices -= int(self.tables.sizes[stage_m])
            row = int(self.row[max(int(following[0]), 0), j, m])
            level, k, a = self.row_states[row]
        return tuple(stages)


def _stage_times(tables: _Tables, stages: tuple[tuple[int, int, int], ...]) -> tuple[float, ...]:
    """``t_s``: stage time plus the send into the next stage."""
    times = []
    for s, (k, j, m) in enumerate(stages):
        t = float(tables.time[k, j, m])
        if tables.send is not None and s + 1 < len(stages):
            t += float(tables.send[j, m, stages[s + 1][2]])
        times.append(t)
    return tuple(times)


# ---------------------------------------------------------------- search over caps


class _CapSearch:
    """Runs the capped DP for caps (each once) and keeps the best plan by total, then fewer
    stages, then smaller ``(stop, m)`` pairs in stage order."""

    def __init__(self, tables: _Tables, num_microbatches: int) -> None:
        self.tables = tables
        self.num_microbatches = num_microbatches
        self.best: tuple[float, int, tuple[tuple[int, int], ...]] | None = None
        self.best_plan: _CappedPlan | None = None
        self.evaluated: dict[float, _CappedPlan | None] = {}
        # The DP's F(cap) depends only on which stage times are <= cap; without sends those
        # are the stage times, so caps snap down to one of them.
        self.stage_times = None if tables.send is not None else tables.stage_times()

    @property
    def best_total(self) -> float:
        return math.inf if self.best is None else self.best[0]

    def evaluate(self, cap: float) -> _CappedPlan | None:
        if cap in self.evaluated:
            return self.evaluated[cap]
        plan = self.evaluated[cap] = _CappedDP(self.tables, cap).solve()
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

    def _first_feasible(self) -> tuple[float, float, _CappedPlan | None]:
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
        self, heap: list[tuple[float, float, float, float]], lo: float, plan: _CappedPlan
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


def _device_lower_bound(tables: _Tables, caps: np.ndarray) -> float:
    """The smallest cap at which the stages fitting under it could cover all layers with at
    most ``D`` devices (memory and the exact device count relaxed); binary search over caps."""
    usable = tables.max_left >= 1
    first, last = 0, len(caps) - 1
    while first < last:
        middle = (first + last) // 2
        live = usable & (tables.time <= caps[middle])
        if _device_windows(live, tables.sizes, tables.num_devices)[0, 0] <= tables.num_devices:
            last = middle
        else:
            first = middle + 1
    return float(caps[first]) if len(caps) else math.inf


def _infeasible_error(tables: _Tables) -> InfeasibleStagesError:
    limit = tables.memory_limit
    seen = tables.min_memory_seen
    smallest = (
        f"the smallest per-stage memory seen (one microbatch in flight) is {seen:.6g} bytes "
        f"({seen / GIB:.2f} GiB)"
        if math.isfinite(seen)
        else "the cost function reported no feasible stage"
    )
    return InfeasibleStagesError(
        f"no pipeline stage plan fits in memory_limit={limit:.6g} bytes "
        f"({limit / GIB:.2f} GiB) per device; {smallest}; raise the memory limit or give "
        "the stages more devices"
    )

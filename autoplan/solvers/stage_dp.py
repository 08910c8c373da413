"""Alpa's stage DP for one cap ``t_max``: the least sum of stage times over plans whose every
stage time is within the cap (notation of `autoplan.solvers.stage_problem`; ``R``, the most
stages that may follow a stage in memory, of `autoplan.solvers.stage_tables`).

Dynamic program for one cap ``t_max`` (:class:`CappedDP`)
    ``H(r, k, d)``: the least ``sum t_s`` over plans for layers ``k..L-1`` on exactly ``d``
    devices with at most ``r`` stages, every ``t_s <= t_max``, every stage within memory for
    its real count of stages left. Counting stages *remaining* makes the memory check exact:
    ``H(r, L, 0) = 0``, ``H(0, k < L, d) = inf`` and (:meth:`CappedDP._fill_rows`)

        ``H(r, k, d) = min_(j, m) T[k, j, m] + H(min(r, R[k, j, m]) - 1, j, d - |m|)``

    over stages with ``T[k, j, m] <= t_max``. The answer ``F(t_max)`` is ``H(L, 0, D)``.
    ``H(r, k, .)`` equals ``H(c_k, k, .)`` for ``r >= c_k = min(L - k, max R from k)``, so
    levels are capped (:meth:`CappedDP._next_levels`) and only those the top state reaches
    are computed (:meth:`CappedDP._needed_levels`): one per layer when memory never binds.
    Where the plan of a higher level at the same ``k`` has at most ``r`` stages it is also
    the plan of level ``r`` and is copied (:meth:`CappedDP._copy_unconstrained`). With sends
    the state also holds the submesh ``a`` of the stage starting at ``k``:

        ``G(r, k, a, d) = min_(j, b) T[k, j, a] + send(j, a, b) + G(r', j, b, d - |a|)``

    with ``T[k, j, a] + send(j, a, b) <= t_max``, ``r' = min(r, R[k, j, a]) - 1``, and the
    answer is ``min_a G(L, 0, a, D)``. Device counts are limited to the window
    ``[devmin(k..L), D - devmin(0..k)]`` (:func:`device_windows`: the fewest devices that
    capped stages need for the layers after and before ``k``), and a stage is tried only if
    it can join two windows (:meth:`CappedDP._fits_between_windows`). Ties go to fewer
    stages, then to lexicographically smaller ``(stop, m)`` stage by stage
    (:meth:`CappedDP._relax`), so a problem always gives the same plan.

Cost: per cap ``O(L^2 K W)`` element operations per level, ``W <= D + 1`` the window width;
with sends ``K`` times more. The search over caps is `autoplan.solvers.stages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplan.solvers.stage_tables import StageTables

# Larger than any device count, small enough that sums of two never overflow int64.
_NO_DEVICES = 2**40
# Elements of one (candidates x devices) block in the DP; bounds the memory of one step.
_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class CappedPlan:
    """The least-sum plan for one cap: stages ``(start, stop, m)``, their times and sum."""

    stages: tuple[tuple[int, int, int], ...]
    times: tuple[float, ...]
    total: float  # F(t_max) as the DP computed it

    @property
    def max_time(self) -> float:
        return max(self.times)


def device_windows(live: np.ndarray, sizes: np.ndarray, num_devices: int) -> np.ndarray:
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


class CappedDP:
    """``H`` (or ``G`` with sends) of the module docstring for one cap ``t_max``.

    A row is a state ``(r, k)`` (``(r, k, a)`` with sends) over device counts ``d``: ``value``
    is ``H``, ``stages`` the stage count of its plan, ``choice`` its first move ``j * K + m``.
    """

    def __init__(self, tables: StageTables, cap: float) -> None:
        self.tables = tables
        self.cap = cap
        num_layers = tables.num_layers
        self.num_layers, self.num_devices = num_layers, tables.num_devices
        self.num_submeshes = len(tables.sizes)
        usable = (tables.max_left >= 1) & (tables.time <= cap)
        self.windows = device_windows(usable, tables.sizes, self.num_devices)
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

    def solve(self) -> CappedPlan | None:
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

    def _best_plan(self) -> CappedPlan | None:
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
        return CappedPlan(stages, _stage_times(self.tables, stages), total)

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


def _stage_times(
    tables: StageTables, stages: tuple[tuple[int, int, int], ...]
) -> tuple[float, ...]:
    """``t_s``: stage time plus the send into the next stage."""
    times = []
    for s, (k, j, m) in enumerate(stages):
        t = float(tables.time[k, j, m])
        if tables.send is not None and s + 1 < len(stages):
            t += float(tables.send[j, m, stages[s + 1][2]])
        times.append(t)
    return tuple(times)

"""The stage DP's cost tables: a `StageProblem`'s ``cost`` and ``send_time`` called once per
stage and boundary, into arrays indexed ``[k, j, m]`` (notation of
`autoplan.solvers.stage_problem`). A stage that ``cost`` reports infeasible, or that never fits
in memory, is unusable: ``R = 0`` and ``T = inf`` (:func:`build_tables`). A problem's stage
variants are submesh choices of their own: index ``m`` is submesh ``m // V`` in variant
``m % V``.

Memory (:func:`_max_stages_left`)
    Under 1F1B stage ``s`` keeps ``S - s`` microbatches in flight: ``mem + (S - s) * act <=
    mem_max``. With ``R[k, j, m]`` the largest ``r`` such that ``mem + r * act <= mem_max``
    this reads ``S - s <= R``; ``R = 0`` marks a stage that never fits or that ``cost``
    reports infeasible. The dynamic program (`autoplan.solvers.stage_dp`) keeps the constraint
    exact by counting the stages left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoplan.errors import AutoplanError
from autoplan.solvers.stage_problem import StageCost, StageProblem, Submesh, submesh_choices


@dataclass(frozen=True)
class StageTables:
    """Every stage's cost as arrays indexed ``[k, j, m]`` (layers ``[k, j)``, submesh ``m``)."""

    submeshes: tuple[Submesh, ...]  # each repeated for its ``variants``
    sizes: np.ndarray  # (K,) devices of each submesh, ascending
    time: np.ndarray  # (L, L+1, K) seconds; inf where the stage is unusable
    memory: np.ndarray  # (L, L+1, K) bytes per device, without in-flight activations
    activation: np.ndarray  # (L, L+1, K) bytes per device per microbatch in flight
    max_left: np.ndarray  # (L, L+1, K) R: most stages from this one to the last; 0 = unusable
    send: np.ndarray | None  # (L+1, K, K) seconds, send[j, a, b]
    memory_limit: float
    min_memory_seen: float  # least memory + activation of a feasible stage (inf if none)
    variants: int = 1

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


def build_tables(problem: StageProblem) -> StageTables:
    """Call ``cost`` once per stage (and ``send_time`` once per boundary and pair)."""
    num_layers, num_devices, variants = problem.num_layers, problem.num_devices, problem.variants
    choices = submesh_choices(problem.num_nodes, problem.devices_per_node)
    submeshes = tuple(s for s in choices for _ in range(variants))
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
            for i, submesh in enumerate(choices):
                if submesh.num_devices > spare:
                    break
                for v, c in enumerate(_variants(problem, k, j, submesh)):
                    if not c.feasible:
                        continue
                    if not c.time_s >= 0:
                        raise _bad_time(c.time_s, f"cost({k}, {j}, {submesh}).time_s")
                    m = i * variants + v
                    time[k, j, m], memory[k, j, m] = c.time_s, c.memory_bytes
                    activation[k, j, m] = c.activation_bytes
                    feasible[k, j, m] = True
    max_left = _max_stages_left(memory, activation, problem.memory_limit, num_layers)
    max_left[~feasible | ~np.isfinite(time)] = 0
    time[max_left == 0] = np.inf
    min_memory_seen = float((memory + activation)[feasible].min()) if feasible.any() else math.inf
    send = None if problem.send_time is None else _send_table(problem, choices)
    if send is not None and variants > 1:
        send = np.repeat(np.repeat(send, variants, axis=1), variants, axis=2)
    return StageTables(
        submeshes=submeshes,
        sizes=sizes,
        time=time,
        memory=memory,
        activation=activation,
        max_left=max_left,
        send=send,
        memory_limit=problem.memory_limit,
        min_memory_seen=min_memory_seen,
        variants=variants,
    )


def _variants(problem: StageProblem, k: int, j: int, submesh: Submesh) -> Sequence[StageCost]:
    """``cost(k, j, submesh)`` as one cost per variant."""
    found = problem.cost(k, j, submesh)
    costs = (found,) if isinstance(found, StageCost) else tuple(found)
    if len(costs) != problem.variants:
        raise AutoplanError(
            f"cost({k}, {j}, {submesh}) gave {len(costs)} cost(s); the problem has "
            f"{problem.variants} variant(s) of each stage"
        )
    return costs


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

"""Inter-operator stage partitioning, the problem as plain data: Alpa's split of a step's
layers into pipeline stages on submeshes; no torch, no fx.

Notation: layers ``0..L-1``; a cluster of ``N`` nodes x ``M`` devices, ``D = N * M``; ``B``
microbatches; memory limit ``mem_max`` bytes per device. Submesh choices ``m``
(:func:`submesh_choices`, smallest first): ``(1, 1), (1, 2), (1, 4), ..., (1, M)`` and
``(n, M)`` for ``n = 2..N``, ``K`` of them; ``|m|`` is a submesh's device count. A stage runs
layers ``[k, j)`` on submesh ``m``; ``cost(k, j, m)`` gives its time ``T[k, j, m]`` (one
microbatch, forward + backward), memory ``mem[k, j, m]`` and the activation memory of one
in-flight microbatch ``act[k, j, m]``, per device. ``send(j, a, b)`` is the time to send the
activations at boundary ``j`` from a stage on ``a`` to the next stage, on ``b`` (0 without
``send_time``). A stage may come in ``V`` variants (`StageProblem.variants`: a pipeline's
recomputation modes and memory budgets of its layers' plans): ``cost`` then gives each, and the
solver chooses one per stage, as if each were a submesh of its own.

Plan and objective (:func:`pipeline_time`)
    Stages ``s = 0..S-1`` cover the layers contiguously and in order, and their submeshes use
    exactly ``D`` devices: ``sum_s |m_s| == D`` (Alpa's constraint). Stage ``s`` takes
    ``t_s = T[s] + send(stop_s, m_s, m_(s+1))`` (the send is the sender's; none after the last
    stage) and a 1F1B step takes ``sum_s t_s + (B - 1) * max_s t_s``.

The solver: `autoplan.solvers.stages.solve_stages`, a search over the cap ``t_max`` on
every stage time, running the dynamic program of `autoplan.solvers.stage_dp` for each cap on
the cost tables of `autoplan.solvers.stage_tables` (where the memory constraint is). Costs are
seconds; memory is bytes per device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from autoplan.errors import AutoplanError, InfeasiblePlanError


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


# a stage's cost, or with ``StageProblem.variants`` > 1 that many, one per variant
StageCostFn = Callable[[int, int, Submesh], StageCost | Sequence[StageCost]]


SendTimeFn = Callable[[int, Submesh, Submesh], float]


@dataclass(frozen=True)
class StageProblem:
    """Split ``num_layers`` layers into pipeline stages on a ``num_nodes x devices_per_node``
    cluster. ``cost(i, j, submesh)`` costs layers ``[i, j)``; ``send_time(j, a, b)`` is the
    time to send the activations at boundary ``j`` from a stage on ``a`` to one on ``b``;
    with ``variants`` > 1, ``cost`` gives that many costs of each stage, one per variant."""

    num_layers: int
    num_nodes: int
    devices_per_node: int
    num_microbatches: int
    memory_limit: float
    cost: StageCostFn = field(repr=False)
    send_time: SendTimeFn | None = field(default=None, repr=False)
    variants: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_nodes", "devices_per_node", "num_microbatches", "variants"):
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
    variant: int = 0  # which of the stage's variants (`StageProblem.variants`)


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


def interleaved_time(
    stage_times: Sequence[float], num_microbatches: int, virtual_stages: int
) -> float:
    """One interleaved 1F1B step over stages with these times, stage ``s`` on device group
    ``s mod p``: the busiest group's work ``B W``, plus the time the first microbatch takes
    through the rest of the pipeline, which the group's ``v`` chunks overlap ``v``-fold:
    ``B W + (sum(t) - W) / v``, ``W = max_g sum(t_s on g)``. Equal stages make it
    ``(B v + p - 1) t``, where 1F1B over ``p`` stages of ``v t`` takes ``(B + p - 1) v t``;
    ``v = 1`` is `pipeline_time`."""
    groups = len(stage_times) // virtual_stages
    busiest = max(sum(stage_times[g::groups]) for g in range(groups))
    return num_microbatches * busiest + (sum(stage_times) - busiest) / virtual_stages

"""A pipeline schedule in time: when each stage runs each microbatch's forward and backward.

Each stage runs a fixed order (`stage_order`), the one torch.distributed.pipelining runs:

- GPipe (ScheduleGPipe): every forward, then every backward, both in microbatch order.
- 1F1B (Schedule1F1B): ``min(B, S - s)`` forwards on stage ``s`` of ``S`` (the last stage
  one), then one backward and one forward in turn until the forwards run out, then the
  remaining backwards.

`simulate` starts each step as soon as its stage is free and its input has arrived: the
forward of microbatch ``m`` on stage ``s`` after its forward on stage ``s - 1``, the backward
on stage ``s`` after its backward on stage ``s + 1`` (the last stage's backward follows its own
forward, which comes before it in the stage's order). Sends take no time. Durations are per
stage, in seconds, or one unit each (slots: the order without the durations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.errors import AutoplanError
from autoplan.plan.schema import SCHEDULES

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # FORWARD | BACKWARD
    microbatch: int
    start: float  # seconds from the step's start, or slots
    end: float


def stage_order(
    schedule: str, num_stages: int, num_microbatches: int, stage: int
) -> tuple[tuple[str, int], ...]:
    """The (kind, microbatch) steps ``stage`` runs, in the order it runs them."""
    forwards = [(FORWARD, m) for m in range(num_microbatches)]
    backwards = [(BACKWARD, m) for m in range(num_microbatches)]
    if schedule == "GPipe":
        return (*forwards, *backwards)
    if schedule != "1F1B":
        raise AutoplanError(f"schedule {schedule!r} is not known; use one of {SCHEDULES}")
    warmup = min(num_microbatches, num_stages - stage)
    order = forwards[:warmup]
    for b, f in zip(backwards, forwards[warmup:], strict=False):
        order += [b, f]
    return (*order, *backwards[num_microbatches - warmup :])


def simulate(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    durations: Sequence[tuple[float, float]] | None = None,
) -> tuple[Event, ...]:
    """Every step of one training step, by start time then stage. ``durations`` gives each
    stage's (forward, backward) time per microbatch; without it every step takes one slot."""
    times = durations if durations is not None else [(1.0, 1.0)] * num_stages
    assert len(times) == num_stages, (len(times), num_stages)
    orders = [stage_order(schedule, num_stages, num_microbatches, s) for s in range(num_stages)]
    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end
    free = [0.0] * num_stages  # when each stage finishes its last step so far
    done = [0] * num_stages  # steps of each stage's order placed so far
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for s, order in enumerate(orders):
            while done[s] < len(order):
                kind, m = order[done[s]]
                source = s - 1 if kind == FORWARD else s + 1
                if 0 <= source < num_stages and (kind, source, m) not in ends:
                    break  # its input is not computed yet; another stage goes first
                start = max(free[s], ends.get((kind, source, m), 0.0))
                end = start + times[s][0 if kind == FORWARD else 1]
                ends[(kind, s, m)] = free[s] = end
                events.append(Event(s, kind, m, start, end))
                done[s] += 1
                progress = True
    assert done == [len(o) for o in orders], "a schedule's orders never deadlock"
    return tuple(sorted(events, key=lambda e: (e.start, e.stage)))

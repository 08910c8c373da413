"""Pipeline schedules: their names, what torch.distributed.pipelining accepts, and a schedule in
time. Both the stage search and the plan import them.

A schedule in time: when each stage runs each microbatch's forward and backward.

Each stage runs a fixed order (`stage_order`), the one torch.distributed.pipelining runs:

- GPipe (ScheduleGPipe): every forward, then every backward, both in microbatch order.
- 1F1B (Schedule1F1B): ``min(B, S - s)`` forwards on stage ``s`` of ``S`` (the last stage
  one), then one backward and one forward in turn until the forwards run out, then the
  remaining backwards.

`simulate` starts each step as soon as its stage is free and its input has arrived: the
forward of microbatch ``m`` on stage ``s`` after its forward on stage ``s - 1``, the backward
on stage ``s`` after its backward on stage ``s + 1`` (the last stage's backward follows its own
forward, which comes before it in the stage's order). Sends take no time. Durations are per
stage, in seconds, or one unit each (slots: the order without the durations). Where stages
share processors (CPU ranks sharing cores), ``speed`` gives how fast every running step goes
when so many stages run at once, relative to the durations: a step's time then depends on
what runs beside it, and the simulation advances from one step's end to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoplan.errors import AutoplanError

SCHEDULES = ("1F1B", "GPipe")  # torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe


def check_schedule(schedule: str) -> str:
    """The schedule's name as plans write it ("gpipe" -> "GPipe"); an unknown one is an error."""
    by_lower = {s.lower(): s for s in SCHEDULES}
    if schedule.lower() not in by_lower:
        raise AutoplanError(f"schedule {schedule!r} is not known; use one of {SCHEDULES}")
    return by_lower[schedule.lower()]


def schedule_refusal(schedule: str, num_stages: int, num_microbatches: int) -> str | None:
    """Why torch.distributed.pipelining would refuse ``schedule`` over this many stages and
    microbatches (its Schedule1F1B needs at least one microbatch a stage), or None."""
    if schedule == "1F1B" and num_microbatches < num_stages:
        return (
            f"schedule 1F1B needs at least as many microbatches as stages, but "
            f"num_microbatches={num_microbatches} < {num_stages} stages; use more "
            "microbatches or GPipe"
        )
    return None


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
    speed: Callable[[int], float] | None = None,
) -> tuple[Event, ...]:
    """Every step of one training step, by start time then stage. ``durations`` gives each
    stage's (forward, backward) time per microbatch; without it every step takes one slot.
    ``speed(n)``: the speed of each of ``n`` stages running at once (default 1.0)."""
    times = durations if durations is not None else [(1.0, 1.0)] * num_stages
    assert len(times) == num_stages, (len(times), num_stages)
    orders = [stage_order(schedule, num_stages, num_microbatches, s) for s in range(num_stages)]
    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end
    done = [0] * num_stages  # steps of each stage's order finished so far
    running: dict[int, tuple[float, float]] = {}  # stage -> (its step's start, work left)
    events: list[Event] = []
    now = 0.0
    while True:
        for s, order in enumerate(orders):
            if s in running or done[s] == len(order):
                continue
            kind, m = order[done[s]]
            source = s - 1 if kind == FORWARD else s + 1
            if 0 <= source < num_stages and (kind, source, m) not in ends:
                continue  # its input is not computed yet
            running[s] = (now, times[s][0 if kind == FORWARD else 1])
        if not running:
            break
        rate = 1.0 if speed is None else speed(len(running))
        step = min(left for _, left in running.values()) / rate
        now += step
        for s, (start, left) in list(running.items()):
            left -= step * rate
            if left > 1e-12 * max(1.0, now):
                running[s] = (start, left)
                continue
            kind, m = orders[s][done[s]]
            ends[(kind, s, m)] = now
            events.append(Event(s, kind, m, start, now))
            done[s] += 1
            del running[s]
    assert done == [len(o) for o in orders], "a schedule's orders never deadlock"
    return tuple(sorted(events, key=lambda e: (e.start, e.stage)))

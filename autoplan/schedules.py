"""Pipeline schedules: their names, what torch.distributed.pipelining accepts, and a schedule in
time. Both the stage search and the plan import them.

A schedule in time: when each stage runs each microbatch's forward and backward.

Each stage runs a fixed order (`stage_order`), the one torch.distributed.pipelining runs:

- GPipe (ScheduleGPipe): every forward, then every backward, both in microbatch order.
- 1F1B (Schedule1F1B): ``min(B, S - s)`` forwards on stage ``s`` of ``S`` (the last stage
  one), then one backward and one forward in turn until the forwards run out, then the
  remaining backwards.
- Interleaved1F1B (ScheduleInterleaved1F1B): ``S = p v`` stages on ``p`` device groups, stage
  ``s`` on group ``s mod p`` (each group holds ``v`` chunks, "virtual stages", not adjacent).
  Group ``g`` runs torch's order (`group_order`): microbatches in rounds of ``B / max(1, B //
  p)``, its forwards going through its chunks round by round, warm-up ``(v - 1)`` rounds plus
  ``2 (p - 1 - g)`` forwards, then one forward and one backward in turn, then the remaining
  backwards (chunks in reverse). Its bubble is about ``(p - 1) / v`` of a chunk's time where
  1F1B's is ``p - 1`` stages' times, for ``v`` times the sends.
- ZeroBubble (ScheduleInterleavedZeroBubble, the ZB-H1 schedule of Qi et al. 2024, "Zero
  Bubble Pipeline Parallelism"; one stage a group or ``v`` interleaved as above): each
  backward is split into ``B``, the gradients of the stage's inputs, which the previous stage
  waits for, and ``W``, the gradients of its weights, which nobody waits for; the late groups
  put their ``W`` steps off into what 1F1B leaves idle. The order is torch's own
  (`autoplan.torch_private.zero_bubble_order`). A microbatch's activations stay until its
  ``W`` (its weights' gradients read them), and from its ``B`` to its ``W`` so do the
  gradients of the outputs of the ops that read a weight. The first stage has no input
  gradient to send: torch runs its whole backward at ``W`` and its ``B`` does nothing.
- ZBV (ScheduleZBVZeroBubble, the ZB-V schedule of the same paper, section 6): ``B`` and ``W``
  split as under ZeroBubble, two stages on each of ``p`` device groups placed in a V: group
  ``g`` holds stages ``g`` and ``2 p - 1 - g`` (`stage_group`), so the microbatches go down
  the groups and back up, the middle group passes from stage ``p - 1`` to ``p`` in place, and
  the first group runs the last stage: the loss's backward starts where the forward started.
  The order is torch's (`autoplan.torch_private.zbv_order`).
- DualPipeV (ScheduleDualPipeV, DeepSeek's DualPipe folded into a V, DeepSeek-V3 report
  2024): the same V, at least as many microbatches as stages; in its steady phase each
  group pairs a forward of one stage with a whole backward of its other stage (torch's
  runtime runs the pair one after the other), and its last phases split the backward into
  ``B`` and ``W``. The order is torch's (`autoplan.torch_private.dualpipev_order`).

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
from autoplan.modes import Schedule, parse_mode
from autoplan.torch_private import dualpipev_order, zbv_order, zero_bubble_order

# the schedules that may put several stages on a device group (`virtual_stages`)
MULTI_STAGE = (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPE_V)
# the schedules that split each backward into input (B) and weight (W) gradients
SPLIT_BACKWARD = (Schedule.ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPE_V)
# the schedules whose device groups hold their stages in a V (`stage_group`)
V_SHAPED = (Schedule.ZBV, Schedule.DUALPIPE_V)


def stage_group(schedule: str, num_stages: int, virtual_stages: int, stage: int) -> int:
    """The device group that runs ``stage``: ``stage mod p`` of ``p = num_stages /
    virtual_stages`` groups, or in a V (ZBV): ``stage`` down the groups, then back up."""
    groups = num_stages // virtual_stages
    if schedule in V_SHAPED:
        return stage if stage < groups else num_stages - 1 - stage
    return stage % groups


def group_stages(
    schedule: str, num_stages: int, virtual_stages: int, group: int
) -> tuple[int, ...]:
    """The stages device group ``group`` runs, in stage order (`stage_group`)."""
    return tuple(
        s
        for s in range(num_stages)
        if stage_group(schedule, num_stages, virtual_stages, s) == group
    )


def check_schedule(schedule: str) -> Schedule:
    """The schedule named as plans write it ("gpipe" -> "GPipe"); an unknown one is an error."""
    return parse_mode(Schedule, schedule, "schedule")


def schedule_refusal(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> str | None:
    """Why torch.distributed.pipelining would refuse ``schedule`` over this many stages (in
    all: ``virtual_stages`` on each device group) and microbatches, or None: its Schedule1F1B
    needs at least one microbatch a stage; ScheduleInterleaved1F1B two or more stages on each
    group; it and ScheduleInterleavedZeroBubble (one stage a group or more) microbatches a
    multiple of their rounds, ``max(1, B // groups)``; ScheduleZBVZeroBubble and
    ScheduleDualPipeV exactly two stages on each group, the latter at least one microbatch a
    stage."""
    if schedule in V_SHAPED:
        if refusal := v_refusal(schedule, virtual_stages):
            return refusal
        if schedule == Schedule.DUALPIPE_V and num_microbatches < num_stages:
            return (
                f"schedule {schedule} needs at least as many microbatches as stages, but "
                f"num_microbatches={num_microbatches} < {num_stages} stages; use more "
                f"microbatches or {Schedule.ZBV}"
            )
        return None
    if schedule not in MULTI_STAGE:
        if virtual_stages != 1:
            return (
                f"schedule {schedule} runs one stage on each device group, but "
                f"virtual_stages={virtual_stages}; use {Schedule.INTERLEAVED} or "
                f"{Schedule.ZERO_BUBBLE} for more"
            )
        if schedule == Schedule.ONE_F_ONE_B and num_microbatches < num_stages:
            return (
                f"schedule 1F1B needs at least as many microbatches as stages, but "
                f"num_microbatches={num_microbatches} < {num_stages} stages; use more "
                "microbatches or GPipe"
            )
        return None
    least = 2 if schedule == Schedule.INTERLEAVED else 1
    if virtual_stages < least or num_stages % virtual_stages:
        return (
            f"schedule {schedule} needs {least} or more stages on each device group "
            f"(virtual_stages >= {least}, dividing the {num_stages} stages), but "
            f"virtual_stages={virtual_stages}; use 1F1B for one"
        )
    groups = num_stages // virtual_stages
    rounds = max(1, num_microbatches // groups)
    if num_microbatches % rounds:
        return (
            f"schedule {schedule} runs microbatches in rounds of about one per device "
            f"group: num_microbatches={num_microbatches} on {groups} groups must be a multiple "
            f"of max(1, {num_microbatches} // {groups}) = {rounds}; use a multiple of {groups}"
        )
    return None


def v_refusal(schedule: str, virtual_stages: int) -> str | None:
    """Why a schedule in a V (ZBV, DualPipeV) refuses ``virtual_stages``, or None."""
    if virtual_stages == 2:
        return None
    return (
        f"schedule {schedule} runs exactly 2 stages on each device group (in a V), but "
        f"virtual_stages={virtual_stages}; use virtual_stages=2, or {Schedule.ZERO_BUBBLE} "
        "for other counts"
    )


FORWARD = "F"
BACKWARD = "B"  # the whole backward; split (ZeroBubble, ZBV), the input gradients alone
WEIGHT = "W"  # the weight gradients (ZeroBubble, ZBV)


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # FORWARD | BACKWARD | WEIGHT
    microbatch: int
    start: float  # seconds from the step's start, or slots
    end: float


Step = tuple[str, int, int]  # (kind, stage, microbatch)


def stage_order(
    schedule: str, num_stages: int, num_microbatches: int, stage: int
) -> tuple[tuple[str, int], ...]:
    """The (kind, microbatch) steps ``stage`` runs, in the order it runs them (one stage a
    device group: GPipe or 1F1B)."""
    forwards = [(FORWARD, m) for m in range(num_microbatches)]
    backwards = [(BACKWARD, m) for m in range(num_microbatches)]
    if schedule == Schedule.GPIPE:
        return (*forwards, *backwards)
    if schedule != Schedule.ONE_F_ONE_B:
        raise AutoplanError(f"schedule {schedule!r} is not known; use one of {tuple(Schedule)}")
    warmup = min(num_microbatches, num_stages - stage)
    order = forwards[:warmup]
    for b, f in zip(backwards, forwards[warmup:], strict=False):
        order += [b, f]
    return (*order, *backwards[num_microbatches - warmup :])


def group_order(
    schedule: str, num_stages: int, num_microbatches: int, group: int, virtual_stages: int = 1
) -> tuple[Step, ...]:
    """The (kind, stage, microbatch) steps device group ``group`` runs, in order: its one
    stage's (`stage_order`), or under Interleaved1F1B its ``virtual_stages`` chunks' as torch's
    ScheduleInterleaved1F1B orders them (its ``_get_1f1b_rank_ops``, idle slots left out);
    under ZeroBubble, ZBV and DualPipeV, torch's order itself."""
    if schedule == Schedule.ZBV:
        return tuple(zbv_order(num_stages // 2, num_microbatches, group))
    if schedule == Schedule.DUALPIPE_V:
        return tuple(dualpipev_order(num_stages // 2, num_microbatches, group))
    if schedule == Schedule.ZERO_BUBBLE:
        groups = num_stages // virtual_stages
        return tuple(zero_bubble_order(groups, virtual_stages, num_microbatches, group))
    if schedule != Schedule.INTERLEAVED:
        one = stage_order(schedule, num_stages, num_microbatches, group)
        return tuple((kind, group, m) for kind, m in one)
    v, groups, count = virtual_stages, num_stages // virtual_stages, num_microbatches
    per_round = count // max(1, count // groups)
    warmup = min((v - 1) * per_round + 2 * (groups - 1 - group), count * v)
    steady = count * v - warmup

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * groups + group

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * groups + group

    done = {FORWARD: [0] * num_stages, BACKWARD: [0] * num_stages}
    order: list[Step] = []

    def run(kind: str, stage: int) -> None:
        order.append((kind, stage, done[kind][stage]))
        done[kind][stage] += 1

    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            run(FORWARD, forward_stage(op))
        if op >= warmup:
            run(BACKWARD, backward_stage(op))
    return tuple(order)


def peak_in_flight(
    order: Sequence[Step],
    activation: Callable[[int], float],
    held: Callable[[int], float] = lambda _: 0.0,
) -> float:
    """The most activations a device group holds at once running ``order``: each stage's
    ``activation(stage)`` for every microbatch it has run forward and not yet its last
    backward step (``W`` where the order has them); from a microbatch's ``B`` to its ``W``,
    also ``held(stage)``, the output gradients its weight gradients read."""
    split = any(kind == WEIGHT for kind, _, _ in order)
    now = peak = 0.0
    for kind, stage, _ in order:
        if kind == FORWARD:
            now += activation(stage)
        elif kind == WEIGHT:
            now -= activation(stage) + held(stage)
        else:
            now += held(stage) if split else -activation(stage)
        peak = max(peak, now)
    return peak


def simulate(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    durations: Sequence[tuple[float, float]] | None = None,
    speed: Callable[[int], float] | None = None,
    virtual_stages: int = 1,
    weight_shares: Sequence[float] | None = None,
) -> tuple[Event, ...]:
    """Every step of one training step, by start time then stage. ``durations`` gives each
    stage's (forward, backward) time per microbatch; without it every step takes one slot.
    ``speed(n)``: the speed of each of ``n`` device groups running at once (default 1.0).
    ``weight_shares``: split (ZeroBubble, ZBV), each stage's share of its backward that is ``W``
    (default a half; the first stage's ``B`` takes none, its ``W`` all). Each device group
    (`group_order`) runs one step at a time."""
    if durations is None:
        times = [(1.0, 1.0, 1.0)] * num_stages
    else:
        split = schedule in SPLIT_BACKWARD
        shares = [0.0] * num_stages if not split else weight_shares or [0.5] * num_stages
        times = [(f, b * (1 - w), b * w) for (f, b), w in zip(durations, shares, strict=True)]
        if split:  # torch runs the first stage's backward at W
            times[0] = (times[0][0], 0.0, durations[0][1])
    assert len(times) == num_stages, (len(times), num_stages)
    num_groups = num_stages // virtual_stages
    orders = [
        group_order(schedule, num_stages, num_microbatches, g, virtual_stages)
        for g in range(num_groups)
    ]
    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end
    done = [0] * num_groups  # steps of each group's order finished so far
    running: dict[int, tuple[float, float]] = {}  # group -> (its step's start, work left)
    events: list[Event] = []
    now = 0.0
    while True:
        for g, order in enumerate(orders):
            if g in running or done[g] == len(order):
                continue
            kind, s, m = order[done[g]]
            source = s - 1 if kind == FORWARD else s + 1 if kind == BACKWARD else -1
            if 0 <= source < num_stages and (kind, source, m) not in ends:
                continue  # its input is not computed yet
            running[g] = (now, times[s][(FORWARD, BACKWARD, WEIGHT).index(kind)])
        if not running:
            break
        rate = 1.0 if speed is None else speed(len(running))
        step = min(left for _, left in running.values()) / rate
        now += step
        for g, (start, left) in list(running.items()):
            left -= step * rate
            if left > 1e-12 * max(1.0, now):
                running[g] = (start, left)
                continue
            kind, s, m = orders[g][done[g]]
            ends[(kind, s, m)] = now
            events.append(Event(s, kind, m, start, now))
            done[g] += 1
            del running[g]
    assert done == [len(o) for o in orders], "a schedule's orders never deadlock"
    return tuple(sorted(events, key=lambda e: (e.start, e.stage)))

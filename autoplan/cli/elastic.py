"""Elastic `autoplan run`: a job that goes on after a rank or a node is lost.

torchrun restarts a job's processes when one fails (``--max-restarts``) and, with a range of
nodes (``--nnodes MIN:MAX``, c10d rendezvous), on the nodes that are left: each node's agent
waits for a new rendezvous, and a node that stopped sending keep-alives is dropped from it.
The world is only as elastic as the nodes: one agent always starts its ``--nproc`` processes,
so a rank killed on a node that lives restarts on the same world, and the world shrinks by a
lost node's processes. Every start is a fresh one on every rank: it reads the world size
torchrun gives it, takes the plan given for that world (else plans for it), and resumes from
the newest intact checkpoint, which DCP reshards into the new plan
(`autoplan.execute.checkpoint`); ``--steps`` counts from the beginning, so it trains on to
the same end.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Nodes:
    """How many nodes a job runs on: torchrun's ``--nnodes MIN:MAX`` (``min == max``: a fixed
    number)."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        """The job goes on with fewer nodes (down to ``min``) when one is lost."""
        return self.min < self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else f"{self.min}"


ONE_NODE = Nodes(1, 1)


def nodes(text: str) -> Nodes:
    """An argparse type: ``N`` or ``MIN:MAX``, 1 <= MIN <= MAX."""
    low, sep, high = text.partition(":")
    try:
        found = Nodes(int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write a number of nodes, or MIN:MAX for an elastic job, e.g. 2:4"
        ) from None
    if not 1 <= found.min <= found.max:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 <= MIN <= MAX, e.g. 2:4")
    return found


def may_restart(nodes: Nodes, max_restarts: int) -> bool:
    """The job's processes may start again: after a failure, or when a node is lost or joins."""
    return max_restarts > 0 or nodes.elastic


def plan_for_world(worlds: Mapping[str, int], world: int) -> tuple[str | None, str | None]:
    """Of the plan files given (each file -> the number of devices it is for), the one for a
    job of ``world`` processes, and a line to say why none is used (None when none is given or
    one fits): a plan for another world is planned anew."""
    for path, size in worlds.items():
        if size == world:
            return path, None
    if not worlds:
        return None, None
    given = ", ".join(f"{path} ({size} devices)" for path, size in worlds.items())
    return None, (
        f"no plan given is for the {world} processes this job has now ({given}): "
        f"planning for {world} instead"
    )

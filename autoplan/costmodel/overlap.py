"""How much of a step's gradient synchronization its backward hides, as the executor issues it.

The executor reduces each gradient as soon as backward has accumulated it, asynchronously
(`autoplan.execute.gradients.GradientReducer.on_arrival`, as DDP's reducer does): a bucket's
all-reduce once all its gradients are in and every earlier bucket was issued (each rank issues
them in the plan's order), any other gradient's reduction (ZeRO's reduce-scatter) on arrival;
it waits for them all when backward ends. On GPUs a collective runs on its own stream while
the rest of backward computes, so the step pays only what outlasts backward:

    backward runs its ops in reverse graph order, op k ending at   b_k = sum_{j >= k} t_j
    (t_j: op j's backward compute and the collectives it blocks on, `backward_timeline`)
    a gradient is ready when its last-in-backward user ends:     r = b_(first user)
    the collectives go one after another, in the order issued:   e_i = max(e_(i-1), r_i) + d_i
    exposed = max(0, e_last - B),  hidden = sum(d_i) - exposed  (B: the backward's end)

A pipeline reduces its gradients after its schedule (`GradientReducer.reduce_now`), and CPU
ranks (gloo) do a collective's copies and sums on the cores that compute: neither hides any
(`autoplan.costmodel.step_price.price_step` prices no overlap there). Collectives that block
backward (a tensor-parallel gradient's all-reduce) are priced on its timeline, not as
competing for the link with the buckets' (they mostly ride another link: NVLink, not the
network).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["AsyncReduction", "backward_timeline", "hidden_s"]


@dataclass(frozen=True)
class AsyncReduction:
    """One asynchronous gradient collective: when backward has made all it reduces (seconds
    from backward's start) and how long it takes."""

    ready_s: float
    seconds: float


def backward_timeline(order: Sequence[str], seconds: Mapping[str, float]) -> dict[str, float]:
    """When each node's backward ends, in seconds from backward's start: ``order`` is the
    graph order (backward runs it reversed), ``seconds`` each node's backward time with the
    collectives it blocks on (absent: 0)."""
    ends: dict[str, float] = {}
    t = 0.0
    for name in reversed(order):
        t += seconds.get(name, 0.0)
        ends[name] = t
    return ends


def hidden_s(backward_s: float, issued: Sequence[AsyncReduction]) -> float:
    """Seconds of ``issued`` (in the order the executor issues them) that run while a backward
    of ``backward_s`` seconds computes: their sum less what ends after it."""
    end = 0.0
    for c in issued:
        end = max(end, c.ready_s) + c.seconds
    exposed = max(0.0, end - backward_s)
    return sum(c.seconds for c in issued) - exposed

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

ZeRO-1/2's gathers of the updated parameters run while the next step's forward computes
(`autoplan.execute.sharded_state.ShardedState.gather`, as Megatron's --overlap-param-gather):
issued after the optimizer step, one after another in the parameters' order, each waited for
by the first op that reads its parameter, so forward stalls only where a gather is not done:

    gather i ends at                    g_i = g_(i-1) + d_i
    op k starts at                      s_k = max(s_(k-1) + f_(k-1), g of what it reads)
    exposed = end of forward - sum(f_k),  hidden = sum(d_i) - exposed    (`forward_hidden_s`)

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

__all__ = ["AsyncReduction", "backward_timeline", "forward_hidden_s", "hidden_s"]


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


def forward_hidden_s(
    forward: Sequence[tuple[float, Sequence[int]]], gathers: Sequence[float]
) -> float:
    """Seconds of ``gathers`` (in the order issued, all at forward's start) that run while a
    forward computes: ``forward`` its ops in order, each as (seconds, the indices of the
    gathers it waits for). The forward waits at its end for any gather still running."""
    ends: list[float] = []
    for seconds in gathers:
        ends.append((ends[-1] if ends else 0.0) + seconds)
    clock = busy = 0.0
    for seconds, waits in forward:
        clock = max([clock, *(ends[i] for i in waits)]) + seconds
        busy += seconds
    clock = max(clock, ends[-1] if ends else 0.0)  # any left are waited for at its end
    return sum(gathers) - (clock - busy)

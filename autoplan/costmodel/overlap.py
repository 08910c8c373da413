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
by the first op that reads its parameter, so forward stalls only where a gather is not done.
ZeRO-3's gathers of the parameters stored split (`autoplan.execute.interpreter`, as FSDP2
prefetches) are issued ahead too: those read outside recomputed layers at forward's start
(their copies are kept for backward anyway, so issuing them early holds no more at the peak),
those a recomputed layer reads at its region's start, then all on the same link:

    gather i, issued as forward reaches op a_i, ends at   g_i = max(g_(i-1), s_(a_i)) + d_i
    op k starts at                      s_k = max(s_(k-1) + f_(k-1), g of what it reads)
    exposed = end of forward - sum(f_k),  hidden = sum(d_i) - exposed    (`forward_hidden_s`)

A recomputed layer's gathers, issued again as backward reaches its region, join the
gradients' reductions on that link (`hidden_s`): the backward ops are not priced as waiting
for them, only the link as busy.

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

__all__ = ["AsyncGather", "AsyncReduction", "backward_timeline", "forward_hidden_s", "hidden_s"]


@dataclass(frozen=True)
class AsyncReduction:
    """One asynchronous gradient collective: when backward has made all it reduces (seconds
    from backward's start) and how long it takes."""

    ready_s: float
    seconds: float


@dataclass(frozen=True)
class AsyncGather:
    """One parameter gather left in flight: issued as forward reaches its op of index
    ``issued_at`` (0: at forward's start), and how long it takes."""

    issued_at: int
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
    forward: Sequence[tuple[float, Sequence[int]]], gathers: Sequence[AsyncGather]
) -> float:
    """Seconds of ``gathers`` (in the order issued, each as forward reaches its op) that run
    while a forward computes: ``forward`` its ops in order, each as (seconds, the indices of
    the gathers it waits for, issued at or before it). The forward waits at its end for any
    gather still running."""
    ends: list[float] = []
    link = clock = busy = 0.0  # when the link is free; when the last op ended
    for k, (seconds, waits) in enumerate(forward):
        while len(ends) < len(gathers) and gathers[len(ends)].issued_at <= k:
            link = max(link, clock) + gathers[len(ends)].seconds
            ends.append(link)
        clock = max([clock, *(ends[i] for i in waits)]) + seconds
        busy += seconds
    for gather in gathers[len(ends) :]:  # issued past the last op
        link = max(link, clock) + gather.seconds
    clock = max(clock, link)  # any left are waited for at its end
    return sum(g.seconds for g in gathers) - (clock - busy)

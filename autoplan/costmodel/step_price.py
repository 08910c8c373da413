"""A step's price on one logical mesh, recomputed from a strategy assignment node by node and
edge by edge (no decision groups, no ILP).

It is what a plan reports, whichever way its strategies were found: the intra-op ILP
(`autoplan.search.intra_op`), a pipeline stage's layers (`autoplan.costmodel.pipeline_price`), a
baseline's fixed strategies, or a plan read back to re-price (`autoplan.estimate`). Times are
seconds per step (per microbatch for a pipeline stage); memory is bytes per device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from autoplan.costmodel.held import saved_copies
from autoplan.costmodel.overlap import (
    AsyncGather,
    AsyncReduction,
    backward_timeline,
    forward_hidden_s,
    hidden_s,
)
from autoplan.costmodel.peak import peak_bytes
from autoplan.costmodel.pricer import Phased, Pricer
from autoplan.graph.ir import Graph
from autoplan.modes import NodeKind, Phase
from autoplan.strategies.buckets import GRADIENTS, GradientSync, make_buckets
from autoplan.strategies.placement import P, Spec
from autoplan.strategies.space import Strategy, input_grad
from autoplan.strategies.zero_state import param_gathered_dtype


@dataclass(frozen=True)
class OpPrice:
    """One node's share of a step's price: what `autoplan show --top` ranks."""

    node: str
    compute_s: float  # forward + backward (a parameter: its optimizer update)
    # the collectives it causes: its inputs' redistributions (forward, recomputed forward),
    # their gradients' (backward) and its own (`Pricer.internal`); not the buckets'
    comm_s: float
    memory_bytes: float  # an op: what backward keeps of it; a parameter: with grad, state


@dataclass(frozen=True)
class StepRest:
    """What a step's price holds beyond its ops' (`OpPrice`): the ops' shares and these sum
    to `PricedStep`'s compute, communication and memory."""

    host_s: float = 0.0  # compute: the host issuing ops past the device's compute (GPUs)
    waits_s: float = 0.0  # communication: the waits for the ranks' skew (`Pricer.sync_s`)
    gradients_s: float = 0.0  # communication: the gradient buckets and syncs, once per step
    # of gradients_s, what runs while backward computes, and of the ZeRO gathers (the ops'
    # comm_s: ZeRO-1/2's after the update, ZeRO-3's issued ahead), what runs while forward
    # does (`autoplan.costmodel.overlap`): the step's time leaves it out
    hidden_s: float = 0.0
    transient_bytes: float = 0.0  # memory: the largest recomputed layer's, in its backward
    # memory, subtracted: what the ops' sum counts that the step never holds at once (the
    # gradients not yet made while backward's tensors are kept; `autoplan.costmodel.peak`)
    unheld_bytes: float = 0.0
    # not in the memory sum (the ILP's), but in the peak: the saved inputs read moved, kept
    # as copies, less the outputs they leave unkept (`autoplan.costmodel.held`)
    copied_bytes: float = 0.0
    # memory: the gradient buckets' buffers, held throughout, as the ILP estimates them
    bucket_bytes: float = 0.0


@dataclass(frozen=True)
class PricedStep:
    """Costs recomputed node by node and edge by edge from an assignment (no grouping)."""

    compute_s: float
    comm_s: float
    memory_bytes: float
    collectives: tuple[tuple[str, str, Phased], ...]  # (consumer, producer, collective)
    # of memory_bytes, what the largest recomputed layer holds while its backward runs: once
    # per stage, however many microbatches are in flight
    recompute_bytes: float = 0.0
    ops: tuple[OpPrice, ...] = ()  # by node, in graph order
    rest: StepRest = StepRest()

    @property
    def time_s(self) -> float:
        """The step's time: its compute and its communication, less the gradient
        synchronization that backward hides and the ZeRO gathers that forward hides
        (`StepRest.hidden_s`)."""
        return self.compute_s + self.comm_s - self.rest.hidden_s

    @property
    def peak_bytes(self) -> float:
        """The most it holds at once: `memory_bytes` counts every gradient and every tensor
        backward keeps together, as a pipeline stage's microbatches may (and the ILP does),
        but not the saved inputs kept as copies (`StepRest.copied_bytes`)."""
        return self.memory_bytes + self.rest.copied_bytes - self.rest.unheld_bytes


def summed_gradient(a: Spec | None, b: Spec | None) -> Spec | None:
    """The placement of two users' gradients of one tensor, read in one placement, summed:
    partial on an axis where either is (a replicated input's user whose output is split
    sends a partial sum; its sum with a whole gradient is still partial)."""
    if a is None or b is None:
        return a or b
    return tuple(P if P in (x, y) else x for x, y in zip(a, b, strict=True))


def price_step(graph: Graph, assignment: Mapping[str, Strategy], pricer: Pricer) -> PricedStep:
    """The step as the executor runs it: each tensor redistributed once per placement its
    users need; in backward, the gradients of those users summed and reduced once per such
    placement. The step waits for the ranks' skew (`Pricer.sync_s`) once per op whose inputs
    are redistributed, once per tensor whose gradient is, and once for the parameters'
    gradients (`Pricer.gradients_s`). On GPUs the compute takes at least the host's work to
    issue the ops (`Pricer.host_time`), which runs ahead while the GPU computes, and the
    gradients' reductions run while the rest of backward computes, as the executor issues
    them, and ZeRO-1/2's gathers of the updated parameters (in their working dtype,
    `param_gathered_dtype`) and ZeRO-3's of the parameters stored split, issued ahead, while
    forward computes (`autoplan.costmodel.overlap`; none on CPU ranks, whose cores do both).

    Recomputed ops (`Pricer.recompute`) keep only the outputs that leave their layer; the
    others are alive only while their layer's backward runs, so the step holds those of its
    largest recomputed layer. The forward redistributions of an op of a recomputed layer (saved
    or not) that is the first to need them are issued again in backward (phase "recompute")."""
    compute = memory = comm = host = 0.0
    recompute = pricer.recompute
    backward: dict[str, float] = {}  # by node: its backward, with the collectives it blocks on
    forward: dict[str, float] = {}  # by node: its forward, with the redistributions it waits for
    gathers: dict[str, float] = {}  # by ZeRO-1/2 parameter, in graph order: after the update
    # by node: [compute, communication, memory]
    shares: dict[str, list[float]] = {n.name: [0.0, 0.0, 0.0] for n in graph}
    dropped: dict[int, float] = defaultdict(float)  # by recomputed layer
    found: list[tuple[str, str, Phased]] = []
    # (tensor, placement needed) -> (first user, input index, the gradient's placement or None)
    needs: dict[tuple[str, int, Spec], tuple[str, int, Spec | None]] = {}
    prefetched: list[tuple[str, float]] = []  # ZeRO-3's gathers: (first user, seconds)
    regathered: list[tuple[str, float]] = []  # and those issued again in backward
    for node in graph:
        s = assignment[node.name]
        share = shares[node.name]
        share[0] = pricer.node_time(node, s)
        compute += share[0]
        backward[node.name] = pricer.backward_time(node, s)
        forward[node.name] = pricer.forward_time(node, s)
        host += pricer.host_time(node)
        if recompute.drops(node.name):
            dropped[recompute.layer_of[node.name]] += pricer.activation_memory(node, s)
        else:
            share[2] = pricer.node_memory(node, s)
            memory += share[2]
        ins = tuple(graph.tensor(r) for r in node.refs)
        gathered = param_gathered_dtype(graph, node.name) if node.kind == NodeKind.PARAM else None
        share[1] = pricer.internal_time(node, s, ins, gathered)
        comm += share[1]
        found += [(node.name, node.name, p) for p in pricer.internal(node, s, ins, gathered)]
        if node.kind == NodeKind.PARAM and s.state is not None:
            gathers[node.name] = share[1]
        for i, ref in enumerate(node.refs):
            grad = input_grad(node, s, i) if graph.node(ref.name).needs_grad else None
            key = (ref.name, ref.index, s.inputs[i])
            if key in needs:  # the users' gradients are summed, then reduced once
                user, at, summed = needs[key]
                needs[key] = (user, at, summed_gradient(summed, grad))
            else:
                needs[key] = (node.name, i, grad)
    syncs: dict[str, list[tuple[str, GradientSync]]] = defaultdict(list)  # in first-use order
    waits: set[tuple[str, str]] = set()  # where the step blocks: (phase, op or tensor)

    def blocks(user: str, seconds: float, wait: tuple[str, str]) -> None:
        """``seconds`` of collectives that ``user``'s backward waits for."""
        backward[user] += seconds + (pricer.sync_s if wait not in waits else 0.0)
        waits.add(wait)

    for (name, index, _), (user, i, grad) in needs.items():
        producer, tensor = graph.node(name), graph.node(name).outputs[index]
        seconds, fwd = pricer.forward(tensor, assignment[name], assignment[user], i)
        comm += seconds
        shares[user][1] += seconds
        found += [(user, name, Phased(c, Phase.FORWARD)) for c in fwd]
        gather = bool(fwd) and producer.kind == NodeKind.PARAM  # issued ahead, in flight
        if gather:
            prefetched.append((user, seconds))
        else:
            forward[user] += seconds
        if fwd:
            waits.add(("forward", user))
            if recompute.reruns(user):
                comm += seconds
                shares[user][1] += seconds
                found += [(user, name, Phased(c, Phase.RECOMPUTE)) for c in fwd]
                if gather:
                    regathered.append((user, seconds))
                    waits.add(("recompute", user))
                else:
                    blocks(user, seconds, ("recompute", user))
        if grad is None:
            continue
        seconds, bwd = pricer.gradient(tensor, grad, assignment[name])
        if producer.kind == NodeKind.PARAM:
            syncs[name].append((user, GradientSync(name, tensor.dtype, bwd)))
            continue
        comm += seconds
        shares[user][1] += seconds
        found += [(user, name, Phased(c, Phase.BACKWARD)) for c in bwd]
        if bwd:
            blocks(user, seconds, ("backward", name))
    # a gradient reduced once, by all-reduces alone, goes into a bucket; the others (ZeRO's
    # reduce-scatters, a parameter used in several placements) are reduced one by one
    bucketed: list[GradientSync] = []
    gradients: list[tuple[str, str, Phased]] = []
    ends = backward_timeline([n.name for n in graph], backward)
    issued: list[AsyncReduction] = []  # the reductions as backward issues them
    for name, entries in syncs.items():
        if len(entries) == 1 and entries[0][1].bucket_axes is not None:
            bucketed.append(entries[0][1])
            continue
        for user, sync in entries:
            own = [Phased(c, Phase.GRAD_SYNC) for c in sync.collectives]
            gradients += [(user, name, p) for p in own]
            issued.append(AsyncReduction(ends[user], sum(pricer.phased_s(p) for p in own)))
    ready = 0.0  # a bucket is issued once its gradients are in and the earlier buckets issued
    buckets = make_buckets(bucketed[::-1])
    for i, bucket in enumerate(buckets):
        phased = Phased(bucket.collective, Phase.GRAD_SYNC, bucket.params)
        gradients.append((GRADIENTS, f"bucket{i}", phased))
        ready = max([ready, *(ends[syncs[p][0][0]] for p in bucket.params)])
        issued.append(AsyncReduction(ready, pricer.phased_s(phased)))
    synced = pricer.gradients_s([p for _, _, p in gradients])
    hidden = 0.0
    if pricer.cluster.backend != "gloo" and graph.nodes:
        position = {n.name: i for i, n in enumerate(graph)}
        regions = [[position[o] for o in ops if o in position] for _, _, ops in recompute.layers]
        for user, seconds in regathered:  # issued as backward reaches the region
            last = graph.nodes[max(regions[recompute.layer_of[user]])].name
            issued.append(AsyncReduction(ends[last] - backward[last], seconds))
        issued.sort(key=lambda c: c.ready_s)  # stable: buckets in plan order
        hidden = hidden_s(ends[graph.nodes[0].name], issued)
        hidden += forward_hidden_s(*_forward_gathers(graph, forward, gathers, prefetched, regions))
    comm += synced
    found += gradients
    comm += len(waits) * pricer.sync_s
    transient = max(dropped.values(), default=0.0)
    ops = tuple(OpPrice(name, *share) for name, share in shares.items())
    held = peak_bytes(graph, assignment, pricer, buckets)
    copies = saved_copies(graph, assignment, pricer)
    copied = sum(copies.made.values()) - sum(copies.unkept.values())
    # the buckets' buffers as the ILP estimates them (`Pricer.bucket_memory`): the memory
    # sum stays the ILP's; the peak counts the buckets made
    buffers = sum(pricer.bucket_memory(n, assignment[n.name]) for n in graph)
    memory += transient + buffers
    rest = StepRest(
        max(0.0, host - compute),
        len(waits) * pricer.sync_s,
        synced,
        hidden,
        transient,
        memory + copied - held,
        copied,
        buffers,
    )
    return PricedStep(max(compute, host), comm, memory, tuple(found), transient, ops, rest)


def _forward_gathers(
    graph: Graph,
    forward: Mapping[str, float],
    updated: Mapping[str, float],
    prefetched: list[tuple[str, float]],
    regions: list[list[int]],
) -> tuple[list[tuple[float, list[int]]], list[AsyncGather]]:
    """The forward's ops (their seconds, the gathers each waits for) and its gathers in the
    order the executor issues them: ZeRO-1/2's (``updated``, by parameter) after the update,
    then ZeRO-3's (``prefetched``: first user, seconds), those read outside recomputed layers
    at forward's start, a recomputed layer's (``regions``: its ops' indices) at its first op."""
    order = {name: i for i, name in enumerate(updated)}
    gathers = [AsyncGather(0, seconds) for seconds in updated.values()]
    waiting = {n.name: [order[r.name] for r in n.refs if r.name in order] for n in graph}
    region_start = {graph.nodes[k].name: min(ops) for ops in regions for k in ops}
    ahead = [(region_start.get(user, 0), user, seconds) for user, seconds in prefetched]
    for at, user, seconds in sorted(ahead, key=lambda g: g[0]):  # stable: first-use order
        waiting[user].append(len(gathers))
        gathers.append(AsyncGather(at, seconds))
    return [(forward[n.name], waiting[n.name]) for n in graph], gathers

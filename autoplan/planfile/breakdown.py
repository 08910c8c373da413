"""Where a plan's time and memory go: its predicted price op by op and layer by layer, compute
against communication, as `autoplan show --top` prints it.

The shares come from re-pricing the plan (`autoplan.estimate.price_stages_ops`, one
`PricedStep` per stage); the ops' shares and the step's rest (`StepRest`: the host's issue
time, the waits for the ranks' skew, the gradient buckets, a recomputed layer's transient
activations) add up to the plan's predicted compute, communication and memory. In a pipeline
they are per microbatch, all stages together, as the plan's totals are.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoplan.modes import NodeKind
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import fmt_bytes, fmt_time

if TYPE_CHECKING:
    from autoplan.costmodel.step_price import PricedStep

NO_MODULE = "(no module)"
_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # "blocks.3.attn.c_attn" -> "blocks.3"


@dataclass(frozen=True)
class OpCost:
    """One node's share of the plan's price."""

    node: str
    op: str  # "aten.mm.default", "param", ...; a stage's "received" inputs, its "send" output
    layer: str  # "blocks.3", a top-level module ("head"), or NO_MODULE (the loss, inputs)
    stage: int
    compute_s: float  # forward + backward; a parameter's: its optimizer update
    comm_s: float  # the collectives it causes (`autoplan.costmodel.step_price.OpPrice`)
    memory_bytes: float  # what backward keeps of an op; a parameter's with grad and state
    collectives: str  # "all_reduce 2x 1.00 MiB" ..., empty for none

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class Breakdown:
    ops: tuple[OpCost, ...]  # in graph order, stage by stage
    host_s: float
    waits_s: float
    gradients_s: float
    transient_bytes: float
    unheld_bytes: float  # subtracted: the ops' memory never held at once (`StepRest`)
    per_microbatch: bool  # a pipeline's: one microbatch's, all stages together
    copied_bytes: float = 0.0  # saved inputs read moved, kept as copies (`StepRest`)
    bucket_bytes: float = 0.0  # the gradient buckets' buffers

    @property
    def compute_s(self) -> float:
        return sum(o.compute_s for o in self.ops) + self.host_s

    @property
    def comm_s(self) -> float:
        return sum(o.comm_s for o in self.ops) + self.waits_s + self.gradients_s

    @property
    def memory_bytes(self) -> float:
        beyond = self.transient_bytes + self.copied_bytes + self.bucket_bytes
        return sum(o.memory_bytes for o in self.ops) + beyond - self.unheld_bytes


def layer_of(module: str) -> str:
    """The layer a module path belongs to: its first indexed block ("blocks.3"), else its
    top-level module, else `NO_MODULE`."""
    found = _LAYER.match(module)
    if found:
        return found.group(1)
    return module.split(".")[0] or NO_MODULE


def _collectives(plan: Plan, stage: int, node: str) -> str:
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for c in plan.collectives:
        if c.node == node and c.stage == stage:
            found[c.kind][0] += 1
            found[c.kind][1] += c.bytes
    return ", ".join(
        f"{kind} {count}x {fmt_bytes(nbytes)}" for kind, (count, nbytes) in sorted(found.items())
    )


def breakdown(plan: Plan, steps: Sequence[PricedStep]) -> Breakdown:
    """``plan``'s price by op from its stages' `PricedStep`s (one without pipelining)."""
    ops = []
    for s, step in enumerate(steps):
        stage = plan.stages[s]
        own = set(stage.nodes)
        for price in step.ops:
            # a stage's graph holds what it receives, as inputs named by their producers, and
            # what it sends, as its output
            node = plan.nodes[price.node] if price.node in own else None
            if node is not None:
                op, module = node.op, node.module
            else:
                op, module = "received" if price.node in stage.received else "send", ""
            ops.append(
                OpCost(
                    node=price.node,
                    op=op,
                    layer=layer_of(module),
                    stage=s,
                    compute_s=price.compute_s,
                    comm_s=price.comm_s,
                    memory_bytes=price.memory_bytes,
                    collectives=_collectives(plan, s, price.node),
                )
            )
    return Breakdown(
        ops=tuple(ops),
        host_s=sum(st.rest.host_s for st in steps),
        waits_s=sum(st.rest.waits_s for st in steps),
        gradients_s=sum(st.rest.gradients_s for st in steps),
        transient_bytes=sum(st.rest.transient_bytes for st in steps),
        unheld_bytes=sum(st.rest.unheld_bytes for st in steps),
        per_microbatch=plan.pipeline is not None,
        copied_bytes=sum(st.rest.copied_bytes for st in steps),
        bucket_bytes=sum(st.rest.bucket_bytes for st in steps),
    )


def top_ops(b: Breakdown, n: int) -> list[OpCost]:
    """The ``n`` ops that take most time (compute + communication), most first; ties in
    graph order."""
    ranked = sorted(range(len(b.ops)), key=lambda i: (-b.ops[i].time_s, i))
    return [b.ops[i] for i in ranked[:n] if b.ops[i].time_s > 0 or b.ops[i].memory_bytes > 0]


def by_layer(b: Breakdown) -> list[OpCost]:
    """The ops' shares summed per layer (``op``: how many ops), most time first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for o in b.ops:
        t = sums[o.layer]
        t[0] += o.compute_s
        t[1] += o.comm_s
        t[2] += o.memory_bytes
        t[3] += o.op not in (NodeKind.PARAM, NodeKind.INPUT, NodeKind.OUTPUT, "received", "send")
    layers = [
        OpCost(name, f"{int(t[3])} ops", name, -1, t[0], t[1], t[2], "") for name, t in sums.items()
    ]
    return sorted(layers, key=lambda o: -o.time_s)


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _rows(ops: Sequence[OpCost], total_s: float, with_collectives: bool) -> list[list[str]]:
    rows = []
    for o in ops:
        row = [
            o.node,
            o.op.removeprefix("aten.").removesuffix(".default"),
            o.layer,
            fmt_time(o.compute_s),
            fmt_time(o.comm_s),
            _share(o.time_s, total_s),
            fmt_bytes(o.memory_bytes),
        ]
        rows.append([*row, o.collectives] if with_collectives else row)
    return rows


def _table(header: Sequence[str], rows: list[list[str]], left: int) -> list[str]:
    """``rows`` under ``header``, columns from ``left`` on right-aligned but the last text
    column (collectives)."""
    rows = [list(header), *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return [
        "  "
        + "  ".join(
            f"{c:<{w}}" if i < left or header[i] == "collectives" else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def top_lines(plan: Plan, b: Breakdown, n: int) -> list[str]:
    """Text: the ``n`` costliest ops, every layer's sum (the ``n`` costliest), the step's
    rest, and the totals against the plan's predicted ones."""
    total = b.compute_s + b.comm_s
    per = "per microbatch, all stages" if b.per_microbatch else "per step"
    head = ["op", "kind", "layer", "compute", "comm", "time", "kept"]
    out = [
        f"where the time goes ({per}; compute: forward + backward, comm: the collectives the "
        "op causes, kept: what backward keeps of it; a parameter's: its update and state):",
        *_table([*head, "collectives"], _rows(top_ops(b, n), total, True), 3),
        "",
        f"by layer ({min(n, len(by_layer(b)))} of {len(by_layer(b))}):",
        *_table(
            ["layer", "ops", *head[3:]],
            [r[:2] + r[3:] for r in _rows(by_layer(b)[:n], total, False)],
            2,
        ),
        "",
        "beyond the ops:",
        f"  host issuing ops beyond the compute  {fmt_time(b.host_s)}",
        f"  waits for the ranks' skew            {fmt_time(b.waits_s)}",
        f"  gradient buckets and syncs           {fmt_time(b.gradients_s)}",
        f"  a recomputed layer in its backward   {fmt_bytes(b.transient_bytes)}",
        f"  saved inputs kept as read, moved     {fmt_bytes(b.copied_bytes)}",
        f"  gradient buckets' buffers            {fmt_bytes(b.bucket_bytes)}",
        f"  {'not held at once (subtracted)':<37}{fmt_bytes(b.unheld_bytes)}",
        "",
        f"sums: compute {fmt_time(b.compute_s)}, communication {fmt_time(b.comm_s)}; "
        f"plan predicts {fmt_time(plan.predicted.compute_s)}, "
        f"{fmt_time(plan.predicted.comm_s)}",
    ]
    if not b.per_microbatch:
        out.append(
            f"memory: {fmt_bytes(b.memory_bytes)}; plan predicts "
            f"{fmt_bytes(plan.predicted.peak_memory_bytes)} per device"
        )
    return out

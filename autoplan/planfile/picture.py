"""A pipelined plan as a picture: which ranks hold which layers, and the schedule as a Gantt
chart of forward and backward boxes per microbatch, to scale in the stages' predicted times;
and where a plan's time goes (`autoplan.planfile.breakdown`) as bars of compute and
communication, op by op and layer by layer.

matplotlib is imported when a picture is drawn, so that `import autoplan` stays fast, and
only its object API is used (no pyplot), so no backend or global state is touched.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from autoplan.errors import AutoplanError
from autoplan.planfile.breakdown import Breakdown, OpCost, by_layer, top_ops
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import Pipeline
from autoplan.planfile.show import fmt_bytes, fmt_ranks, fmt_time, stage_layers
from autoplan.schedules import FORWARD, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_ROW_INCHES = 0.45  # height of one stage's row, in each of the two panels


def render_png(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write a PNG of ``plan``'s stages and schedule to ``path``. Without the stages' predicted
    times (a hand-written plan), the schedule is drawn in equal slots."""
    from matplotlib.figure import Figure

    pipeline = plan.pipeline
    if pipeline is None:
        raise AutoplanError(
            f"the plan for cluster {plan.provenance.cluster!r} has no pipeline stages to draw; "
            "plan it with pipeline=True (or num_stages=N) to get some"
        )
    num_stages = len(plan.stages)
    fig = Figure(figsize=(12, 1.8 + 1.6 * _ROW_INCHES * (num_stages + 1)), layout="constrained")
    table_ax, gantt_ax = fig.subplots(2, 1, height_ratios=[0.6 * (num_stages + 1), num_stages + 1])
    fig.suptitle(
        f"{pipeline.schedule}: {num_stages} stages x {pipeline.num_microbatches} microbatches, "
        f"predicted step {fmt_time(plan.predicted.step_time_s)}, "
        f"bubble {100 * pipeline.bubble_fraction:.1f}%"
    )
    _draw_stages(table_ax, plan)
    _draw_schedule(gantt_ax, plan, pipeline)
    fig.savefig(os.fspath(path), format="png", dpi=120)


def _draw_stages(ax: Axes, plan: Plan) -> None:
    """A table: each stage's ranks, layers, times per microbatch and memory."""
    limit = plan.predicted.memory_limit_bytes
    rows = []
    for s, st in enumerate(plan.stages):
        p = st.predicted
        cost = (
            [
                fmt_time(p.forward_s),
                fmt_time(p.backward_s),
                f"{fmt_bytes(p.memory_bytes)} of {fmt_bytes(limit)}",
            ]
            if p is not None
            else ["-", "-", "-"]
        )
        rows.append([str(s), fmt_ranks(st.ranks), stage_layers(plan, st), *cost])
    ax.axis("off")
    ax.set_title("per microbatch: forward and backward times", fontsize=9, loc="left")
    table = ax.table(
        cellText=rows,
        colLabels=["stage", "ranks", "layers", "forward", "backward", "memory per device"],
        colWidths=[0.06, 0.1, 0.42, 0.12, 0.12, 0.18],
        loc="center",
        cellLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.3)


def _draw_schedule(ax: Axes, plan: Plan, pipeline: Pipeline) -> None:
    """A Gantt chart: a row per stage, a box per forward (light) and backward (hatched), in
    one color per microbatch."""
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    predicted = [st.predicted for st in plan.stages]
    durations = None
    if all(p is not None for p in predicted):
        durations = [(p.forward_s, p.backward_s) for p in predicted if p is not None]
    events = simulate(
        pipeline.schedule,
        len(plan.stages),
        pipeline.num_microbatches,
        durations,
        virtual_stages=plan.virtual_stages,
    )
    scale = 1e3 if durations is not None else 1.0  # seconds -> ms on the time axis
    tab20 = colormaps["tab20"]  # its dark colors for microbatches 0-9, then its light ones
    colors = [tab20(2 * m % 20 + m // 10 % 2) for m in range(pipeline.num_microbatches)]
    end = max(e.end for e in events) * scale
    for e in events:
        forward = e.kind == FORWARD
        ax.barh(
            e.stage,
            (e.end - e.start) * scale,
            left=e.start * scale,
            height=0.8,
            color=colors[e.microbatch],
            alpha=0.55 if forward else 1.0,
            hatch=None if forward else "//",
            edgecolor="black",
            linewidth=0.5,
        )
        if (e.end - e.start) * scale > end / 60:  # room for the label
            ax.text(
                (e.start + e.end) / 2 * scale,
                e.stage,
                f"{e.kind}{e.microbatch}",
                ha="center",
                va="center",
                fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1, "alpha": 0.8},
            )
    ax.set_yticks(
        range(len(plan.stages)),
        [f"stage {s}\nranks {fmt_ranks(st.ranks)}" for s, st in enumerate(plan.stages)],
    )
    ax.set_ylim(len(plan.stages) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, end)
    ax.set_xlabel(
        "time (ms): predicted forward and backward per microbatch; sends, gradient sync and "
        "optimizer not drawn"
        if durations is not None
        else "slots (no predicted times in the plan)"
    )
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[
            Patch(facecolor="lightgray", edgecolor="black", label="forward Fk"),
            Patch(facecolor="gray", edgecolor="black", hatch="//", label="backward Bk"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )


def render_top_png(plan: Plan, b: Breakdown, n: int, path: str | os.PathLike[str]) -> None:
    """Write a PNG of the ``n`` ops and layers of ``plan`` that take most time (`top_ops`,
    `by_layer`), each a bar of its compute and its communication, to ``path``."""
    from matplotlib.figure import Figure

    ops, layers = top_ops(b, n), by_layer(b)[:n]
    rows = max(len(ops), len(layers))
    fig = Figure(figsize=(13, 1.5 + 0.32 * rows), layout="constrained")
    ops_ax, layers_ax = fig.subplots(1, 2)
    per = "per microbatch, all stages" if b.per_microbatch else "per step"
    fig.suptitle(
        f"where the time goes ({per}): compute {fmt_time(b.compute_s)}, communication "
        f"{fmt_time(b.comm_s)}; predicted step {fmt_time(plan.predicted.step_time_s)}"
    )
    _draw_bars(ops_ax, ops, [f"{o.node} ({o.layer})" for o in ops], f"top {len(ops)} ops")
    _draw_bars(layers_ax, layers, [o.layer for o in layers], f"top {len(layers)} layers")
    fig.legend(*ops_ax.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)
    fig.savefig(os.fspath(path), format="png", dpi=120)


def _draw_bars(ax: Axes, costs: list[OpCost], labels: list[str], title: str) -> None:
    """A row per cost, most first: its compute, then its communication, in ms."""
    rows = range(len(costs))
    compute = [o.compute_s * 1e3 for o in costs]
    ax.barh(rows, compute, color="tab:blue", label="compute (forward + backward)")
    comm = [o.comm_s * 1e3 for o in costs]
    ax.barh(rows, comm, left=compute, color="tab:orange", label="communication")
    ax.set_yticks(rows, labels, fontsize=8)
    ax.set_ylim(len(costs) - 0.5, -0.5)  # the costliest on top
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)

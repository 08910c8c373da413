"""A plan as text a person reads: mesh, pipeline stages and schedule, parameter shardings,
collectives, predictions."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence

from autoplan.graph.flops import GROUPED_MMS
from autoplan.graph.recompute import FUSED_ATTENTION
from autoplan.modes import Precision
from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import ParamPlan, Pipeline, Placements, Stage
from autoplan.schedules import SPLIT_BACKWARD, V_SHAPED, simulate
from autoplan.strategies.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from autoplan.units import fmt_bytes

_INDEX = re.compile(r"\.(\d+)\.")
# export numbers the constants forward makes across the model (lifted_tensor_0, _1, ... in
# each layer): copies of one layer's constants share a line as its parameters do
_LIFTED = re.compile(r"lifted_tensor_\d+$")
_GRID_WIDTH = 100  # characters a line of the schedule grid may take before the grid wraps
_MAX_ROWS = 8  # stages the grid draws; beyond, the first and last halves
_MAX_SLOTS = 2 * (16 + 8 - 1)  # 1F1B's slots for 16 microbatches on 8 stages; beyond, the ends


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _fmt(p: Placements) -> str:
    return ", ".join(f"{axis}={v}" for axis, v in p.items())


def _param_lines(plan: Plan) -> list[str]:
    """One line per parameter; copies of a repeated layer with the same placements share one
    line, their index (and the number of a constant forward makes) written as ``*``."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in plan.params:
        pattern = _INDEX.sub(".*.", name, count=1)
        groups[_LIFTED.sub("lifted_tensor_*", pattern)].append(name)
    lines = []
    for pattern, names in groups.items():
        first = plan.params[names[0]]
        same = all(
            _placed(plan.params[n]) == _placed(first) and plan.params[n].shape == first.shape
            for n in names
        )
        for name in [pattern] if same and len(names) > 1 else names:
            p = plan.params[names[0] if name == pattern and len(names) > 1 else name]
            stored = "" if p.storage == p.placements else f"   stored [{_fmt(p.storage)}]"
            if p.state:
                stored += f"   ZeRO-{2 if p.grad else 1} state [{_fmt(p.state)}]"
            shape = "x".join(map(str, p.shape))
            lines.append(f"  {name:<36} {shape:>12}  [{_fmt(p.placements)}]{stored}")
    return lines


def _placed(p: ParamPlan) -> tuple[Placements, ...]:
    return (p.placements, p.storage, p.grad, p.state)


def _zero_words(plan: Plan) -> list[str]:
    """ZeRO-1/2 in words: how many parameters have their optimizer state (and gradients)
    split, along which axes, how many ways."""
    shape = plan.mesh.shape[1:] if plan.pipeline is not None else plan.mesh.shape
    sizes = dict(zip(plan.stage_axes, shape, strict=True))
    found: dict[tuple[int, tuple[str, ...]], list[int]] = defaultdict(list)
    for p in plan.params.values():
        if p.state:
            axes = tuple(a for a in p.state if p.state[a] != p.storage[a])
            found[(2 if p.grad else 1, axes)].append(math.prod(p.shape))
    return [
        f"  ZeRO-{stage}: the optimizer state{' and gradients' * (stage == 2)} of {len(n)} "
        f"parameter(s) ({_count(sum(n))} elements) split {math.prod(sizes[a] for a in axes)} "
        f"ways on {'+'.join(axes)}; "
        + ("gradients reduce-scattered, " if stage == 2 else "gradients all-reduced whole, ")
        + "the updated shards all-gathered after the optimizer step"
        for (stage, axes), n in sorted(found.items())
    ]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else str(n)


_NORMS = ("aten.layer_norm.default", "aten.rms_norm.default")
_EMBEDDING, _CROSS_ENTROPY = "aten.embedding.default", "aten.cross_entropy_loss.default"


def _words(plan: Plan) -> list[str]:
    """The splits a reader looks for, in words: experts (stacked weights of three or more
    dims stored split along dim 0), norms split along the sequence or the batch between
    tensor-parallel regions (sequence parallelism), and the vocabulary's split."""
    sizes = dict(zip(plan.mesh.axes, plan.mesh.shape, strict=True))
    experts: dict[str, dict[str, None]] = defaultdict(dict)
    for name, p in plan.params.items():
        for axis, placement in p.storage.items():
            if len(p.shape) >= 3 and placement == "S(0)":
                experts[axis][_INDEX.sub(".*.", name, count=1)] = None
    lines = _zero_words(plan)
    lines += [
        f"  experts split {sizes[axis]} ways on {axis} ({_moves_tokens(plan, axis)}): "
        + ", ".join(names)
        for axis, names in experts.items()
    ]
    norms = [n for n in plan.nodes.values() if n.op in _NORMS]
    for axis in plan.mesh.axes:
        # on an axis that splits weights (not experts alone: every rank multiplies its own
        # tokens there), norms split along the tokens: sequence parallelism
        split = experts.get(axis, {})
        if all(
            p.placements.get(axis, "R") == "R" or _INDEX.sub(".*.", n, count=1) in split
            for n, p in plan.params.items()
        ):
            continue
        for dim, what in (("S(1)", "sequence"), ("S(0)", "batch")):
            count = sum(n.output.get(axis) == dim for n in norms)
            if count:
                lines.append(
                    f"  {count} of {len(norms)} norms split along the {what} on {axis}, between "
                    "the weights' tensor-parallel splits (sequence parallelism)"
                )
    return lines + _vocabulary_words(plan, sizes) + _context_words(plan, sizes)


def _moves_tokens(plan: Plan, axis: str) -> str:
    """How a mixture of experts split on ``axis`` brings the tokens to their experts: an
    index-routed one's grouped matmuls (strategies/grouped_mm.py), their rows routed by each
    rank (strategies/routing.py) or gathered, else GShard's all-to-alls."""
    grouped = [n for n in plan.nodes.values() if n.op in GROUPED_MMS]
    split = [n for n in grouped if n.inputs[1].get(axis) == "S(0)"]
    if not split:
        return "all-to-alls carry the tokens"
    if all(n.inputs[0].get(axis) == "S(0)" for n in split):
        return (
            "each rank routes its own tokens, sent to their experts and back by all-to-alls "
            "of uneven counts"
        )
    return "each rank multiplies the rows routed to its experts, the partial sums reduced"


def _vocabulary_words(plan: Plan, sizes: dict[str, int]) -> list[str]:
    """Embeddings looked up by rows and losses on the logits' shards, by mesh axis."""
    lines = []
    for axis in plan.mesh.axes:
        ops = [n for n in plan.nodes.values() if n.op in (_EMBEDDING, _CROSS_ENTROPY)]
        lookups = sum(n.op == _EMBEDDING and n.output.get(axis) == "P" for n in ops)
        losses = sum(n.op == _CROSS_ENTROPY and n.inputs[0].get(axis) == "S(1)" for n in ops)
        if lookups or losses:
            lines.append(
                f"  vocabulary split {sizes[axis]} ways on {axis}: {lookups} embedding(s) "
                f"looked up by rows, {losses} loss(es) on the logits' shards (Megatron's)"
            )
    return lines


def _context_words(plan: Plan, sizes: dict[str, int]) -> list[str]:
    """Attention split along the sequence (context parallelism), by mesh axis: its queries
    split where its keys are whole (its other rules split both alike)."""
    lines = []
    attention = [n for n in plan.nodes.values() if n.op.startswith(FUSED_ATTENTION)]
    for axis in plan.mesh.axes:
        count = sum(
            n.inputs[0].get(axis, "R") not in ("R", "P") and n.inputs[1].get(axis) == "R"
            for n in attention
        )
        if count:
            lines.append(
                f"  {count} of {len(attention)} attention(s) split along the sequence "
                f"{sizes[axis]} ways on {axis} (context parallelism)"
            )
    return lines


def fmt_ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def stage_layers(plan: Plan, stage: Stage) -> str:
    """The stage's layers ("blocks.0 .. blocks.5" past two), and the top-level modules of its
    other ops ("+ tok_emb, pos_emb")."""
    layers = stage.layers
    named = ", ".join(layers) if len(layers) <= 2 else f"{layers[0]} .. {layers[-1]}"
    others: dict[str, None] = {}  # graph order, once each
    for node in stage.nodes:
        module = plan.nodes[node].module
        if module and not any(module == la or module.startswith(la + ".") for la in layers):
            others[module.split(".")[0]] = None
    extra = ", ".join(others)
    return f"{named} (+ {extra})" if named and extra else named or extra


def _table(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Rows as aligned columns, the columns in ``right`` right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            f"{c:>{w}}" if i in right else f"{c:<{w}}"
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _stage_lines(plan: Plan) -> list[str]:
    limit = plan.predicted.memory_limit_bytes
    rows = [("stage", "ranks", "layers", "forward", "backward", "send", "memory per device")]
    for s, st in enumerate(plan.stages):
        p = st.predicted
        cost = ("-", "-", "-", "-")
        if p is not None:
            send = fmt_time(p.time_s - p.forward_s - p.backward_s) if st.sent else "-"
            share = f"{100 * p.memory_bytes / limit:.1f}%" if limit else "-"
            cost = (
                fmt_time(p.forward_s),
                fmt_time(p.backward_s),
                send,
                f"{fmt_bytes(p.memory_bytes)} ({share})",
            )
        rows.append((str(s), fmt_ranks(st.ranks), stage_layers(plan, st), *cost))
    out = _table(rows, right={3, 4, 5, 6})
    out.append(
        f"  (per microbatch; send: to the next stage and the gradients back; memory of "
        f"{fmt_bytes(limit)} allowed)"
    )
    for s, (st, nxt) in enumerate(zip(plan.stages, plan.stages[1:], strict=False)):
        if st.sent and nxt.ranks == st.ranks:  # the middle of a V (ZBV, DualPipeV)
            out.append(f"  stage {s} -> {s + 1} passes {', '.join(st.sent)} on its own ranks")
        elif st.sent:
            out.append(
                f"  stage {s} -> {s + 1} sends {', '.join(st.sent)} as [{_fmt(st.boundary)}], "
                f"rank r to rank r{nxt.ranks[0] - st.ranks[0]:+d}"
            )
    return out


def _shown(count: int, limit: int) -> list[int | None]:
    """0 .. count-1, or past ``limit`` the first and last limit/2 with None between."""
    if count <= limit:
        return list(range(count))
    half = limit // 2
    return [*range(half), None, *range(count - half, count)]


def _left_out(what: str, count: int, limit: int) -> list[str]:
    """What `_shown` leaves out, for a note."""
    return [f"{what} {limit // 2}-{count - limit // 2 - 1}"] if count > limit else []


def _legend(schedule: str) -> str:
    if schedule in SPLIT_BACKWARD:
        return "Fk / Bk / Wk = forward / input / weight gradients"
    return "Fk / Bk = forward / backward"


def schedule_grid(pipeline: Pipeline, labels: Sequence[str], virtual_stages: int = 1) -> list[str]:
    """The schedule as rows of equal slots, one row per stage (named by ``labels``), wrapped
    into blocks of columns that fit a line; with ``virtual_stages``, each device group runs
    its stages' steps one at a time."""
    events = simulate(
        pipeline.schedule, len(labels), pipeline.num_microbatches, virtual_stages=virtual_stages
    )
    num_slots = round(max(e.end for e in events))
    cells = [["."] * num_slots for _ in labels]
    for e in events:
        cells[e.stage][round(e.start)] = f"{e.kind}{e.microbatch}"
    rows, slots = _shown(len(labels), _MAX_ROWS), _shown(num_slots, _MAX_SLOTS)
    width = 1 + max(len(f"F{pipeline.num_microbatches - 1}"), 3 if None in slots else 1)
    label_width = max(map(len, labels)) + 1
    num_blocks = math.ceil(len(slots) * width / max(width, _GRID_WIDTH - label_width - 2))
    per_block = math.ceil(len(slots) / num_blocks)  # blocks of even length
    out = []
    for first in range(0, len(slots), per_block):
        block = slots[first : first + per_block]
        header = "".join(f"{'' if i is None else i:>{width}}" for i in block)
        out.append(" " * (label_width + 2) + header)
        for r in rows:
            if r is None:
                out.append("  ...")
                continue
            line = "".join(f"{cells[r][i] if i is not None else '...':>{width}}" for i in block)
            out.append(f"  {labels[r]:<{label_width}}{line}")
    left_out = [
        *_left_out("stages", len(labels), _MAX_ROWS),
        *_left_out("slots", num_slots, _MAX_SLOTS),
    ]
    if left_out:
        out.append(f"  (left out: {', '.join(left_out)})")
    return out


def _pipeline_lines(plan: Plan, pipeline: Pipeline) -> list[str]:
    labels = [f"stage {s} (ranks {fmt_ranks(st.ranks)})" for s, st in enumerate(plan.stages)]
    v = plan.virtual_stages
    groups = len(plan.stages) // v
    rule = "in a V" if pipeline.schedule in V_SHAPED else f"stage s on group s mod {groups}"
    placement = (
        f" on {groups} device groups, {v} each ({rule}: "
        + "; ".join(
            f"ranks {fmt_ranks(plan.stages[g].ranks)} run stages "
            + ", ".join(map(str, plan.group_stages(g)))
            for g in range(groups)
        )
        + ")"
        if v > 1
        else ""
    )
    return [
        f"pipeline: {len(plan.stages)} stages{placement}, {pipeline.num_microbatches} "
        f"microbatches, schedule {pipeline.schedule}, predicted bubble "
        f"{100 * pipeline.bubble_fraction:.1f}% of the step",
        *_stage_lines(plan),
        "",
        f"schedule {pipeline.schedule}, one column per slot: {_legend(pipeline.schedule)} of "
        "microbatch k, . = idle",
        "(equal slots, in the order each stage runs them; the picture, --png, draws predicted "
        "times)",
        *schedule_grid(pipeline, labels, v),
        "",
    ]


def _precision_line(precision: str) -> str:
    if precision == Precision.BF16_PARAMS:
        how = "bf16 compute on the parameters cast to bf16 (every op in bf16, the loss float32)"
    else:
        scaling = ", with dynamic loss scaling" if precision == Precision.FP16 else ""
        how = f"{precision} compute under autocast{scaling}"
    return f"mixed precision: {how}; float32 parameters, gradients and optimizer state"


def recompute_lines(plan: Plan) -> list[str]:
    """Which layers recompute their forward in backward, with a blank line after; none when
    no layer does."""
    if not plan.recompute:
        return []
    names = [layer.layer for layer in plan.recompute]
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]}"
    ops = sum(len(layer.nodes) for layer in plan.recompute)
    modes = "/".join(sorted({layer.mode for layer in plan.recompute}))
    return [
        f"activation recomputation ({modes}): {len(names)} layer(s), {shown} ({ops} ops run "
        "their forward again in backward, under torch.utils.checkpoint)",
        "",
    ]


def summary(plan: Plan) -> str:
    pv, pr, so = plan.provenance, plan.predicted, plan.solver
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.mesh.axes, plan.mesh.shape, strict=True))
    out = [
        f"plan v{plan.version} for cluster {pv.cluster!r} (graph {pv.graph_fingerprint}, "
        f"torch {pv.torch}, autoplan {pv.autoplan})",
        f"mesh: {mesh}  ({len(plan.mesh.ranks)} devices; "
        f"tried {', '.join(map(str, so.meshes_tried))})",
        *([_precision_line(plan.mixed_precision)] if plan.mixed_precision else []),
        "",
        *(_pipeline_lines(plan, plan.pipeline) if plan.pipeline is not None else []),
        "parameters (as used by ops; storage when it differs):",
        *_param_lines(plan),
        *(["", "in words:", *words] if (words := _words(plan)) else []),
        "",
        *recompute_lines(plan),
        "collectives per step:"
        if plan.pipeline is None
        else "collectives (all stages; forward and backward ones once per microbatch):",
    ]
    totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for c in plan.collectives:
        t = totals[(c.phase, c.kind, "+".join(c.axes))]
        t[0] += 1
        t[1] += c.bytes
    if not totals:
        out.append("  none")
    for (phase, kind, axes), (count, nbytes) in sorted(totals.items()):
        out.append(
            f"  {phase:<10} {kind:<15} on {axes:<9} {count:>5} x, {fmt_bytes(nbytes):>11} in all"
        )
    buckets = {(c.stage, c.tensor): len(c.params) for c in plan.collectives if c.params}
    if buckets:
        out.append(
            f"  ({sum(buckets.values())} gradients all-reduced in {len(buckets)} bucket(s), "
            f"up to {fmt_bytes(BUCKET_BYTES)} each, the first {fmt_bytes(FIRST_BUCKET_BYTES)})"
        )
    # one stage: the gradients' reductions that backward hides (`costmodel.overlap`)
    hidden = pr.compute_s + pr.comm_s - pr.step_time_s
    out += [
        "",
        f"predicted step time: {fmt_time(pr.step_time_s)}  (compute {fmt_time(pr.compute_s)}, "
        f"communication {fmt_time(pr.comm_s)}"
        + (
            f"; {fmt_time(max(0.0, hidden))} of it hidden behind compute)"
            if plan.pipeline is None
            else " per microbatch, all stages)"
        ),
        f"predicted memory per device: {fmt_bytes(pr.peak_memory_bytes)} of "
        f"{fmt_bytes(pr.memory_limit_bytes)} allowed"
        + (
            f" (the allocator's margin of {pr.allocator_margin:.0%} taken off)"
            if pr.allocator_margin
            else ""
        ),
        f"solver: {so.status}, {so.num_groups} decision groups, {so.num_variables} variables, "
        f"{so.solve_time_s:.2f} s",
        *(f"  not proven optimal: {part.describe()}" for part in so.unproven),
    ]
    return "\n".join(out)

"""What changed between two plans of one model, and what it costs: mesh, pipeline (stages,
schedule, microbatches), the parameters whose placement changed, the collectives added or
removed by phase and kind, and the predicted step time and memory before and after, as
`autoplan diff` prints it.

Placements are compared by what they do to the tensor (how many ways each dim is split,
how many ways it is partial), not by their text: two plans may name their mesh axes
differently ("tp" against "tp0", "tp1"), and a parameter replicated on both is unchanged.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from autoplan.planfile.schema import Plan
from autoplan.planfile.sections import ParamPlan, Placements
from autoplan.planfile.show import fmt_bytes, fmt_time

_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Change:
    """One thing that differs: its name, as it was and as it is ("-": absent)."""

    what: str
    before: str
    after: str


@dataclass(frozen=True)
class CollectiveChange:
    phase: str
    kind: str
    count: tuple[int, int]  # before, after
    bytes: tuple[int, int]  # per device, all of them together


@dataclass(frozen=True)
class PlanDiff:
    layout: tuple[Change, ...]  # mesh, pipeline, precision, recomputation: what differs
    params: tuple[Change, ...]  # by parameter (repeated layers' alike changes as one, "*")
    collectives: tuple[CollectiveChange, ...]  # the (phase, kind)s whose count or bytes differ
    step_time_s: tuple[float, float]
    compute_s: tuple[float, float]
    comm_s: tuple[float, float]
    peak_memory_bytes: tuple[float, float]

    @property
    def same(self) -> bool:
        """Nothing differs but, perhaps, the predictions' rounding."""
        return not (self.layout or self.params or self.collectives)


def _fmt(p: Placements) -> str:
    return ", ".join(f"{axis}={v}" for axis, v in p.items())


def _effect(p: Placements, sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """What ``p`` does to a tensor: the ways each "S(d)" and "P" splits it, by placement."""
    ways: dict[str, int] = defaultdict(lambda: 1)
    for axis, v in p.items():
        if v != "R":
            ways[v] *= sizes[axis]
    return tuple(sorted(ways.items()))


def _param_effect(plan: Plan, p: ParamPlan | None) -> object:
    if p is None:
        return None
    sizes = dict(zip(plan.mesh.axes, plan.mesh.shape, strict=True))
    return tuple(_effect(x, sizes) for x in (p.placements, p.storage, p.grad, p.state))


def _placed(p: ParamPlan | None) -> str:
    if p is None:
        return "-"
    text = f"[{_fmt(p.placements)}]"
    if p.storage != p.placements:
        text += f" stored [{_fmt(p.storage)}]"
    if p.state:
        text += f" ZeRO-{2 if p.grad else 1} state [{_fmt(p.state)}]"
    return text


def _mesh(plan: Plan) -> str:
    return " x ".join(f"{a}={s}" for a, s in zip(plan.mesh.axes, plan.mesh.shape, strict=True))


def _pipeline(plan: Plan) -> str:
    p = plan.pipeline
    if p is None:
        return "none"
    virtual = f" ({plan.virtual_stages} per device group)" if plan.virtual_stages > 1 else ""
    return f"{len(plan.stages)} stages{virtual}, {p.schedule}, {p.num_microbatches} microbatches"


def _recompute(plan: Plan) -> str:
    if not plan.recompute:
        return "none"
    modes = "/".join(sorted({r.mode for r in plan.recompute}))
    return f"{len(plan.recompute)} layer(s), {modes}"


def _layout(a: Plan, b: Plan) -> tuple[Change, ...]:
    aspects = {
        "mesh": _mesh,
        "pipeline": _pipeline,
        "stage layers": lambda p: "; ".join(" ".join(st.layers) or "-" for st in p.stages),
        "mixed precision": lambda p: p.mixed_precision or "none",
        "recomputation": _recompute,
    }
    return tuple(
        Change(name, show(a), show(b)) for name, show in aspects.items() if show(a) != show(b)
    )


def _params(a: Plan, b: Plan) -> tuple[Change, ...]:
    """Changed parameters in ``a``'s order (then ``b``'s new ones); the copies of a repeated
    layer that all changed alike as one, their index written ``*``."""
    names = list(a.params) + [n for n in b.params if n not in a.params]
    groups: dict[str, list[Change]] = defaultdict(list)
    for name in names:
        pa, pb = a.params.get(name), b.params.get(name)
        if _param_effect(a, pa) != _param_effect(b, pb):
            change = Change(name, _placed(pa), _placed(pb))
            groups[_INDEX.sub(".*.", name, count=1)].append(change)
    out = []
    for pattern, changed in groups.items():
        changes = [n for n in names if _INDEX.sub(".*.", n, count=1) == pattern]
        alike = {(c.before, c.after) for c in changed}
        if len(changed) == len(changes) > 1 and len(alike) == 1:
            out.append(Change(f"{pattern} ({len(changes)})", changed[0].before, changed[0].after))
        else:
            out += changed
    return tuple(out)


def _collectives(a: Plan, b: Plan) -> tuple[CollectiveChange, ...]:
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for i, plan in enumerate((a, b)):
        for c in plan.collectives:
            t = totals[(str(c.phase), c.kind)]
            t[2 * i] += 1
            t[2 * i + 1] += c.bytes
    return tuple(
        CollectiveChange(phase, kind, (t[0], t[2]), (t[1], t[3]))
        for (phase, kind), t in sorted(totals.items())
        if (t[0], t[1]) != (t[2], t[3])
    )


def diff(a: Plan, b: Plan) -> PlanDiff:
    """What changed from plan ``a`` to plan ``b``."""
    pa, pb = a.predicted, b.predicted
    return PlanDiff(
        layout=_layout(a, b),
        params=_params(a, b),
        collectives=_collectives(a, b),
        step_time_s=(pa.step_time_s, pb.step_time_s),
        compute_s=(pa.compute_s, pb.compute_s),
        comm_s=(pa.comm_s, pb.comm_s),
        peak_memory_bytes=(pa.peak_memory_bytes, pb.peak_memory_bytes),
    )


def _ratio(before: float, after: float) -> str:
    return f"x{after / before:.2f}" if before else "-"


def _signed_time(s: float) -> str:
    return ("+" if s >= 0 else "-") + fmt_time(abs(s))


def diff_lines(d: PlanDiff, before: str = "A", after: str = "B") -> list[str]:
    """``d`` as text, the plans named ``before`` and ``after``."""
    if d.same:
        out = [f"{before} and {after} make the same decisions"]
    else:
        out = [f"from {before} to {after}:"]
    width = max((len(c.what) for c in (*d.layout, *d.params)), default=0)
    out += [f"  {c.what:<{width}}  {c.before}  ->  {c.after}" for c in d.layout]
    if d.params:
        out += ["", f"parameters placed differently ({len(d.params)}):"]
        out += [f"  {c.what:<{width}}  {c.before}  ->  {c.after}" for c in d.params]
    if d.collectives:
        out += ["", "collectives (count and bytes per device, all of a kind together):"]
        for c in d.collectives:
            what = f"{c.phase} {c.kind}"
            change = "added" if not c.count[0] else "removed" if not c.count[1] else "changed"
            out.append(
                f"  {what:<26} {c.count[0]:>4} x {fmt_bytes(c.bytes[0]):>11}  ->  "
                f"{c.count[1]:>4} x {fmt_bytes(c.bytes[1]):>11}  ({change})"
            )
    rows = [
        ("step time", d.step_time_s),
        ("  compute", d.compute_s),
        ("  communication", d.comm_s),
    ]
    out += ["", "predicted:"]
    for name, (x, y) in rows:
        out.append(
            f"  {name:<16} {fmt_time(x):>11}  ->  {fmt_time(y):>11}  "
            f"({_signed_time(y - x)}, {_ratio(x, y)})"
        )
    x, y = d.peak_memory_bytes
    out.append(
        f"  {'memory/device':<16} {fmt_bytes(x):>11}  ->  {fmt_bytes(y):>11}  ({_ratio(x, y)})"
    )
    return out

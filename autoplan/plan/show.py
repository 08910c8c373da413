"""A plan as text a person reads: mesh, parameter shardings, collectives, predictions."""

from __future__ import annotations

import re
from collections import defaultdict

from autoplan.plan.schema import Placements, Plan

_INDEX = re.compile(r"\.(\d+)\.")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _fmt(p: Placements) -> str:
    return ", ".join(f"{axis}={v}" for axis, v in p.items())


def _param_lines(plan: Plan) -> list[str]:
    """One line per parameter; copies of a repeated layer with the same placements share one
    line, their index written as ``*``."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in plan.params:
        groups[_INDEX.sub(".*.", name, count=1)].append(name)
    lines = []
    for pattern, names in groups.items():
        first = plan.params[names[0]]
        same = all(
            (plan.params[n].placements, plan.params[n].storage) == (first.placements, first.storage)
            for n in names
        )
        for name in [pattern] if same and len(names) > 1 else names:
            p = plan.params[names[0] if name == pattern and len(names) > 1 else name]
            stored = "" if p.storage == p.placements else f"   stored [{_fmt(p.storage)}]"
            shape = "x".join(map(str, p.shape))
            lines.append(f"  {name:<36} {shape:>12}  [{_fmt(p.placements)}]{stored}")
    return lines


def summary(plan: Plan) -> str:
    pv, pr, so = plan.provenance, plan.predicted, plan.solver
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.mesh.axes, plan.mesh.shape, strict=True))
    out = [
        f"plan v{plan.version} for cluster {pv.cluster!r} (graph {pv.graph_fingerprint}, "
        f"torch {pv.torch}, autoplan {pv.autoplan})",
        f"mesh: {mesh}  ({len(plan.mesh.ranks)} devices; "
        f"tried {', '.join(map(str, so.meshes_tried))})",
        "",
        "parameters (as used by ops; storage when it differs):",
        *_param_lines(plan),
        "",
        "collectives per step:",
    ]
    totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for c in plan.collectives:
        t = totals[(c.phase, c.kind, c.axis)]
        t[0] += 1
        t[1] += c.bytes
    if not totals:
        out.append("  none")
    for (phase, kind, axis), (count, nbytes) in sorted(totals.items()):
        out.append(
            f"  {phase:<10} {kind:<15} axis {axis:<5} {count:>5} x, {fmt_bytes(nbytes):>11} in all"
        )
    out += [
        "",
        f"predicted step time: {fmt_time(pr.step_time_s)}  (compute {fmt_time(pr.compute_s)}, "
        f"communication {fmt_time(pr.comm_s)}; no overlap assumed)",
        f"predicted memory per device: {fmt_bytes(pr.peak_memory_bytes)} of "
        f"{fmt_bytes(pr.memory_limit_bytes)} allowed",
        f"solver: {so.status}, {so.num_groups} decision groups, {so.num_variables} variables, "
        f"{so.solve_time_s:.2f} s",
    ]
    return "\n".join(out)

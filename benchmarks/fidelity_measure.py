"""The fidelity benchmark's measurements, on every rank of its torchrun job.

Every plan of a model is planned on rank 0 and broadcast (`make_plans`), built, and trained. A
step is timed as the slowest rank's wall time after a barrier; the plans of one model are
measured in interleaved rounds (a few steps of each plan per round), so that a change in the
machine's load touches every plan alike, and each plan's figure is the median over all its timed
steps (`measure_model`). Beside the plans: the model trained by plain torch in one process
(`plain_reference`), how busy the machine was (`load`, `CpuShare`) and a matmul timed after each
round as the profile times it (the host's speed against its profile).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autoplan
from autoplan.errors import AutoplanError
from autoplan.profile.timer import matmul_seconds
from autoplan.workload import Workload, load_workload
from benchmarks.fidelity_plans import MODELS, WORLD, PlanSpec, decisions, layout, plan_specs
from benchmarks.stats import quartiles
from benchmarks.steps import (
    Step,
    Times,
    autoplan_step,
    median_seconds,
    one_device,
    plain_step,
    timed,
)

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 2  # untimed steps right after a plan is built
ROUNDS = 4  # interleaved rounds over a model's plans
STEPS = 5  # timed steps per plan per round, after one untimed step (caches after a switch)
LR = 1e-4
PROBE_N = 512  # a matmul of the profile's curve, timed again in each round (probe_vs_profile)


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


class CpuShare:
    """The share of the machine's CPU time that processes other than this job's ranks took
    while it measured (from /proc: all CPUs' busy time less the ranks' own user + system
    time). The load average cannot say this, since the ranks themselves add up to 4 to it."""

    def __init__(self) -> None:
        pids: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        self.pids = [int(p) for p in pids]
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        ticks = os.sysconf("SC_CLK_TCK")
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
        ours = 0.0
        for pid in self.pids:
            stat = Path(f"/proc/{pid}/stat").read_text()
            after_name = stat[stat.rindex(")") + 2 :].split()
            ours += float(after_name[11]) + float(after_name[12])  # utime, stime
        return time.time(), busy / ticks, ours / ticks

    def foreign(self) -> float:
        """Other processes' CPU seconds per second of wall time per CPU, since construction."""
        (t0, busy0, ours0), (t1, busy1, ours1) = self.start, self._sample()
        return round(
            max(0.0, (busy1 - busy0) - (ours1 - ours0)) / ((t1 - t0) * (os.cpu_count() or 1)), 3
        )


def make_plans(
    model: str, w: Workload, cluster: autoplan.Cluster
) -> list[tuple[PlanSpec, str | None, str]]:
    """On rank 0: (spec, plan JSON or None, error) for every plan of ``model``; broadcast."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        made = []
        for spec in plan_specs(model):
            start = time.perf_counter()
            try:
                text, error = spec.make(w, cluster).to_json(), ""
            except AutoplanError as e:
                text, error = None, f"{type(e).__name__}: {e}"
            print(
                f"  planned {model}/{spec.name} in {time.perf_counter() - start:.1f} s", flush=True
            )
            made.append((spec.name, text, error))
        box[0] = made
    dist.broadcast_object_list(box, src=0)
    by_name = {s.name: s for s in plan_specs(model)}
    return [(by_name[name], text, error) for name, text, error in box[0]]


def plain_reference(w: Workload, cluster: autoplan.Cluster) -> dict[str, float]:
    """The compute part of the cost model, checked alone: rank 0 trains the model with plain
    torch (one process, one thread, no DTensor, no collectives) while the other ranks sleep in
    a barrier; the prediction is the model planned for one device, scaled to the whole core a
    lone process gets (the profile's curves are per rank with every rank busy at once)."""
    found: dict[str, float] = {}
    if dist.get_rank() == 0:
        plan = w.plan(one_device(cluster))
        model = copy.deepcopy(w.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        step = plain_step(model, optimizer, w.loss_fn, w.example_inputs, w.example_target)
        seconds = median_seconds(step, WARMUP, 2 * STEPS)
        share = min(1.0, (os.cpu_count() or 1) / WORLD)  # of a core, per busy rank
        found = {
            "plain_torch_s": round(seconds, 5),
            "plain_predicted_s": round(plan.predicted.step_time_s * share, 5),
        }
    dist.barrier()
    return found


def across_ranks(times: Times) -> list[tuple[float, float]]:
    """Per step: the slowest rank's wall time, and the CPU time of all ranks together."""
    wall = torch.tensor(times.wall, dtype=torch.float64)
    cpu = torch.tensor(times.cpu, dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return list(zip(wall.tolist(), cpu.tolist(), strict=True))


def measure_model(
    model: str, cluster: autoplan.Cluster
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every plan of ``model``, measured; and how (rank 0 only): the load average before and
    after each round, the CPU share other processes took meanwhile, the plain-torch check."""
    path, options = MODELS[model]
    w = load_workload(ROOT / path, **options)
    made = make_plans(model, w, cluster)
    reference = plain_reference(w, cluster)
    rows: list[dict[str, Any]] = []
    steps: dict[str, Step] = {}
    seen: dict[str, str] = {}  # decisions -> first plan name
    for spec, text, error in made:
        row: dict[str, Any] = {"model": model, "plan": spec.name, "how": spec.how}
        rows.append(row)
        if text is None:
            row["error"] = error
            continue
        plan = autoplan.Plan.from_json(text)
        key = decisions(plan)
        row.update(
            layout=layout(plan),
            predicted_s=round(plan.predicted.step_time_s, 5),
            pred_compute_s=round(plan.predicted.compute_s, 5),
            pred_comm_s=round(plan.predicted.comm_s, 5),
        )
        if key in seen:
            row["same_as"] = seen[key]  # measured once, under the first name
            continue
        seen[key] = spec.name
        torch.manual_seed(0)
        step = autoplan_step(w, cluster, LR, plan=plan)
        timed(step, WARMUP, barrier=True)
        steps[spec.name] = step
    per_plan: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    loads = [load()]
    share = CpuShare()
    probes = []
    for _ in range(ROUNDS):
        for name, step in steps.items():
            timed(step, 1, barrier=True)  # caches and allocator after the switch from another plan
            per_plan[name] += across_ranks(timed(step, STEPS, barrier=True))
        loads.append(load())
        probes.append(matmul_seconds(PROBE_N, torch.device("cpu")))
    foreign = share.foreign() if dist.get_rank() == 0 else 0.0
    by_name = {r["plan"]: r for r in rows}
    for row in rows:
        source = row.get("same_as", row["plan"])
        if source not in per_plan:
            continue
        times = [wall for wall, _ in per_plan[source]]
        cpu = statistics.median(c for _, c in per_plan[source])
        measured = statistics.median(times)
        q1, q3 = quartiles(times)
        row.update(
            measured_s=round(measured, 5),
            iqr_s=round(q3 - q1, 5),
            ratio=round(measured / row["predicted_s"], 3),
            cpu_s=round(cpu, 4),
            busy=round(cpu / (measured * (os.cpu_count() or 1)), 2),
        )
        if row.get("same_as"):
            row["measured_s_note"] = f"measured once as {source}"
            assert by_name[source]["measured_s"] == row["measured_s"]
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
    profiled = cluster.curves.matmul["float32"](2.0 * PROBE_N**3)
    assert profiled is not None, f"the profile's matmul curve has n={PROBE_N}"
    about = {
        "load_average": loads,
        "cpu_share_of_other_processes": foreign,
        "probe_vs_profile": round(statistics.median(probes) / profiled, 3),
        **reference,
    }
    if dist.get_rank() == 0:
        print(f"  {model}: {json.dumps(about)}", flush=True)
    return rows, about

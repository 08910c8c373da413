"""`autoplan plan`: trace a workload file, plan it for a cluster, write and show the plan."""

from __future__ import annotations

import argparse
import time

from autoplan.api import plan
from autoplan.cli.arguments import (
    add_plan_options,
    add_progress,
    add_workload,
    at_least_one,
    plan_options,
    workload_options,
)
from autoplan.cli.progress_line import ProgressLine
from autoplan.cluster.model import Cluster
from autoplan.execute.dry_run import check_traced
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import summary
from autoplan.workload import Workload, load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="trace a workload file and plan it for a cluster")
    add_workload(p)
    p.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    p.add_argument("--nodes", type=at_least_one, help="number of nodes (default: the file's)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")
    p.add_argument(
        "--check-step",
        action="store_true",
        help="run the planned step of one rank per role on fake tensors, as `autoplan run` "
        "does before training, and refuse a plan some rank cannot run",
    )
    add_progress(p)
    add_plan_options(p)


def run(args: argparse.Namespace) -> int:
    cluster = Cluster.load(args.cluster, num_nodes=args.nodes)
    workload = load_workload(args.workload, **workload_options(args.set))
    start = time.perf_counter()
    progress = ProgressLine(args.progress_after)
    options = plan_options(args, progress)
    try:
        result = plan(
            workload.model,
            workload.example_inputs,
            cluster,
            loss_fn=workload.loss_fn,
            example_target=workload.example_target,
            options=options,
        )
    finally:
        progress.end()  # before the plan, or the error
    # before the plan is written: a plan some rank cannot run is not kept
    checked = _check_step(workload, result, options.optimizer) if args.check_step else None
    result.save(args.output)
    print(summary(result))
    if checked is not None:
        print(f"\n{checked}")
    print(f"\nwrote {args.output} ({time.perf_counter() - start:.1f} s)")
    return 0


def _check_step(workload: Workload, result: Plan, optimizer: str) -> str:
    """Run ``result``'s step of one rank per role on fake tensors (`check_traced`: the step
    traced again, as the executor runs it); what was checked."""
    checked = check_traced(
        workload.model,
        result,
        workload.example_inputs,
        workload.example_target,
        workload.loss_fn,
        optimizer=optimizer,
    )
    if not checked:
        return "the step was not checked: this torch cannot run a pipeline's stages apart"
    ranks = len(result.mesh.ranks)
    return f"the step ran on fake tensors for {len(checked)} of {ranks} ranks (one per role)"

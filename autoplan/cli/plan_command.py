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
from autoplan.planfile.show import summary
from autoplan.workload import load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="trace a workload file and plan it for a cluster")
    add_workload(p)
    p.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    p.add_argument("--nodes", type=at_least_one, help="number of nodes (default: the file's)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")
    add_progress(p)
    add_plan_options(p)


def run(args: argparse.Namespace) -> int:
    cluster = Cluster.load(args.cluster, num_nodes=args.nodes)
    workload = load_workload(args.workload, **workload_options(args.set))
    start = time.perf_counter()
    progress = ProgressLine(args.progress_after)
    try:
        result = plan(
            workload.model,
            workload.example_inputs,
            cluster,
            loss_fn=workload.loss_fn,
            example_target=workload.example_target,
            options=plan_options(args, progress),
        )
    finally:
        progress.end()  # before the plan, or the error
    result.save(args.output)
    print(summary(result))
    print(f"\nwrote {args.output} ({time.perf_counter() - start:.1f} s)")
    return 0

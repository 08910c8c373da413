"""`autoplan estimate`: re-price a plan, after a hand edit or for another cluster."""

from __future__ import annotations

import argparse

from autoplan.cli.arguments import add_workload, at_least_one, workload_options
from autoplan.cluster.model import Cluster
from autoplan.costmodel.pricer import OPTIMIZER_STATE
from autoplan.estimate import estimate
from autoplan.options import PlanOptions
from autoplan.planfile.show import summary
from autoplan.workload import load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("estimate", help="re-price a plan (edited, or for another cluster)")
    add_workload(e)
    e.add_argument("--plan", required=True, help="a plan JSON file")
    e.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    e.add_argument("--nodes", type=at_least_one, help="number of nodes (default: the file's)")
    e.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATE),
        default=PlanOptions().optimizer,
        help="the optimizer whose state is counted (default %(default)s)",
    )
    e.add_argument("-o", "--output", help="also write the re-priced plan here")


def run(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload, **workload_options(args.set))
    priced = estimate(
        args.plan,
        Cluster.load(args.cluster, num_nodes=args.nodes),
        workload.model,
        workload.example_inputs,
        loss_fn=workload.loss_fn,
        example_target=workload.example_target,
        optimizer=args.optimizer,
    )
    print(summary(priced))
    if priced.predicted.peak_memory_bytes > priced.predicted.memory_limit_bytes:
        print("\nwarning: this plan needs more memory per device than the cluster offers")
    if args.output:
        priced.save(args.output)
        print(f"\nwrote {args.output}")
    return 0

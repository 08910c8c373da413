"""`autoplan show`: a plan file summarized (and drawn), checked against a cluster if given;
with ``--top N``, re-priced against its model op by op: where the time and memory go."""

from __future__ import annotations

import argparse

from autoplan.cli.arguments import at_least_one, workload_options
from autoplan.cluster.model import Cluster
from autoplan.costmodel.pricer import OPTIMIZER_STATE
from autoplan.errors import UsageError
from autoplan.estimate import price_stages_ops
from autoplan.graph.capture import capture_microbatches
from autoplan.options import PlanOptions
from autoplan.planfile.breakdown import breakdown, top_lines
from autoplan.planfile.check import check_plan
from autoplan.planfile.picture import render_png, render_top_png
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import summary
from autoplan.workload import load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("show", help="summarize a plan file")
    s.add_argument("plan", help="a plan JSON file")
    s.add_argument(
        "--png",
        help="also draw the pipeline stages and schedule to this PNG file (with --top: the "
        "ops' and layers' compute and communication)",
    )
    s.add_argument("--cluster", help="also check the plan's mesh against this cluster file")
    s.add_argument("--nodes", type=at_least_one, help="number of nodes (default: the file's)")
    s.add_argument(
        "--top",
        type=at_least_one,
        metavar="N",
        help="also list the N ops and layers that cost most time (and their memory), priced "
        "again on --cluster for --workload",
    )
    s.add_argument("--workload", help="with --top: the plan's workload file (see examples/)")
    s.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="workload option"
    )
    s.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATE),
        default=PlanOptions().optimizer,
        help="with --top: the optimizer the plan was made for (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    cluster = None if args.cluster is None else Cluster.load(args.cluster, num_nodes=args.nodes)
    shown = check_plan(Plan.from_json(args.plan), cluster=cluster)
    print(summary(shown))
    if args.top is not None:
        if args.workload is None or cluster is None:
            raise UsageError(
                "show --top prices the plan's ops again, which needs its model and cluster: "
                "add --workload FILE (with its --set NAME=VALUE options) and --cluster FILE"
            )
        w = load_workload(args.workload, **workload_options(args.set))
        graph_for = capture_microbatches(
            w.model, w.example_inputs, w.loss_fn, w.example_target, shown.mixed_precision
        )
        steps = price_stages_ops(shown, graph_for, cluster, optimizer=args.optimizer)
        found = breakdown(shown, steps)
        print()
        print("\n".join(top_lines(shown, found, args.top)))
        if args.png:
            render_top_png(shown, found, args.top, args.png)
            print(f"\nwrote {args.png}")
    elif args.png:
        render_png(shown, args.png)
        print(f"\nwrote {args.png}")
    return 0

"""`autoplan show`: a plan file summarized (and drawn), checked against a cluster if given."""

from __future__ import annotations

import argparse

from autoplan.cli.arguments import at_least_one
from autoplan.cluster.model import Cluster
from autoplan.planfile.check import check_plan
from autoplan.planfile.picture import render_png
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("show", help="summarize a plan file")
    s.add_argument("plan", help="a plan JSON file")
    s.add_argument("--png", help="also draw the pipeline stages and schedule to this PNG file")
    s.add_argument("--cluster", help="also check the plan's mesh against this cluster file")
    s.add_argument("--nodes", type=at_least_one, help="number of nodes (default: the file's)")


def run(args: argparse.Namespace) -> int:
    cluster = None if args.cluster is None else Cluster.load(args.cluster, num_nodes=args.nodes)
    shown = check_plan(Plan.from_json(args.plan), cluster=cluster)
    print(summary(shown))
    if args.png:
        render_png(shown, args.png)
        print(f"\nwrote {args.png}")
    return 0

"""`autoplan diff`: what changed between two plans of one model, and what it costs."""

from __future__ import annotations

import argparse

from autoplan.planfile.diff import diff, diff_lines
from autoplan.planfile.schema import Plan


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("diff", help="what changed between two plans, and what it costs")
    d.add_argument("before", help="a plan JSON file")
    d.add_argument("after", help="another plan JSON file of the same model")


def run(args: argparse.Namespace) -> int:
    changes = diff(Plan.from_json(args.before), Plan.from_json(args.after))
    print("\n".join(diff_lines(changes, args.before, args.after)))
    return 0

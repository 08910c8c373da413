"""`autoplan plan|show`: the command line. The only module that configures logging."""

from __future__ import annotations

import argparse
import ast
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from autoplan.api import plan as make_plan
from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError
from autoplan.plan.schema import Plan
from autoplan.plan.show import summary
from autoplan.workload import load_workload

log = logging.getLogger("autoplan.cli")


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise AutoplanError(f"--set {pair!r}: write NAME=VALUE, e.g. --set batch_size=8")
        options[key] = _value(value)
    return options


def _mesh(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as e:
        raise AutoplanError(f"--mesh {text!r}: write sizes separated by commas, e.g. 2,2") from e


def _pins(pairs: Sequence[str]) -> dict[str, Any]:
    pins: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise AutoplanError(
                f"--pin {pair!r}: write PARAM=PLACEMENT[,PLACEMENT], e.g. fc.weight=S(0)"
            )
        pins[name] = tuple(value.split(","))
    return pins


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoplan", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="print only results")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="trace a workload file and plan it for a cluster")
    p.add_argument("workload", help="a Python file defining workload() (see examples/)")
    p.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    p.add_argument("--nodes", type=int, help="number of nodes (default: the file's)")
    p.add_argument("--mesh", help="pin the logical mesh, e.g. 4 or 2,2")
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="workload option"
    )
    p.add_argument(
        "--pin", action="append", default=[], metavar="PARAM=PLACEMENTS", help="pin a parameter"
    )
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, sgd_momentum")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit per mesh (s)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")

    s = sub.add_parser("show", help="summarize a plan file")
    s.add_argument("plan", help="a plan JSON file")
    return parser


def _plan(args: argparse.Namespace) -> None:
    cluster = Cluster.load(args.cluster, num_nodes=args.nodes)
    workload = load_workload(args.workload, **_options(args.set))
    start = time.perf_counter()
    result = make_plan(
        workload.model,
        workload.example_inputs,
        cluster,
        loss_fn=workload.loss_fn,
        example_target=workload.example_target,
        mesh_shape=_mesh(args.mesh),
        pin=_pins(args.pin),
        optimizer=args.optimizer,
        time_limit_s=args.time_limit,
    )
    result.save(args.output)
    print(summary(result))
    print(f"\nwrote {args.output} ({time.perf_counter() - start:.1f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        if args.command == "plan":
            _plan(args)
        elif args.command == "show":
            print(summary(Plan.from_json(args.plan)))
    except AutoplanError as e:
        print(f"autoplan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`autoplan profile|plan|show|diff|estimate|run`: the command line, one module per subcommand.
The only module that configures logging: warnings only by default (``-v`` adds the planner's
account of what it tried, ``-vv`` the solvers' own logs), and long work shows progress on
stderr instead (`autoplan.cli.progress_line`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from autoplan.cli import (
    diff_command,
    estimate_command,
    failure,
    plan_command,
    profile_command,
    run_command,
    show_command,
)
from autoplan.errors import AutoplanError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoplan", description=__doc__)
    p.add_argument("-q", "--quiet", action="store_true", help="print only results (and warnings)")
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what the planner tries (-vv: and the ILP solver's own log)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    commands = (
        plan_command,
        show_command,
        diff_command,
        estimate_command,
        run_command,
        profile_command,
    )
    for command in commands:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    levels = [logging.WARNING, logging.INFO, logging.DEBUG]
    logging.basicConfig(
        level=levels[0 if args.quiet or rank != 0 else min(args.verbose, 2)],
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        if args.command == "run":
            return run_command.run(args, argv)
        if args.command == "profile":
            return profile_command.run(args, argv)
        commands = {
            "plan": plan_command.run,
            "show": show_command.run,
            "diff": diff_command.run,
            "estimate": estimate_command.run,
        }
        return commands[args.command](args)
    except AutoplanError as e:
        if "RANK" in os.environ and failure.record(rank, e, args.command):
            return 2  # `autoplan run` reports it, once for all ranks
        where = f" on rank {rank}" if "RANK" in os.environ else ""
        print(f"autoplan: error{where}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if "RANK" in os.environ and failure.record(rank, e, args.command):
            return 1
        raise

"""Arguments the subcommands share: the value types, workload options (``--set``), and the
planner's options, one flag per `PlanOptions` field with its docstring as help, so that the
command line and the options cannot drift apart."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from autoplan.cli.progress_line import PROGRESS_AFTER_S, ProgressLine
from autoplan.costmodel.pricer import OPTIMIZER_STATE
from autoplan.errors import AutoplanError
from autoplan.modes import Precision, RecomputeMode, ReduceDtype, Schedule
from autoplan.options import PlanOptions, field_docs


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _mesh(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write sizes separated by commas, e.g. 2,2"
        ) from None


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


def workload_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set NAME=VALUE`` pairs as keyword arguments of the workload file's ``workload()``
    (Python literals, else strings)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise AutoplanError(f"--set {pair!r}: write NAME=VALUE, e.g. --set batch_size=8")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def add_workload(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="a Python file defining workload() (see examples/)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="workload option"
    )


def add_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress-after",
        type=float,
        default=PROGRESS_AFTER_S,
        metavar="SECONDS",
        help=f"show planning's progress once it has run this long (default {PROGRESS_AFTER_S:g})",
    )


@dataclasses.dataclass(frozen=True)
class _Flag:
    """How one `PlanOptions` field is spelled on the command line."""

    name: str  # the flag, "--mesh"
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    repeated: bool = False  # given once per value (a list)


# every PlanOptions field but on_progress, which the command line sets itself
_FLAGS = {
    "mesh_shape": _Flag("--mesh", _mesh, metavar="N[,N]"),
    "pin": _Flag("--pin", metavar="PARAM=PLACEMENTS", repeated=True),
    "optimizer": _Flag("--optimizer", choices=sorted(OPTIMIZER_STATE)),
    "memory_fraction": _Flag("--memory-fraction", positive, metavar="F"),
    "time_limit_s": _Flag("--time-limit", positive, metavar="SECONDS"),
    "pipeline": _Flag("--pipeline"),
    "num_stages": _Flag("--stages", at_least_one, metavar="N"),
    "num_microbatches": _Flag("--microbatches", at_least_one, metavar="N"),
    "schedule": _Flag("--schedule", str, metavar="|".join(Schedule)),
    "virtual_stages": _Flag("--virtual-stages", at_least_one, metavar="N"),
    "max_layers": _Flag("--max-layers", at_least_one, metavar="N"),
    "mixed_precision": _Flag("--mixed-precision", choices=list(Precision)),
    "reduce_dtype": _Flag("--reduce-dtype", choices=list(ReduceDtype)),
    "recompute": _Flag("--recompute", choices=list(RecomputeMode)),
}


def _help(doc: str, default: Any) -> str:
    """A field's docstring as help: its first sentence, without markup, and its
    default."""
    text = " ".join(doc.split("\n\n")[0].split())
    text = " ".join(re.split(r"(?<=\.) (?=[A-Z\"])", text)[:1])
    text = re.sub(r"`+([^`]*)`+", r"\1", text).replace("%", "%%")
    shown = "" if default is None or isinstance(default, dict) else f" (default {default})"
    return text + shown


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """A flag for every `PlanOptions` field, its help the field's docstring."""
    docs, defaults = field_docs(PlanOptions), PlanOptions()
    group = parser.add_argument_group("planning (PlanOptions)")
    for field, flag in _FLAGS.items():
        default = getattr(defaults, field)
        help = _help(docs[field], default)
        if field == "pipeline":  # None, True or False: a pair of flags
            pipe = group.add_mutually_exclusive_group()
            pipe.add_argument(flag.name, dest=field, action="store_true", default=None, help=help)
            pipe.add_argument("--no-pipeline", dest=field, action="store_false")
            continue
        group.add_argument(
            flag.name,
            dest=field,
            type=flag.type or str,
            choices=flag.choices,
            metavar=flag.metavar,
            action="append" if flag.repeated else "store",
            default=[] if flag.repeated else None,
            help=help,
        )
    assert set(_FLAGS) == {f.name for f in dataclasses.fields(PlanOptions)} - {"on_progress"}


def plan_options(args: argparse.Namespace, progress: ProgressLine) -> PlanOptions:
    """The planner's options from the flags `add_plan_options` made; a field whose flag is not
    given keeps its default."""
    given = {f: getattr(args, f) for f in _FLAGS if getattr(args, f) not in (None, [])}
    if "pin" in given:
        given["pin"] = _pins(given["pin"])
    return PlanOptions(on_progress=None if args.quiet else progress, **given)

"""Plans of the examples, written to a folder and compared with an earlier folder: a change
that should not change any plan (a refactor) is checked with

    python tools/plan_snapshot.py write /tmp/before      # on the commit before
    python tools/plan_snapshot.py write /tmp/after       # on the change
    python tools/plan_snapshot.py compare /tmp/before /tmp/after

Plans are compared byte for byte, except the solver's wall time (``solve_time_s``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan import PlanOptions  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402

VOLATILE = '"solve_time_s"'


def _example(name: str, **options: object) -> Workload:
    return load_workload(ROOT / "examples" / f"{name}.py", **options)


def cases() -> dict[str, Callable[[], autoplan.Plan]]:
    """Name -> how its plan is made: the planner's own, forced layouts, pipelines and
    baselines, on the CPU profiles and on A100s."""
    cpu4 = autoplan.Cluster.load(ROOT / "costmodels/cpu-gloo-4.json")
    profiled = autoplan.Cluster.load(ROOT / "costmodels/cpu-gloo-4-profiled.json")
    a100 = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json", num_nodes=2)
    gpt_small = {"size": "small", "num_layers": 2, "batch_size": 2, "seq_len": 256}
    pipeline = PlanOptions(pipeline=True, num_stages=2, num_microbatches=4)
    zero3_head = PlanOptions(mesh_shape=(4,), pin={"head.weight": {"storage": "S(0)", "use": "R"}})
    return {
        "mlp_cpu4": lambda: _example("mlp").plan(cpu4),
        "mlp_profiled": lambda: _example("mlp", hidden=256).plan(profiled),
        "mlp_cpu4_2x2": lambda: _example("mlp").plan(cpu4, PlanOptions(mesh_shape=(2, 2))),
        "gpt_tiny_cpu4": lambda: _example("gpt", size="tiny").plan(cpu4),
        "gpt_small_profiled": lambda: _example("gpt", **gpt_small).plan(profiled),
        "gpt_tiny_pipeline": lambda: _example("gpt", size="tiny", batch_size=8).plan(
            cpu4, pipeline
        ),
        "gpt_tiny_zero3_head": lambda: _example("gpt", size="tiny").plan(cpu4, zero3_head),
        "gpt_350m_a100x16": lambda: _example("gpt", size="350m", device="meta", batch_size=16).plan(
            a100
        ),
        "baseline_gpt_dp2tp2": lambda: _example("gpt", size="tiny").baseline(cpu4, dp=2, tp=2),
        "baseline_gpt_pp2": lambda: _example("gpt", size="tiny", batch_size=8).baseline(
            cpu4, dp=1, tp=2, pp=2, options=PlanOptions(num_microbatches=4)
        ),
        "baseline_mlp_zero3": lambda: _example("mlp").baseline(cpu4, dp=4, tp=1, zero_stage=3),
    }


def write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in cases().items():
        make().save(str(folder / f"{name}.json"))
        print(f"wrote {folder / name}.json", flush=True)


def _stable(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if VOLATILE not in line]


def compare(before: Path, after: Path) -> int:
    names = sorted(p.name for p in before.glob("*.json"))
    differ = [
        n for n in names if not (after / n).exists() or _stable(before / n) != _stable(after / n)
    ]
    for name in differ:
        print(f"differs: {name}")
    print(f"{len(names) - len(differ)} of {len(names)} plans identical")
    return 1 if differ or not names else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write").add_argument("folder", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "write":
        write(args.folder)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())

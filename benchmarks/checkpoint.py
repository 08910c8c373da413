"""What checkpoints cost on 4 local CPU ranks (gloo): `step.save` under one plan, `step.load`
of it under another, `step.export`, and the bytes on disk (parameters and AdamW's two moments,
each shard once).

    python benchmarks/checkpoint.py            # starts torchrun itself

Writes benchmarks/results/checkpoint.json and .md.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.steps import torchrun  # noqa: E402
from tests.distributed.cases import cluster, data_parallel, pipeline  # noqa: E402
from tests.distributed.training import TRAIN, parallel  # noqa: E402

REPEATS = 3
Layout = Callable[[Workload], autoplan.PlanOptions]
# (example, its options): a GPT of many small tensors, an MLP of few large ones
SETUPS: list[tuple[str, dict[str, Any]]] = [
    ("gpt", {"size": "small", "num_layers": 4, "batch_size": 8, "seq_len": 64}),
    ("mlp", {"batch_size": 64, "hidden": 2048, "num_layers": 6}),
]
SAVED_UNDER = ("(2, 2) mesh, planner's", lambda w: autoplan.PlanOptions(mesh_shape=(2, 2)))
LOADED_UNDER: list[tuple[str, Layout]] = [
    ("data parallel", lambda w: data_parallel(w, (4,))),
    ("2 pipeline stages", pipeline(stages=2, microbatches=2, mesh=(2,))),
]


def _seconds(call: Callable[[], object]) -> float:
    """The median wall seconds of `REPEATS` calls, ranks aligned by a barrier before each."""
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        call()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def measure(
    example: str, options: dict[str, Any], c: autoplan.Cluster, tmp: Path
) -> dict[str, Any]:
    w = load_workload(ROOT / "examples" / f"{example}.py", **options)
    directory = tmp / example
    first = parallel(w, c, options=SAVED_UNDER[1](w), train=TRAIN)
    for _ in range(2):
        first(w.example_inputs, w.example_target)
    save_s = _seconds(lambda: first.save(directory))  # each replaces the one before
    row: dict[str, Any] = {
        "model": f"{example} {options}",
        "params_M": round(sum(p.numel() for p in w.model.parameters()) / 1e6, 2),
        "checkpoint_MB": round(_size(directory / "step-00000002") / 1e6, 1),
        "save_s": round(save_s, 3),
    }
    for name, layout in LOADED_UNDER:
        step = parallel(w, c, options=layout(w), train=TRAIN)
        row[f"load_s ({name})"] = round(_seconds(lambda step=step: step.load(directory)), 3)
    row["export_s"] = round(_seconds(lambda: first.export(tmp / f"{example}.pt")), 3)
    return row


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    c = cluster(dist.get_world_size())
    box = [tempfile.mkdtemp(prefix="autoplan-checkpoint-")]
    dist.broadcast_object_list(box, src=0)  # one directory for all ranks (the same host)
    tmp = Path(box[0])
    rows = [measure(example, options, c, tmp) for example, options in SETUPS]
    if dist.get_rank() == 0:
        shutil.rmtree(tmp)
        columns = [
            "model",
            "params_M",
            "checkpoint_MB",
            "save_s",
            *[f"load_s ({name})" for name, _ in LOADED_UNDER],
            "export_s",
        ]
        meta = {
            "command": "python benchmarks/checkpoint.py",
            "ranks": f"{dist.get_world_size()} CPU processes (gloo), one thread each",
            "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
            "saved under": SAVED_UNDER[0],
            "how": f"median of {REPEATS} calls, ranks aligned by barriers; local disk",
        }
        write_results("checkpoint", "Checkpoint costs on 4 CPU ranks", meta, rows, columns)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        torchrun(__file__, 4)

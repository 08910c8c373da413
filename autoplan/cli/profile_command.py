"""`autoplan profile`: measure this cluster under torchrun and write its cluster file."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from autoplan.cli.arguments import at_least_one
from autoplan.cli.elastic import Nodes
from autoplan.cli.launch import torchrun
from autoplan.cli.progress_line import ProgressLine
from autoplan.cluster.hardware import BACKENDS
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.profile import Settings, base_refusal, profile_cluster


def add_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("profile", help="measure this cluster (torchrun) and write its cluster file")
    f.add_argument("--nproc", type=at_least_one, help="processes (devices) per node (required)")
    f.add_argument(
        "--nnodes", type=at_least_one, default=1, help="nodes; run the same command on each"
    )
    f.add_argument("--rdzv-endpoint", help="HOST:PORT where the nodes meet (with --nnodes > 1)")
    f.add_argument("-o", "--output", required=True, help="the cluster file to write")
    f.add_argument("--backend", choices=BACKENDS, help="default: nccl with CUDA, else gloo")
    f.add_argument(
        "--base",
        help="with --nproc 1 (one device, no collectives to measure): the cluster file whose "
        "links, node shape and backend to keep, e.g. costmodels/h100-sxm-8.json",
    )
    defaults = Settings()
    f.add_argument(
        "--max-bytes",
        type=int,
        default=defaults.max_bytes,
        help=f"largest message and element-wise tensor (default {defaults.max_bytes})",
    )
    f.add_argument(
        "--max-matmul-dim",
        type=int,
        default=defaults.max_matmul_dim,
        help=f"largest n of the n x n matmuls (default {defaults.max_matmul_dim})",
    )
    f.add_argument(
        "--max-seconds",
        type=float,
        default=defaults.max_seconds,
        help=f"end a curve before a call would take longer (default {defaults.max_seconds:g})",
    )
    f.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help=f"timed runs per size, median kept (default {defaults.repeats})",
    )


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Outside torchrun: check the arguments and start the ranks; on a rank: measure."""
    if "RANK" not in os.environ:
        if args.nproc is None:
            raise AutoplanError("autoplan profile needs --nproc N: processes per node")
        if (args.nproc * args.nnodes == 1) != (args.base is not None):
            raise AutoplanError(base_refusal(args.nproc * args.nnodes))
        if args.base is not None:
            Cluster.load(args.base)  # a bad file is refused before torchrun starts
        return torchrun(argv, args.nproc, Nodes(args.nnodes, args.nnodes), args.rdzv_endpoint)
    settings = Settings(
        max_bytes=args.max_bytes,
        max_matmul_dim=args.max_matmul_dim,
        max_seconds=args.max_seconds,
        repeats=args.repeats,
    )
    progress = ProgressLine(after_s=0.0)  # a profile takes minutes
    base = None if args.base is None else Cluster.load(args.base)
    cluster = profile_cluster(
        Path(args.output).stem, settings, args.backend, None if args.quiet else progress, base=base
    )
    if cluster is None:  # not rank 0
        return 0
    progress.end()
    cluster.save(args.output)
    print(f"wrote {args.output}: {cluster.source}")
    return 0

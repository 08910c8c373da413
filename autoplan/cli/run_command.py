"""`autoplan run`: plan and train a workload on local processes (torchrun), and optionally
check it against training in one process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence

from autoplan.cli.arguments import (
    add_plan_options,
    add_progress,
    add_workload,
    at_least_one,
    plan_options,
    positive,
    workload_options,
)
from autoplan.cli.launch import torchrun
from autoplan.cli.progress_line import ProgressLine, StepLine
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.execute.checkpoint import check_writable, latest
from autoplan.graph.capture import capture_microbatches, export_step
from autoplan.graph.convert import graph_from_export
from autoplan.graph.diagnose import refuse_non_loss
from autoplan.options import TrainOptions
from autoplan.parallel import check_given_plan, check_trainable
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import summary
from autoplan.training import (
    Checkpointing,
    StepRecord,
    compare,
    one_process,
    summarize,
    train,
)
from autoplan.workload import load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="plan and train a workload on local processes (torchrun)")
    add_workload(r)
    r.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    r.add_argument(
        "--nproc", type=at_least_one, help="processes to start (default: the cluster's devices)"
    )
    r.add_argument("--plan", help="train with this plan instead of planning")
    r.add_argument("--steps", type=at_least_one, default=5, help="train steps (default 5)")
    r.add_argument(
        "--lr",
        type=positive,
        default=1e-4,
        help="learning rate (default 1e-4: Adam scales gradients near zero up to full steps, "
        "so at larger rates float32 rounding alone moves some weights past --check's 1e-5)",
    )
    r.add_argument(
        "--check",
        action="store_true",
        help=(
            "train the same steps in one process and compare losses and parameters (1e-5; "
            "in mixed precision against autocast, within bf16's reach: see the README)"
        ),
    )
    r.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save checkpoints here (DIR/step-NNNNNNNN)"
    )
    r.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="save every N steps and after the last (default: after the last only)",
    )
    r.add_argument(
        "--checkpoint-keep", type=int, metavar="K", help="keep the newest K checkpoints (all)"
    )
    r.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir, under this run's plan "
        "whatever plan saved it (--steps counts from the beginning)",
    )
    r.add_argument(
        "--export-to", metavar="FILE", help="after training, save the whole state dict to FILE"
    )
    r.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="end the job if a step takes longer than S seconds, e.g. a rank stopped or stuck "
        "(default: 10x the plan's predicted step time, at least 60)",
    )
    add_progress(r)
    add_plan_options(r)


def _cluster(args: argparse.Namespace) -> Cluster:
    """The cluster file; a one-node file is fitted to --nproc local processes."""
    cluster = Cluster.load(args.cluster)
    nproc = args.nproc or int(os.environ.get("WORLD_SIZE", cluster.num_devices))
    if nproc != cluster.num_devices:
        if cluster.num_nodes != 1:
            raise AutoplanError(
                f"--nproc {nproc} does not match cluster {cluster.name!r} "
                f"({cluster.num_devices} devices on {cluster.num_nodes} nodes)"
            )
        cluster = dataclasses.replace(
            cluster, devices_per_node=nproc, name=f"{cluster.name}-{nproc}"
        )
    return cluster


def _train_options(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(optimizer_options={"lr": args.lr}, timeout_s=args.timeout)


def _checkpointing(args: argparse.Namespace) -> Checkpointing:
    return Checkpointing(
        directory=args.checkpoint_dir,
        every=args.checkpoint_every,
        keep=args.checkpoint_keep,
        resume=args.resume,
        export_to=args.export_to,
    )


def _check(args: argparse.Namespace, cluster: Cluster) -> None:
    """What `autoplan run` can check before it starts any process: its options, the workload
    loads, has something to train and traces to a loss on its example inputs (their dtypes
    against the model's), the mesh against the processes, a plan it is given fits the model,
    the processes and the devices' memory, the checkpoint folder takes files and a checkpoint
    to resume from is intact. Its errors come once, before torchrun; its warnings not at all:
    rank 0 repeats every check."""
    _train_options(args)
    ckpt = _checkpointing(args)
    logging.disable(logging.WARNING)
    try:
        w = load_workload(args.workload, **workload_options(args.set))
        check_trainable(w.model)
        options = plan_options(args, ProgressLine(args.progress_after))
        if options.mesh_shape is not None:
            cluster.check_mesh_shape(options.mesh_shape)
        precision = (
            Plan.from_json(args.plan).mixed_precision
            if args.plan is not None
            else options.mixed_precision
        )
        ep = export_step(w.model, w.example_inputs, w.loss_fn, w.example_target, precision)
        refuse_non_loss(ep, w.model, w.loss_fn is not None)
        if args.plan is not None:
            graph = graph_from_export(ep, precision)
            traced = capture_microbatches(
                w.model, w.example_inputs, w.loss_fn, w.example_target, precision
            )
            check_given_plan(args.plan, lambda n: graph if n == 1 else traced(n), cluster, options)
        if ckpt.directory is not None:
            check_writable(ckpt.directory)
            if ckpt.resume:
                latest(ckpt.directory)  # an error if every checkpoint there is damaged
    finally:
        logging.disable(logging.NOTSET)


def _shown(records: Iterable[StepRecord], line: StepLine) -> list[StepRecord]:
    """``records`` as they come, each drawn on ``line``."""
    done = []
    try:
        for r in records:
            line(r)
            done.append(r)
    finally:
        line.end()
    return done


def _peak_memory(cluster: Cluster) -> float | None:
    """The largest rank's ``torch.cuda.max_memory_allocated`` on GPUs; None on CPU ranks,
    where torch keeps no such count. Every rank calls it (a collective on GPUs)."""
    if cluster.backend != "nccl":
        return None
    import torch
    import torch.distributed as dist

    peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Outside torchrun: check what can be checked and start the ranks; on a rank: train."""
    if "RANK" not in os.environ:
        cluster = _cluster(args)
        _check(args, cluster)
        return torchrun(argv, cluster.num_devices)
    import torch.distributed as dist

    cluster = _cluster(args)
    options = workload_options(args.set)
    workload = load_workload(args.workload, **options)
    progress = ProgressLine(args.progress_after)
    planning = plan_options(args, progress)
    training = _train_options(args)
    try:
        step, records = train(
            workload,
            cluster,
            args.steps,
            plan=args.plan,
            options=planning,
            train_options=training,
            checkpointing=_checkpointing(args),
        )
    finally:
        progress.end()
    start = step.steps_done  # resumed from a checkpoint: the steps already taken
    rank0 = dist.get_rank() == 0
    if rank0:
        assert step.plan is not None
        print(summary(step.plan), flush=True)
        world = dist.get_world_size()
        steps = f"steps {start + 1}-{args.steps}" if start else f"{args.steps} steps"
        print(f"\ntraining {steps} on {world} processes ({cluster.backend})")
    done = list(records) if not rank0 else _shown(records, StepLine(args.steps, start))
    losses = [r.loss for r in done]
    peak = _peak_memory(cluster)
    if rank0 and done:
        assert step.plan is not None
        print("\n".join(["", *summarize(done, step.plan, peak).lines()]), flush=True)
    code = 0
    if args.check:
        state = step.state_dict()  # gathers on every rank
        if rank0:
            assert step.plan is not None
            precision = step.plan.mixed_precision
            ref_losses, ref_state = one_process(
                lambda: load_workload(args.workload, **options),
                args.steps,
                planning.optimizer,
                training,
                precision,
            )
            initial = load_workload(args.workload, **options).model.state_dict()
            found = compare(
                losses, state, (ref_losses[start:], ref_state), initial, precision is not None
            )
            code = 0 if found.ok else 1
            print(found)
    dist.destroy_process_group()
    return code

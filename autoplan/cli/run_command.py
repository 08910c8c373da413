"""`autoplan run`: plan and train a workload on local processes (torchrun), and optionally
check it against training in one process."""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from autoplan.cli.elastic import ONE_NODE, may_restart, nodes, plan_for_world
from autoplan.cli.launch import torchrun
from autoplan.cli.progress_line import ProgressLine, StepLine
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError, CheckError
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
    float32_rounding,
    memory_traced,
    one_process,
    summarize,
    train,
)
from autoplan.workload import load_workload

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="plan and train a workload on local processes (torchrun)")
    add_workload(r)
    r.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    r.add_argument(
        "--nproc",
        type=at_least_one,
        help="processes to start, on each node with --nnodes (default: the cluster's devices, "
        "or a node's)",
    )
    r.add_argument(
        "--plan",
        action="append",
        default=[],
        help="train with this plan instead of planning; give it again for other numbers of "
        "processes (--nnodes MIN:MAX: a start without a plan for its processes plans)",
    )
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
            "train the same steps in one process and compare losses and parameters (1e-5, or "
            "twice what rounding alone moves one process, in float64 or its batch reversed, where "
            "more; in mixed precision against autocast, within bf16's reach: see "
            "docs/mixed-precision.md)"
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
    r.add_argument(
        "--no-check-step",
        dest="check_step",
        action="store_false",
        help="skip running each rank's planned step on fake tensors before training "
        "(TrainOptions.check_step)",
    )
    e = r.add_argument_group(
        "nodes and restarts",
        "run the same command on each node; a restart resumes from the newest intact "
        "checkpoint in --checkpoint-dir, planned for the processes it has (docs/checkpoints.md: "
        "What survives what)",
    )
    e.add_argument(
        "--nnodes",
        type=nodes,
        default=ONE_NODE,
        metavar="N|MIN:MAX",
        help="nodes; MIN:MAX goes on with fewer nodes, down to MIN, when one is lost (default 1)",
    )
    e.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the nodes meet")
    e.add_argument(
        "--rdzv-conf",
        metavar="KEY=VALUE,...",
        help="torchrun's rendezvous settings, e.g. keep_alive_interval=1,last_call_timeout=5 "
        "(seconds: a lost node is dropped after keep_alive_interval x keep_alive_max_attempt, "
        "5 x 3 by default; a new rendezvous waits last_call_timeout, 30, for more nodes)",
    )
    e.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="start the processes again after a failure, up to N times (default 0)",
    )
    add_progress(r)
    add_plan_options(r)


def _cluster(args: argparse.Namespace) -> Cluster:
    """The cluster file fitted to the job's processes: on a rank, those torchrun started (after
    a restart, on the nodes left); before the start, ``--nproc`` on each of ``--nnodes`` (at
    most)."""
    cluster = Cluster.load(args.cluster)
    if "WORLD_SIZE" in os.environ:
        return _fitted(cluster, int(os.environ["WORLD_SIZE"]))
    if args.nnodes == ONE_NODE:
        return _fitted(cluster, args.nproc or cluster.num_devices)
    return _fitted(cluster, (args.nproc or cluster.devices_per_node) * args.nnodes.max)


def _fitted(cluster: Cluster, world: int) -> Cluster:
    """``cluster`` with ``world`` devices: a one-node file's node has them, a file of more
    nodes has as many of its nodes as hold them."""
    if world == cluster.num_devices:
        return cluster
    name = f"{cluster.name}-{world}"
    if cluster.num_nodes == 1:
        return dataclasses.replace(cluster, devices_per_node=world, name=name)
    if world % cluster.devices_per_node == 0:
        return dataclasses.replace(cluster, num_nodes=world // cluster.devices_per_node, name=name)
    raise AutoplanError(
        f"{world} processes do not fill nodes of cluster {cluster.name!r} ({cluster.num_nodes} "
        f"nodes of {cluster.devices_per_node} devices); start {cluster.devices_per_node} on "
        f"each node (--nproc {cluster.devices_per_node}), or give a cluster file of {world} "
        "devices"
    )


def _plans(paths: Sequence[str]) -> dict[str, int]:
    """Each plan file given -> the number of devices it is for."""
    return {path: len(Plan.from_json(path).mesh.ranks) for path in paths}


def _check_restarts(args: argparse.Namespace) -> None:
    """What a job that may start again needs."""
    if args.max_restarts < 0:
        raise AutoplanError(f"--max-restarts {args.max_restarts}: give 0 or more")
    if args.nnodes != ONE_NODE and args.rdzv_endpoint is None:
        raise AutoplanError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, on one of the nodes"
        )
    if may_restart(args.nnodes, args.max_restarts) and args.checkpoint_dir is None:
        raise AutoplanError(
            "a restart resumes from the newest checkpoint (--max-restarts, --nnodes MIN:MAX): "
            "give --checkpoint-dir DIR, and --checkpoint-every N to lose at most N steps"
        )
    if args.nnodes.elastic and args.mesh_shape is not None:
        raise AutoplanError(
            f"--mesh fixes the number of processes, but --nnodes {args.nnodes} lets it change: "
            "leave --mesh out (each start plans for the processes it has), or give a --plan "
            "for each number"
        )


def _train_options(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(
        optimizer_options={"lr": args.lr}, timeout_s=args.timeout, check_step=args.check_step
    )


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
    _check_restarts(args)
    ckpt = _checkpointing(args)
    logging.disable(logging.WARNING)
    try:
        w = load_workload(args.workload, **workload_options(args.set))
        check_trainable(w.model)
        options = plan_options(args, ProgressLine(args.progress_after))
        if options.mesh_shape is not None:
            cluster.check_mesh_shape(options.mesh_shape)
        plans = _plans(args.plan)
        # the plan for the processes, checked here where their number is fixed; one for
        # another number is checked too, to say so
        given = None
        if plans and not args.nnodes.elastic:
            given = plan_for_world(plans, cluster.num_devices)[0] or args.plan[0]
        precision = Plan.from_json(given).mixed_precision if given else options.mixed_precision
        ep = export_step(w.model, w.example_inputs, w.loss_fn, w.example_target, precision)
        refuse_non_loss(ep, w.model, w.loss_fn is not None)
        if given is not None:
            graph = graph_from_export(ep, precision)
            traced = capture_microbatches(
                w.model, w.example_inputs, w.loss_fn, w.example_target, precision
            )
            check_given_plan(given, lambda n: graph if n == 1 else traced(n), cluster, options)
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


def _peak_memory(cluster: Cluster, done: Sequence[StepRecord]) -> float | None:
    """The largest rank's peak memory: ``torch.cuda.max_memory_allocated`` on GPUs, on CPU
    ranks the last step's as MemTracker traced it (`autoplan.training.memory_traced`); None
    where no step ran. Every rank calls it (a collective)."""
    import torch
    import torch.distributed as dist

    if not memory_traced(cluster):
        peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
    elif done and done[-1].peak_bytes is not None:
        peak = torch.tensor([done[-1].peak_bytes])
    else:
        return None
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Outside torchrun: check what can be checked and start the ranks (again after a failure
    or a lost node, `autoplan.cli.elastic`); on a rank: train with the plan for the processes
    it has."""
    if "RANK" not in os.environ:
        cluster = _cluster(args)
        _check(args, cluster)
        return torchrun(
            [*argv, "--resume"] if may_restart(args.nnodes, args.max_restarts) else argv,
            cluster.num_devices // args.nnodes.max,
            args.nnodes,
            args.rdzv_endpoint,
            rdzv_conf=args.rdzv_conf,
            max_restarts=args.max_restarts,
        )
    import torch.distributed as dist

    cluster = _cluster(args)
    world = cluster.num_devices
    plan, replanning = plan_for_world(_plans(args.plan), world)
    if replanning and os.environ["RANK"] == "0":
        log.warning("%s", replanning)
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
            plan=plan,
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
        restored = step.resumed_from
        if restored is not None and restored.world_size not in (None, world):
            into = f"plan {plan}" if plan else f"a new plan for {world} processes"
            print(
                f"\nresumed from {restored.path}, saved by {restored.world_size} processes: "
                f"resharded into {into}"
            )
        steps = f"steps {start + 1}-{args.steps}" if start else f"{args.steps} steps"
        print(f"\ntraining {steps} on {world} processes ({cluster.backend})")
    done = list(records) if not rank0 else _shown(records, StepLine(args.steps, start))
    losses = [r.loss for r in done]
    peak = _peak_memory(cluster, done)
    if rank0 and done:
        assert step.plan is not None
        print("\n".join(["", *summarize(done, step.plan, peak).lines()]), flush=True)
    differs = None
    if args.check:
        state = step.state_dict()  # gathers on every rank
        if rank0:
            assert step.plan is not None
            precision = step.plan.mixed_precision
            make = functools.partial(load_workload, args.workload, **options)
            reference = one_process(make, args.steps, planning.optimizer, training, precision)
            ref_losses, ref_state = reference
            initial = load_workload(args.workload, **options).model.state_dict()
            found = compare(
                losses, state, (ref_losses[start:], ref_state), initial, precision is not None
            )
            if not found.ok and precision is None:  # within what rounding alone makes?
                rounding = float32_rounding(
                    make, args.steps, planning.optimizer, training, reference
                )
                found = dataclasses.replace(found, rounding=rounding)
            print(found, flush=True)
            differs = None if found.ok else found
    dist.destroy_process_group()
    if differs is not None:  # told once, as every rank's error is (`autoplan.cli.failure`)
        raise CheckError(
            f"{differs}. A model that draws random numbers in training (dropout, drop path) "
            "draws otherwise on more processes, and Adam moves a weight whose gradient is near "
            f"zero by a full step either way, so at --lr {args.lr:g} rounding alone may move it "
            "that far: check with those probabilities 0 or a smaller --lr; if neither explains "
            "it, please report it"
        )
    return 0

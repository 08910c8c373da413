"""`autoplan profile|plan|show|estimate|run`: the command line. The only module that configures
logging: warnings only by default (``-v`` adds the planner's account of what it tried, ``-vv``
the solvers' own logs), and long work shows progress on stderr instead (`ProgressLine`)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autoplan.api import plan as make_plan
from autoplan.cluster.hardware import BACKENDS
from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError
from autoplan.estimate import estimate
from autoplan.execute.watchdog import step_timeout
from autoplan.graph.capture import capture_microbatches
from autoplan.modes import RecomputeMode, ReduceDtype
from autoplan.options import PlanOptions, TrainOptions
from autoplan.parallel import check_given_plan, check_trainable
from autoplan.planfile.check import check_plan
from autoplan.planfile.picture import render_png
from autoplan.planfile.schema import Plan
from autoplan.planfile.show import summary
from autoplan.precision import COMPUTE_DTYPES
from autoplan.profile import Settings, base_refusal, profile_cluster
from autoplan.progress import Progress
from autoplan.training import Checkpointing, compare, one_process, train
from autoplan.workload import load_workload

log = logging.getLogger("autoplan.cli")

PROGRESS_AFTER_S = 3.0  # planning quicker than this shows no progress


class ProgressLine:
    """Progress on stderr once the work has run ``after_s`` seconds: on a terminal one line
    redrawn in place, in a log one line per milestone (a curve measured, a mesh planned)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.redraw = sys.stderr.isatty()
        self.drawn = False

    def __call__(self, p: Progress) -> None:
        if p.elapsed < self.after_s:
            return
        if self.redraw:
            print(f"\r{p.line()}\x1b[K", end="", file=sys.stderr, flush=True)
            self.drawn = True
        elif p.milestone:
            print(p.line(), file=sys.stderr, flush=True)

    def end(self) -> None:
        """Ends the line redrawn in place, before other output."""
        if self.drawn:
            print(file=sys.stderr, flush=True)
            self.drawn = False


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


def _at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


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


def _progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress-after",
        type=float,
        default=PROGRESS_AFTER_S,
        metavar="SECONDS",
        help=f"show planning's progress once it has run this long (default {PROGRESS_AFTER_S:g})",
    )


def _pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    pipe = parser.add_mutually_exclusive_group()
    pipe.add_argument(
        "--pipeline",
        action="store_true",
        default=None,
        help=(
            "require pipeline stages (default: weighed against one stage on every cluster "
            "of several devices)"
        ),
    )
    pipe.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="never pipeline")
    parser.add_argument(
        "--stages",
        type=_at_least_one,
        help="number of pipeline stages (interleaved: of device groups, each holding several)",
    )
    parser.add_argument(
        "--microbatches",
        type=_at_least_one,
        help="microbatches per step (pipelines; default: searched on one node)",
    )
    parser.add_argument(
        "--schedule",
        help="pipeline schedule: 1F1B, GPipe, Interleaved1F1B (default: the fastest that fits)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=_at_least_one,
        help="stages on each device group under Interleaved1F1B (implies it; default: searched)",
    )


def _precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mixed-precision",
        choices=sorted(COMPUTE_DTYPES),
        help=(
            "compute in bf16 or fp16 under autocast, with float32 parameters, gradients and "
            "optimizer state (fp16: with loss scaling); default: the model's own dtypes"
        ),
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=tuple(ReduceDtype),
        help=(
            "with --mixed-precision: reduce every gradient in this dtype (fp32: as FSDP2's "
            "reduce_dtype=float32, Megatron's --accumulate-allreduce-grads-in-fp32); default: "
            "each reduced in float32 or in the compute dtype, whichever the plan prices cheaper"
        ),
    )


def _recompute_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recompute",
        choices=tuple(RecomputeMode),
        help=(
            "activation recomputation: none, full (every layer's blocks run their forward "
            "again in backward) or selective (only their attention cores); default: the "
            "planner chooses, layer by layer, for the fastest plan that fits"
        ),
    )


def _plan_options(args: argparse.Namespace, progress: ProgressLine) -> PlanOptions:
    """The planner's options from the command line; `autoplan run` has no --pin, --optimizer
    or --time-limit, whose defaults then apply."""
    defaults = PlanOptions()
    return PlanOptions(
        on_progress=None if args.quiet else progress,
        mesh_shape=_mesh(args.mesh),
        pin=_pins(getattr(args, "pin", [])),
        optimizer=getattr(args, "optimizer", defaults.optimizer),
        time_limit_s=getattr(args, "time_limit", defaults.time_limit_s),
        pipeline=args.pipeline,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        mixed_precision=args.mixed_precision,
        reduce_dtype=args.reduce_dtype,
        recompute=args.recompute,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoplan", description=__doc__)
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="print only results (and warnings)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what the planner tries (-vv: and the ILP solver's own log)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="trace a workload file and plan it for a cluster")
    p.add_argument("workload", help="a Python file defining workload() (see examples/)")
    p.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    p.add_argument("--nodes", type=_at_least_one, help="number of nodes (default: the file's)")
    p.add_argument("--mesh", help="pin the logical mesh, e.g. 4 or 2,2")
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="workload option"
    )
    p.add_argument(
        "--pin", action="append", default=[], metavar="PARAM=PLACEMENTS", help="pin a parameter"
    )
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, sgd_momentum")
    p.add_argument("--time-limit", type=_positive, default=60.0, help="ILP time limit per mesh (s)")
    _pipeline_arguments(p)
    _precision_argument(p)
    _recompute_argument(p)
    _progress_argument(p)
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan")

    s = sub.add_parser("show", help="summarize a plan file")
    s.add_argument("plan", help="a plan JSON file")
    s.add_argument("--png", help="also draw the pipeline stages and schedule to this PNG file")
    s.add_argument("--cluster", help="also check the plan's mesh against this cluster file")
    s.add_argument("--nodes", type=_at_least_one, help="number of nodes (default: the file's)")

    e = sub.add_parser("estimate", help="re-price a plan (edited, or for another cluster)")
    e.add_argument("workload", help="the workload file the plan was made for")
    e.add_argument("--plan", required=True, help="a plan JSON file")
    e.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    e.add_argument("--nodes", type=_at_least_one, help="number of nodes (default: the file's)")
    e.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="workload option"
    )
    e.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, sgd_momentum")
    e.add_argument("-o", "--output", help="also write the re-priced plan here")

    r = sub.add_parser("run", help="plan and train a workload on local processes (torchrun)")
    r.add_argument("workload", help="a Python file defining workload() (see examples/)")
    r.add_argument("--cluster", required=True, help="a cluster file (see costmodels/)")
    r.add_argument(
        "--nproc", type=_at_least_one, help="processes to start (default: the cluster's devices)"
    )
    r.add_argument("--plan", help="train with this plan instead of planning")
    r.add_argument("--mesh", help="pin the logical mesh, e.g. 4 or 2,2")
    _pipeline_arguments(r)
    _precision_argument(r)
    _recompute_argument(r)
    _progress_argument(r)
    r.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="workload option"
    )
    r.add_argument("--steps", type=_at_least_one, default=5, help="train steps (default 5)")
    r.add_argument(
        "--lr",
        type=_positive,
        default=1e-4,
        help="AdamW learning rate (default 1e-4: Adam scales gradients near zero up to full "
        "steps, so at larger rates float32 rounding alone moves some weights past --check's 1e-5)",
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

    f = sub.add_parser("profile", help="measure this cluster (torchrun) and write its cluster file")
    f.add_argument("--nproc", type=_at_least_one, help="processes (devices) per node (required)")
    f.add_argument(
        "--nnodes", type=_at_least_one, default=1, help="nodes; run the same command on each"
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
    return parser


def _plan(args: argparse.Namespace) -> None:
    cluster = Cluster.load(args.cluster, num_nodes=args.nodes)
    workload = load_workload(args.workload, **_options(args.set))
    start = time.perf_counter()
    progress = ProgressLine(args.progress_after)
    try:
        result = make_plan(
            workload.model,
            workload.example_inputs,
            cluster,
            loss_fn=workload.loss_fn,
            example_target=workload.example_target,
            options=_plan_options(args, progress),
        )
    finally:
        progress.end()  # before the plan, or the error
    result.save(args.output)
    print(summary(result))
    print(f"\nwrote {args.output} ({time.perf_counter() - start:.1f} s)")


def _estimate(args: argparse.Namespace) -> None:
    workload = load_workload(args.workload, **_options(args.set))
    priced = estimate(
        args.plan,
        Cluster.load(args.cluster, num_nodes=args.nodes),
        workload.model,
        workload.example_inputs,
        loss_fn=workload.loss_fn,
        example_target=workload.example_target,
        optimizer=args.optimizer,
    )
    print(summary(priced))
    if priced.predicted.peak_memory_bytes > priced.predicted.memory_limit_bytes:
        print("\nwarning: this plan needs more memory per device than the cluster offers")
    if args.output:
        priced.save(args.output)
        print(f"\nwrote {args.output}")


def _run_cluster(args: argparse.Namespace) -> Cluster:
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


def _check_run(args: argparse.Namespace, cluster: Cluster) -> None:
    """What `autoplan run` can check before it starts any process: the workload loads and has
    something to train, and a plan it is given fits the model and the processes. Its errors
    come once, before torchrun; its warnings not at all: rank 0 repeats every check."""
    logging.disable(logging.WARNING)
    try:
        w = load_workload(args.workload, **_options(args.set))
        check_trainable(w.model)
        if args.plan is not None:
            precision = Plan.from_json(args.plan).mixed_precision
            traced = capture_microbatches(
                w.model, w.example_inputs, w.loss_fn, w.example_target, precision
            )
            check_given_plan(
                args.plan, traced, cluster, _plan_options(args, ProgressLine(args.progress_after))
            )
    finally:
        logging.disable(logging.NOTSET)


def _torchrun(
    argv: Sequence[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None
) -> int:
    """Start this command again as ``nproc`` processes per node under torchrun; they do the
    work. One node rendezvous on its own; more nodes each run the same command and meet at
    ``rdzv_endpoint``."""
    # The ranks learn their number from torchrun (WORLD_SIZE, LOCAL_WORLD_SIZE); left in,
    # torchrun would take these as its own (--nproc as --nproc-per-node).
    ours = ("--nproc", "--nnodes", "--rdzv-endpoint")
    rest = [
        a
        for a, prev in zip(argv, ["", *argv[:-1]], strict=True)
        if a not in ours and prev not in ours and a.partition("=")[0] not in ours
    ]
    if nnodes == 1:
        where = ["--standalone"]
    elif rdzv_endpoint:
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        raise AutoplanError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT of one node")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        "-m",
        "autoplan.cli",
        *rest,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode


def _checkpointing(args: argparse.Namespace) -> Checkpointing:
    if args.timeout is not None:
        step_timeout(1.0, args.timeout)  # refused before torchrun starts
    return Checkpointing(
        directory=args.checkpoint_dir,
        every=args.checkpoint_every,
        keep=args.checkpoint_keep,
        resume=args.resume,
        export_to=args.export_to,
    )


def _train(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    cluster = _run_cluster(args)
    options = _options(args.set)
    workload = load_workload(args.workload, **options)
    progress = ProgressLine(args.progress_after)
    try:
        step, records = train(
            workload,
            cluster,
            args.steps,
            plan=args.plan,
            options=_plan_options(args, progress),
            train_options=TrainOptions(optimizer_options={"lr": args.lr}, timeout_s=args.timeout),
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
    losses = []
    for r in records:
        losses.append(r.loss)
        if rank0:
            print(
                f"step {r.step:>3}  loss {r.loss:.6f}  {r.seconds * 1e3:8.1f} ms  "
                f"{r.throughput:,.0f} {r.unit}",
                flush=True,
            )
    code = 0
    if args.check:
        state = step.state_dict()  # gathers on every rank
        if rank0:
            assert step.plan is not None
            precision = step.plan.mixed_precision
            ref_losses, ref_state = one_process(
                lambda: load_workload(args.workload, **options), args.steps, args.lr, precision
            )
            initial = load_workload(args.workload, **options).model.state_dict()
            found = compare(
                losses, state, (ref_losses[start:], ref_state), initial, precision is not None
            )
            code = 0 if found.ok else 1
            print(found)
    dist.destroy_process_group()
    return code


def _profile(args: argparse.Namespace) -> None:
    settings = Settings(
        max_bytes=args.max_bytes,
        max_matmul_dim=args.max_matmul_dim,
        max_seconds=args.max_seconds,
        repeats=args.repeats,
    )
    progress = ProgressLine(after_s=0.0)  # a profile takes minutes
    name = Path(args.output).stem
    base = None if args.base is None else Cluster.load(args.base)
    cluster = profile_cluster(
        name, settings, args.backend, None if args.quiet else progress, base=base
    )
    if cluster is None:  # not rank 0
        return
    progress.end()
    cluster.save(args.output)
    print(f"wrote {args.output}: {cluster.source}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    levels = [logging.WARNING, logging.INFO, logging.DEBUG]
    logging.basicConfig(
        level=levels[0 if args.quiet or rank != 0 else min(args.verbose, 2)],
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        if args.command == "plan":
            _plan(args)
        elif args.command == "show":
            cluster = (
                None if args.cluster is None else Cluster.load(args.cluster, num_nodes=args.nodes)
            )
            shown = check_plan(Plan.from_json(args.plan), cluster=cluster)
            print(summary(shown))
            if args.png:
                render_png(shown, args.png)
                print(f"\nwrote {args.png}")
        elif args.command == "estimate":
            _estimate(args)
        elif args.command == "run":
            if "RANK" in os.environ:
                return _train(args)
            _checkpointing(args)  # bad options are refused before torchrun starts
            cluster = _run_cluster(args)
            _check_run(args, cluster)
            return _torchrun(argv, cluster.num_devices)
        elif args.command == "profile":
            if "RANK" not in os.environ:
                if args.nproc is None:
                    raise AutoplanError("autoplan profile needs --nproc N: processes per node")
                if (args.nproc * args.nnodes == 1) != (args.base is not None):
                    raise AutoplanError(base_refusal(args.nproc * args.nnodes))
                if args.base is not None:
                    Cluster.load(args.base)  # a bad file is refused before torchrun starts
                return _torchrun(argv, args.nproc, args.nnodes, args.rdzv_endpoint)
            _profile(args)
    except AutoplanError as e:
        where = f" on rank {rank}" if "RANK" in os.environ else ""
        print(f"autoplan: error{where}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ:
        # A rank (started by torchrun as `python -m autoplan.cli`) has done its work and left
        # its process group. Interpreter exit can still abort in torch 2.13's C++ teardown
        # (SIGABRT, "terminate called without an active exception"; seen after a checked run
        # had printed OK), which fails the whole job: end without those destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

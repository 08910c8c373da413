"""Runs under torchrun: trains every case of one world size in parallel and in one process,
and writes what the tests assert on (rank 0) to the JSON file named on the command line.
tests/test_distributed.py names the cases of a selection of its parity tests alone (``-k``)
in the environment variable AUTOPLAN_TEST_CASES: then only those run, and no other check."""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import json
import operator
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.execute.checkpointed import RecomputedRegion  # noqa: E402
from autoplan.execute.comms import (  # noqa: E402
    CollectiveRecorder,
    issued,
    issued_routed_bytes,
    planned,
    planned_routed_bytes,
)
from autoplan.execute.interpreter import PlanInterpreter  # noqa: E402
from autoplan.execute.pipeline import batch_args  # noqa: E402
from autoplan.execute.placements import held_layouts, logical  # noqa: E402
from autoplan.execute.randomness import Draws  # noqa: E402
from autoplan.planfile.show import summary  # noqa: E402
from autoplan.version import torch_release  # noqa: E402
from autoplan.workload import Workload, load_workload  # noqa: E402
from tests.distributed.cases import (  # noqa: E402
    CASES,
    MLP_LARGE_BATCH,
    Case,
    cluster,
    data_parallel,
    mlp_megatron,
    zero3,
    zero12,
)
from tests.distributed.checkpoints import checkpoints  # noqa: E402
from tests.distributed.sends import planned_sends, recorded_sends, send_text  # noqa: E402
from tests.distributed.training import (  # noqa: E402
    LR,
    STEPS,
    layout_keyword,
    parallel,
    reference,
)


def _workload_file(name: str) -> Path:
    """An example, or a model of the tests' own (tests/models/)."""
    example = ROOT / "examples" / f"{name}.py"
    return example if example.exists() else ROOT / "tests" / "models" / f"{name}.py"


def workload(case: Case) -> Workload:
    w = load_workload(_workload_file(case.example), **case.options)
    for name in case.frozen:
        w.model.get_parameter(name).requires_grad_(False)
    return w


def run_case(case: Case, c: autoplan.Cluster) -> dict[str, Any]:
    w = workload(case)
    initial = {n: v.detach().clone() for n, v in w.model.state_dict().items()}
    ref = reference(w, case.max_grad_norm, precision=case.precision, init_scale=case.init_scale)
    step = parallel(
        w,
        c,
        train=autoplan.TrainOptions(
            optimizer_options={"lr": LR},
            max_grad_norm=case.max_grad_norm,
            init_scale=case.init_scale,
            check_step=case.check_step,
        ),
        **layout_keyword(case.plan_layout(w)),
    )
    assert step.optimizer is not None and step.plan is not None
    first_loss, grad, grad_rel = first_step(step, w, ref["grads"])
    losses = [first_loss]

    def scale() -> float:  # after each step's update, as GradScaler.get_scale() tells it
        return step.loss_scaler.scale if step.loss_scaler is not None else 1.0

    scales = [scale()]
    with CollectiveRecorder(step.mesh) as recorder, recorded_sends() as sent:  # type: ignore[arg-type]
        losses.append(step(w.example_inputs, w.example_target).item())
    scales.append(scale())
    for _ in range(STEPS - 2):
        losses.append(step(w.example_inputs, w.example_target).item())
        scales.append(scale())
    params = step.state_dict()
    want, got = planned(step.plan), issued(recorder.issued)
    sends = planned_sends(step.pipeline) if step.pipeline is not None else Counter()
    # each rank checks its own stage's collectives and sends; rank 0 reports them all
    mismatches: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(
        mismatches,
        (
            _text(want - got),
            _text(got - want),
            send_text(sends - Counter(sent)),
            send_text(Counter(sent) - sends),
            sum(sends.values()),
        ),
    )
    # the routed rows' all-to-alls: how many bytes each rank sends is the routing's, their
    # sum over the ranks the plan's
    routed: list[Any] = [None] * dist.get_world_size()
    mine = (planned_routed_bytes(step.plan), issued_routed_bytes(recorder.issued))
    dist.all_gather_object(routed, mine)
    return {
        "routed_bytes": [sum(p for p, _ in routed), sum(i for _, i in routed)],
        "axes": list(step.plan.mesh.axes),
        "shape": list(step.plan.mesh.shape),
        "stages": len(step.plan.stages),
        "placements": sorted({v for p in step.plan.params.values() for v in p.storage.values()}),
        "loss": max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)),
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)),
        "grad": grad,
        "grad_rel": grad_rel,
        "param": max((params[n] - v).abs().max().item() for n, v in ref["params"].items()),
        "update_rel": _relative(
            {n: params[n] - initial[n] for n in ref["params"]},
            {n: v - initial[n] for n, v in ref["params"].items()},
        ),
        # parameters and buffers keep their dtypes (float32 master weights in mixed precision)
        "dtype_changes": sorted(n for n, v in initial.items() if params[n].dtype != v.dtype),
        "precision": step.plan.mixed_precision,
        "scales": scales,
        "ref_scales": ref["scales"],
        "skipped": step.loss_scaler.skipped if step.loss_scaler else 0,
        "planned_not_issued": sorted({m for missing, *_ in mismatches for m in missing}),
        "issued_not_planned": sorted({m for _, extra, *_ in mismatches for m in extra}),
        "sends_planned_not_issued": sorted(
            {m for *_, missing, _, _ in mismatches for m in missing}
        ),
        "sends_issued_not_planned": sorted({m for *_, extra, _ in mismatches for m in extra}),
        "num_sends": sum(n for *_, n in mismatches),
        "num_collectives": sum(want.values()),
        "bytes_by_phase": {
            phase: sum(c.bytes for c in step.plan.collectives if c.phase == phase)
            for phase in sorted({c.phase for c in step.plan.collectives})
        },
        "dtensor_ops": _dtensor_ops(step),
        "local_leaves": _local_leaves(step),
        "kept": sorted(n.module for n in step.plan.nodes.values() if n.grad),
        "recomputed": [layer.layer for layer in step.plan.recompute],
        "recompute_modes": [layer.mode for layer in step.plan.recompute],
        "recompute_collectives": sum(c.phase == "recompute" for c in step.plan.collectives),
        # what `autoplan show` says of attention split along the sequence
        "context_parallel": [
            line.strip() for line in summary(step.plan).splitlines() if "along the seq" in line
        ],
        "regions": _regions(step),
        "saved": _saved(step),
    }


def _interpreter(step: autoplan.Step) -> PlanInterpreter:
    module = step.pipeline.module if step.pipeline is not None else step.module
    assert module is not None
    return module.interpreter


def _regions(step: autoplan.Step) -> int:
    """How many regions of this rank's stage run under torch.utils.checkpoint."""
    return sum(isinstance(item, RecomputedRegion) for item in _interpreter(step).steps)


def _saved(step: autoplan.Step) -> list[int]:
    """How many ops of this rank's stage the plan saves under selective checkpointing, and
    how many saved a kernel's output in forward."""
    regions = _interpreter(step).regions
    return [len(regions.saved), len(regions.kept)]


def _local_leaves(step: autoplan.Step) -> list[int]:
    """How many of this rank's parameters train as plain local leaves, and how many in all."""
    if step.pipeline is not None:
        return [len(step.pipeline.leaves), len(step.pipeline.parameters())]
    assert step.module is not None
    return [len(step.module.placeholders.leaves), len(list(step.module.parameters()))]


def _dtensor_ops(step: autoplan.Step) -> list[str]:
    """The ops of this rank's stage that run as DTensor ops (the others run on local shards)."""
    module = step.pipeline.module if step.pipeline is not None else step.module
    assert module is not None
    interpreter = module.interpreter
    return sorted(
        {
            str(n.target)
            for n in interpreter.graph.nodes
            if n.name in interpreter.nodes
            and n.op == "call_function"
            and n.target is not operator.getitem
            and n.name not in interpreter.local
        }
    )


def first_step(
    step: autoplan.Step, w: Workload, reference: dict[str, torch.Tensor]
) -> tuple[float, float, float]:
    """The first step by hand, comparing gradients before the optimizer uses them: the loss,
    the largest gradient difference over all ranks (each checks its stage's), and the norm
    of the differences over the reference gradients' norm. Under loss scaling, the backward
    starts from the scale and the gradients are unscaled first, as `autoplan.Step` does; a
    step whose gradients overflowed counts as equal if the reference's did too."""
    scaler = step.loss_scaler
    scale = scaler.scale if scaler is not None else 1.0
    if step.pipeline is not None:
        step.pipeline.loss_scale = scale
        loss = step.pipeline.run(batch_args(w.example_inputs, w.example_target))
        named = list(step.pipeline.module.model.named_parameters())
    else:
        assert step.module is not None
        loss = step.module(w.example_inputs, w.example_target)
        loss.backward(torch.full(loss.shape, scale))
        named = list(step.module.named_parameters())
    trained = [(n, p) for n, p in named if isinstance(p, DTensor) and p.requires_grad]
    # a fused projection of unequal pieces is held interleaved: its gradient in model order
    layouts = held_layouts(step.plan) if step.plan is not None else {}

    def whole(n: str, grad: Any) -> torch.Tensor:
        return (logical(grad, layouts[n]) if n in layouts else grad).full_tensor()

    finite = True
    if scaler is not None:
        finite = scaler.unscale([p.grad for _, p in trained if p.grad is not None])
        scaler.update(finite)
    if step.max_grad_norm is not None and finite:
        step.clip_gradients(step.max_grad_norm)
    if not finite:
        overflowed = any(not g.isfinite().all() for g in reference.values())
        got = {n: torch.zeros(()) if overflowed else whole(n, p.grad) for n, p in trained}
        want = {n: torch.zeros(()) if overflowed else reference[n] for n, _ in trained}
    else:
        got = {n: whole(n, p.grad) for n, p in trained}
        want = {n: reference[n] for n, _ in trained}
    diffs = [(got[n] - want[n]).abs().max().item() for n in got]
    # a frozen parameter gets no gradient here, as in one process
    assert all(p.grad is None for _, p in named if not p.requires_grad)
    diff = torch.tensor(max(diffs, default=0.0))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    assert step.optimizer is not None
    if finite:
        step.optimizer.step()
    step.optimizer.zero_grad()
    return loss.item(), diff.item(), _relative(got, want)


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all tensors of all ranks (each tensor once: the ranks of
    a stage hold the same whole tensors, those of other stages others)."""
    mine = {
        n: ((got[n] - w).double().pow(2).sum().item(), w.double().pow(2).sum().item())
        for n, w in want.items()
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {n: v for rank in every for n, v in rank.items()}
    diff, norm = (sum(v[i] for v in merged.values()) for i in (0, 1))
    return float((diff / norm) ** 0.5) if norm else float(diff**0.5)


def _text(counter: Counter[tuple[str, tuple[str, ...], int]]) -> list[str]:
    return [
        f"{n} x {kind} on {'+'.join(axes)}, {nbytes} B"
        for (kind, axes, nbytes), n in sorted(counter.items())
    ]


def _error_of(call: Callable[[], Any]) -> str:
    """The AutoplanError ``call`` raises, as "Type: message", or "no error"."""
    try:
        call()
    except AutoplanError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def error_cases(c: autoplan.Cluster) -> dict[str, str]:
    """Each error as every rank saw it: rank 0 gathers them."""
    found: dict[str, str] = {}
    small = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=16)
    other = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=32)
    plan = small.plan(c)
    found["other_model"] = _error_of(
        lambda: autoplan.parallelize(
            other.model,
            c,
            example_inputs=other.example_inputs,
            loss_fn=other.loss_fn,
            example_target=other.example_target,
            plan=plan,
        )
    )
    # as if made under another torch release: the same graph runs, another is refused
    release = "2.11.0" if torch_release() != "2.11.0" else "2.15.0"
    elsewhere = dataclasses.replace(
        plan, provenance=dataclasses.replace(plan.provenance, torch=release)
    )
    found["other_release_other_model"] = _error_of(
        lambda: autoplan.parallelize(
            other.model,
            c,
            example_inputs=other.example_inputs,
            loss_fn=other.loss_fn,
            example_target=other.example_target,
            plan=elsewhere,
        )
    )
    step = autoplan.parallelize(
        small.model,
        c,
        example_inputs=small.example_inputs,
        loss_fn=small.loss_fn,
        example_target=small.example_target,
        plan=elsewhere,
    )
    loss = step(small.example_inputs, small.example_target).item()
    found["other_release"] = "ok" if loss == loss else f"loss {loss}"
    found["wrong_shape"] = _error_of(lambda: step(torch.randn(4, 16), torch.randn(4, 16)))
    # a hand-edited plan that splits a 2-D weight along dim 7: refused on every rank
    weight = plan.params["layers.0.weight"]
    split = {a: "S(7)" for a in weight.placements}
    bad = dataclasses.replace(
        plan,
        params={**plan.params, "layers.0.weight": dataclasses.replace(weight, placements=split)},
    )
    edited = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=16)
    found["hand_edited"] = _error_of(
        lambda: autoplan.parallelize(
            edited.model,
            c,
            example_inputs=edited.example_inputs,
            loss_fn=edited.loss_fn,
            example_target=edited.example_target,
            plan=bad,
        )
    )
    again = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=16)
    frozen = parallel(again, c, options=data_parallel(again, (world_size(),)))
    assert frozen.module is not None
    frozen.module.get_parameter("layers.0.weight").requires_grad_(False)  # after planning
    found["frozen"] = _error_of(lambda: frozen(again.example_inputs, again.example_target))
    # a parallelized model again: its parameters are DTensors now
    module = frozen.module
    found["twice"] = _error_of(
        lambda: autoplan.parallelize(module, c, example_inputs=again.example_inputs)
    )
    # inputs traced by keyword, then given by position
    keyed = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=16)
    named = autoplan.parallelize(
        keyed.model,
        c,
        example_inputs={"x": keyed.example_inputs[0]},
        loss_fn=keyed.loss_fn,
        example_target=keyed.example_target,
        plan=plan,
    )
    found["keywords"] = _error_of(lambda: named(keyed.example_inputs, keyed.example_target))
    fresh = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=16)
    lazy = autoplan.parallelize(fresh.model, c, loss_fn=fresh.loss_fn)  # plans at the first call
    losses = [lazy(fresh.example_inputs, fresh.example_target).item() for _ in range(2)]
    found["lazy"] = "ok" if losses[1] < losses[0] else f"loss did not fall: {losses}"
    meta = load_workload(ROOT / "examples/mlp.py", batch_size=8, hidden=64, device="meta")
    names = [n for n, _ in meta.model.named_parameters()]
    step = autoplan.parallelize(
        meta.model,
        c,
        example_inputs=torch.randn(8, 64),
        loss_fn=meta.loss_fn,
        example_target=torch.randn(8, 64),
        options=autoplan.PlanOptions(mesh_shape=(world_size(),), pin=dict.fromkeys(names, "S(0)")),
    )
    local = {n: tuple(p.to_local().shape) for n, p in step.module.named_parameters()}  # type: ignore[union-attr]
    loss = step(torch.randn(8, 64), torch.randn(8, 64)).item()
    fine = local["layers.0.weight"] == (64 // world_size(), 64) and loss == loss
    found["meta"] = "ok" if fine else f"local shards {local}, loss {loss}"
    return found


def accumulation(c: autoplan.Cluster) -> dict[str, float]:
    """Two backward passes before the optimizer step, as in one process: the largest gradient
    difference from one process's accumulated gradients, per layout."""
    w = load_workload(ROOT / "examples/mlp.py", **MLP_LARGE_BATCH)
    assert w.loss_fn is not None
    ref = copy.deepcopy(w.model)
    for _ in range(2):
        w.loss(ref).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    mesh = (world_size(),)
    layouts = {
        "dp": data_parallel(w, mesh),
        "zero3": zero3(w, mesh),
        "tp": mlp_megatron(w, mesh),
        "zero1": zero12(1, world_size())(w),
        "zero2": zero12(2, world_size())(w),
    }
    found = {}
    for name, options in layouts.items():
        step = parallel(w, c, options=options)
        assert step.module is not None
        for _ in range(2):
            step.module(w.example_inputs, w.example_target).backward()
        found[name] = max(
            (p.grad.full_tensor() - expected[n]).abs().max().item()  # type: ignore[union-attr]
            for n, p in step.module.named_parameters()
        )
    return found


def optimizers(c: autoplan.Cluster) -> dict[str, float]:
    """SGD with momentum (foreach over DTensors), Adam (fused) and AdamW by foreach (the
    default's alternative) on data- and tensor-parallel and ZeRO-2 plans: the largest parameter
    difference from one process after 3 steps."""
    w = load_workload(ROOT / "examples/mlp.py", **MLP_LARGE_BATCH)
    found = {}
    runs = {
        "sgd": ("sgd_momentum", {"lr": 0.1, "momentum": 0.9}),
        "adam": ("adam", {"lr": LR}),
        "adamw-foreach": ("adamw", {"lr": LR, "foreach": True}),
    }
    for run, (name, options) in runs.items():
        ref = reference(w, optimizer=name, options=options)["params"]
        mesh = (world_size(),)
        layouts = {
            "dp": data_parallel(w, mesh),
            "tp": mlp_megatron(w, mesh),
            "zero2": zero12(2, world_size())(w),  # the shards stepped
        }
        for layout, pins in layouts.items():
            step = parallel(
                w,
                c,
                options=dataclasses.replace(pins, optimizer=name),
                train=autoplan.TrainOptions(optimizer_options=options),
            )
            for _ in range(STEPS):
                step(w.example_inputs, w.example_target)
            params = step.state_dict()
            found[f"{run}-{layout}"] = max(
                (params[n] - v).abs().max().item() for n, v in ref.items()
            )
    return found


def randomness(c: autoplan.Cluster) -> dict[str, Any]:
    """Dropout (p = 0.25) of a linear layer whose weight gets noise from `rand_like`, trained
    3 steps under the planner's plan and data parallel (noise drawn whole, dropout split):
    the first loss over the loss without dropout (the rate shows in it: expected 1 / (1 - p)),
    how far each rank's parameters are from rank 0's after training, and the placements of the
    random ops. Then draws under the executor's generator, split and whole."""
    w = load_workload(ROOT / "tests/models/dropout.py", noise=0.1)
    exact = w.loss(copy.deepcopy(w.model).eval()).item()
    layouts = {"own": autoplan.PlanOptions(), "dp": data_parallel(w, (world_size(),))}
    found: dict[str, Any] = {}
    for name, options in layouts.items():
        torch.manual_seed(dist.get_rank())  # as for a data loader: the executor draws alike
        step = parallel(w, c, options=options)
        losses = [step(w.example_inputs, w.example_target).item() for _ in range(STEPS)]
        mine = torch.cat([v.flatten() for v in step.state_dict().values()])
        first = mine.clone()
        dist.broadcast(first, src=0)
        assert step.plan is not None
        random = {
            n.op: sorted(set(n.output.values()))
            for n in step.plan.nodes.values()
            if n.op in ("aten.rand_like.default", "aten.dropout.default")
        }
        found[name] = {
            "rate": losses[0] / exact,
            "replicas": (mine - first).abs().max().item(),
            "placed": random,
        }
    assert step.mesh is not None
    draws = Draws(step.mesh)
    for name, placement in (("split", Shard(0)), ("whole", Replicate())):
        with draws.drawing([placement]):
            drawn = torch.rand(4)
        gathered = [torch.empty(4) for _ in range(world_size())]
        dist.all_gather(gathered, drawn)
        found[name] = len({tuple(g.tolist()) for g in gathered})
    return found


def recompute_dropout(c: autoplan.Cluster) -> dict[str, dict[str, float]]:
    """GPT-2 with dropout (attention's too), trained with every layer recomputed (whole, or
    its attention core) and without, on one plan otherwise: the recomputed forward must draw
    the masks the first drew, so all train alike. The largest loss and parameter differences
    from the run without, per layout and mode."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="gpt2-dropout", batch_size=16)
    layouts = {"dp": data_parallel(w, (world_size(),)), "own-2x2": autoplan.PlanOptions((2, 2))}
    found = {}
    for name, options in layouts.items():
        runs = {}
        for recompute in ("none", "full", "selective"):
            torch.manual_seed(0)  # the executor's draws start from rank 0's generator
            step = parallel(w, c, options=dataclasses.replace(options, recompute=recompute))
            assert step.plan is not None
            assert {layer.mode for layer in step.plan.recompute} == {recompute} - {"none"}
            losses = [step(w.example_inputs, w.example_target).item() for _ in range(STEPS)]
            recomputed = {n for layer in step.plan.recompute for n in layer.nodes}
            # dropouts that run again in backward
            dropouts = sum("dropout" in step.plan.nodes[n].op for n in recomputed)
            runs[recompute] = (losses, step.state_dict(), dropouts)
        plain, plain_params, _ = runs.pop("none")
        for recompute, (again, again_params, dropouts) in runs.items():
            found[f"{name} {recompute}"] = {
                "loss": max(abs(a - b) for a, b in zip(plain, again, strict=True)),
                "param": max(
                    (plain_params[n] - v).abs().max().item() for n, v in again_params.items()
                ),
                "dropouts": dropouts,
            }
    return found


def world_size() -> int:
    return dist.get_world_size()


def isolated(case: Case, c: autoplan.Cluster) -> dict[str, Any]:
    """`run_case`, or the error it raised on the first rank that raised one: a case that
    fails on every rank (as planning and plan checks do) fails alone and by its name, and
    the cases after it still run. A case that fails on some ranks only, inside a collective,
    can still stop the whole run."""
    try:
        found: dict[str, Any] = run_case(case, c)
        error = None
    except Exception:
        found, error = {}, traceback.format_exc()
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    raised = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if raised:
        return {"rank": raised[0][0], "error": raised[0][1]}
    return found


def main() -> None:
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    faulthandler.enable()  # a crash in C++ (gloo) then shows every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    c = cluster(world)
    results: dict[str, Any] = {}
    only = os.environ.get("AUTOPLAN_TEST_CASES")  # tests/test_distributed.py's selection
    for case in CASES:
        if case.world == world and (only is None or case.name in only.split(",")):
            torch.manual_seed(0)
            start = time.perf_counter()
            results[case.name] = isolated(case, c)
            if dist.get_rank() == 0:  # in the rank's log: where a slow run spends its time
                print(f"case {case.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if only is None:
        _other_checks(c, world, out, results)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _other_checks(c: autoplan.Cluster, world: int, out: Path, results: dict[str, Any]) -> None:
    """The checks beside the cases' parity, each under its own key of ``results``."""
    results["accumulation"] = accumulation(c)
    results["optimizers"] = optimizers(c)
    results["randomness"] = randomness(c)
    if world == 4:
        results["recompute_dropout"] = recompute_dropout(c)
    results["checkpoints"] = checkpoints(c, out.parent)
    errors = error_cases(c)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, errors)
    results["errors"] = per_rank


if __name__ == "__main__":
    main()
    # Every result is written and every rank has left the process group. The groups of
    # autoplan's meshes end at exit (torch_private/mesh_release.py), which was what aborted
    # this process in CI ("terminate called without an active exception"); a group a case
    # leaves in a reference cycle could still end only in the interpreter's teardown, so the
    # worker ends without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

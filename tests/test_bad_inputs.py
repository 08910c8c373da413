"""Bad input, case by case: hand-edited plans, cluster files, workload files, command-line
options and models. Each is refused through the command line with exit code 2 and one line
naming the problem and the fix, never a traceback; `autoplan run` refuses them before it
starts any process (the ranks' own checks are in tests/distributed/worker.py's error cases).
A legal hand edit of a plan is re-priced by `estimate` and trains exactly under `run`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autoplan
from autoplan.cli import profile_command, run_command
from autoplan.cli.main import main
from autoplan.execute.checkpoint import checkpoint_path
from autoplan.execute.manifest import write_manifest
from tests.conftest import ROOT, example

GPT = str(ROOT / "examples/gpt.py")
MLP = str(ROOT / "examples/mlp.py")
CPU4 = str(ROOT / "costmodels/cpu-gloo-4.json")
MLP6 = ["--set", "hidden=6", "--set", "batch_size=8"]  # 6 features: no even split on 4 ranks


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, cpu4: autoplan.Cluster) -> Path:
    """A folder with the tiny GPT's data-parallel plan (gpt.json; the planner keeps so small a
    model replicated, without collectives to edit) and the 6-wide MLP's (mlp6.json)."""
    folder = tmp_path_factory.mktemp("bad")
    example("gpt").baseline(cpu4, dp=4, tp=1).save(str(folder / "gpt.json"))
    example("gpt").baseline(cpu4, dp=2, tp=1, pp=2).save(str(folder / "gpt-pp.json"))
    damaged = checkpoint_path(folder / "damaged", 1)  # a checkpoint whose .metadata was cut
    with warnings.catch_warnings(action="ignore"):  # DCP saving without a process group
        dcp.save({"x": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(damaged))
    (damaged / "progress.json").write_text('{"step": 1, "rng": {}, "extra": null}')
    write_manifest(damaged)
    (damaged / ".metadata").write_bytes((damaged / ".metadata").read_bytes()[:20])
    mlp = example("mlp", hidden=6, batch_size=8)
    mlp.plan(cpu4, autoplan.PlanOptions(mesh_shape=(4,))).save(str(folder / "mlp6.json"))
    return folder


def edited(d: Path, source: str, edit: Callable[[dict[str, Any]], object]) -> str:
    """``source``'s plan in ``d`` after ``edit`` (of its JSON), written beside it."""
    doc = json.loads((d / source).read_text())
    edit(doc)
    path = d / f"edited-{len(list(d.iterdir()))}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def written(d: Path, name: str, text: str) -> str:
    (d / name).write_text(text)
    return str(d / name)


def head(doc: dict[str, Any], field: str, placement: str) -> None:
    doc["params"]["head.weight"][field] = {"dp": placement}


def renamed(doc: dict[str, Any]) -> None:
    doc["params"]["head.wieght"] = doc["params"].pop("head.weight")


def cluster_file(d: Path, edit: Callable[[dict[str, Any]], object]) -> str:
    doc = json.loads(Path(CPU4).read_text())
    edit(doc)
    return written(d, f"cluster-{len(list(d.iterdir()))}.json", json.dumps(doc))


def show(plan: str, *more: str) -> list[str]:
    return ["show", plan, *more]


def estimate(plan: str, workload: str = GPT, *more: str) -> list[str]:
    return ["estimate", workload, "--plan", plan, "--cluster", CPU4, *more]


def run(*more: str, workload: str = GPT) -> list[str]:
    return ["run", workload, "--cluster", CPU4, *more]


def plan(workload: str, *more: str, cluster: str = CPU4) -> list[str]:
    return ["plan", workload, "--cluster", cluster, *more]


NO_PARAMS = """import torch
from torch import nn
import autoplan

class Doubling(nn.Module):
    def forward(self, x):
        return (x * 2).sum()

def workload():
    return autoplan.Workload(Doubling(), (torch.randn(4, 4),))
"""
FLOAT_IDS = """from autoplan import Workload
from examples.gpt import workload as gpt

def workload():
    w = gpt()
    return Workload(w.model, (w.example_inputs[0].float(),), w.loss_fn, w.example_target)
"""
FLEX_MASK = """import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from autoplan import Workload

class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(4, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)

        def causal(b, h, qi, ki):
            return qi >= ki if qi > 0 else qi == ki

        mask = create_block_mask(causal, None, None, 8, 8, device=x.device)
        return flex_attention(q, k, v, block_mask=mask).sum()

def workload():
    return Workload(Masked(), (torch.randn(4, 8, 16),))
"""

NONE_WHILE_TRACED = """import torch
from torch import nn
from autoplan import Workload

def padded(mask, length):
    return nn.functional.pad(mask, (0, length - mask.shape[1]))

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        if mask is None and not torch.compiler.is_compiling():  # as transformers' LongT5
            mask = torch.ones(x.shape[:2])
        local = padded(mask, 8)
        return (self.fc(x) * local[..., None]).sum()

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x):
        return self.encoder(x)

def workload():
    return Workload(Model(), (torch.randn(2, 6, 8),))
"""

INT_INPUTS = """from autoplan import Workload
from examples.mlp import workload as mlp

def workload():
    w = mlp()
    return Workload(w.model, (w.example_inputs[0].long(),), w.loss_fn, w.example_target)
"""
TUPLE_OUT = """import torch
from torch import nn
import autoplan

class LossAndLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y.pow(2).mean(), y

def workload():
    return autoplan.Workload(LossAndLogits(), (torch.randn(4, 4),))
"""
ROUTED = """import torch
from torch import nn
import autoplan

class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2)

    def forward(self, x):
        y = self.router(x)
        picked = torch.zeros(8, 2).scatter(1, y.argmax(1, keepdim=True), 1)
        # tokens per expert, read from the values
        counts = picked.long().sum(0).tolist()
        return y.sum() * counts[0]

def workload():
    return autoplan.Workload(Routed(), (torch.randn(8, 4),))
"""
NOT_A_MODULE = """import torch
import autoplan

def workload():
    return autoplan.Workload(5, (torch.randn(4, 4),))
"""
S7 = r"params\.head\.weight\.placements is S\(7\) on axis dp, but head\.weight has 2 dim\(s\)"
UNKNOWN = r"params names 'head\.wieght', which is not a parameter .*did you mean head\.weight\?"


@dataclass(frozen=True)
class Bad:
    name: str
    argv: Callable[[Path], list[str]]  # the command line, given the folder of files
    expected: str  # a regular expression the error line matches


CASES = [
    # ---- hand-edited plans: show, estimate and run (before any process starts) alike
    Bad("unknown-param-show", lambda d: show(edited(d, "gpt.json", renamed)), UNKNOWN),
    Bad("unknown-param-estimate", lambda d: estimate(edited(d, "gpt.json", renamed)), UNKNOWN),
    Bad("unknown-param-run", lambda d: run("--plan", edited(d, "gpt.json", renamed)), UNKNOWN),
    Bad(
        "missing-param",
        lambda d: estimate(edited(d, "gpt.json", lambda p: p["params"].pop("ln_f.bias"))),
        r"params has no entry for ln_f\.bias",
    ),
    Bad(
        "split-dim-show",
        lambda d: show(edited(d, "gpt.json", lambda p: head(p, "placements", "S(7)"))),
        S7,
    ),
    Bad(
        "split-dim-estimate",
        lambda d: estimate(edited(d, "gpt.json", lambda p: head(p, "placements", "S(7)"))),
        S7,
    ),
    Bad(
        "split-dim-run",
        lambda d: run("--plan", edited(d, "gpt.json", lambda p: head(p, "placements", "S(7)"))),
        S7,
    ),
    Bad(
        "split-dim-storage",
        lambda d: estimate(edited(d, "gpt.json", lambda p: head(p, "storage", "S(7)"))),
        r"params\.head\.weight\.storage is S\(7\)",
    ),
    Bad(
        "uneven-split",
        lambda d: show(
            edited(
                d,
                "mlp6.json",
                lambda p: p["params"]["layers.0.bias"].update(storage={"tp": "S(0)"}),
            )
        ),
        r"storage is \[tp=S\(0\)\], which does not split layers\.0\.bias \(shape \[6\]\) evenly",
    ),
    Bad(
        "partial-storage",
        lambda d: show(edited(d, "gpt.json", lambda p: head(p, "storage", "P"))),
        r"storage is P on axis dp: a parameter is stored split .* not as partial sums",
    ),
    Bad(
        "not-a-placement",
        lambda d: show(edited(d, "gpt.json", lambda p: head(p, "storage", "S0"))),
        r"params\.head\.weight\.storage\.dp must be a placement",
    ),
    Bad(
        "mesh-ranks",
        lambda d: show(edited(d, "gpt.json", lambda p: p["mesh"].update(ranks=[0, 1, 2, 2]))),
        r"mesh\.ranks is \[0, 1, 2, 2\]: .*write \[0, 1, 2, 3\]",
    ),
    Bad(
        "stage-ranks",
        lambda d: show(edited(d, "gpt.json", lambda p: p["stages"][0].update(ranks=[0, 1, 3, 2]))),
        r"stages\[0\]\.ranks is \[0, 1, 3, 2\], but stage 0 runs on row 0 of the mesh",
    ),
    Bad(
        "mesh-vs-cluster-show",
        lambda d: show(str(d / "gpt.json"), "--cluster", CPU4, "--nodes", "2"),
        r"mesh\.shape is \[4\]: 4 devices, but cluster 'cpu-gloo-4' has 8",
    ),
    Bad(
        "plan-does-not-fit-run",  # 0.01% of 4 GiB: under 1 MiB
        lambda d: run("--plan", str(d / "gpt.json"), "--memory-fraction", "0.0001"),
        r"the plan does not fit: it needs \d+\.\d\d MiB per device \(predicted\), but a device "
        r"of cluster 'cpu-gloo-4' offers 419\.43 KiB \(0\.01% of 4\.00 GiB\); plan again",
    ),
    Bad(
        "microbatches-do-not-divide-estimate",
        lambda d: estimate(
            edited(d, "gpt-pp.json", lambda p: p["pipeline"].update(num_microbatches=10**9))
        ),
        r"pipeline\.num_microbatches is 1000000000, but a batch of 8 \(dim 0 of int64\[8, 16\]\) "
        r"does not split into 1000000000 equal microbatches",
    ),
    Bad(
        "microbatches-do-not-divide-run",
        lambda d: run(
            "--plan",
            edited(d, "gpt-pp.json", lambda p: p["pipeline"].update(num_microbatches=3)),
        ),
        r"pipeline\.num_microbatches is 3, but a batch of 8 .*use a number of microbatches that "
        r"divides 8",
    ),
    Bad(
        "mesh-vs-nproc-planning-run",
        lambda d: run("--mesh", "4", "--nproc", "2", workload=MLP),
        r"mesh shape \(4,\) has 4 devices but cluster 'cpu-gloo-4-2' has 2",
    ),
    Bad(
        "mesh-vs-nproc-run",
        lambda d: run("--plan", str(d / "gpt.json"), "--nproc", "2"),
        r"4 devices, but cluster 'cpu-gloo-4-2' has 2; .*--nproc 4",
    ),
    Bad(
        "op-strategy",  # the head's weight read split: its linear would compute nonsense
        lambda d: estimate(edited(d, "gpt.json", lambda p: head(p, "placements", "S(0)"))),
        r"nodes\.linear_12 \(aten\.linear\.default in head\) reads \[dp=S\(0\)\], \[dp=S\(0\)\] "
        r"-> \[dp=S\(0\)\] .*not one of its strategies .*the closest it has: reads \[dp=S\(0\)\], "
        r"\[dp=R\] -> \[dp=S\(0\)\]",
    ),
    Bad(
        "op-inputs",
        lambda d: estimate(
            edited(d, "gpt.json", lambda p: p["nodes"]["linear_12"]["inputs"].pop())
        ),
        r"nodes\.linear_12\.inputs has 1 placement\(s\), but aten\.linear\.default reads 2",
    ),
    Bad(
        "unknown-node",
        lambda d: estimate(
            edited(d, "gpt.json", lambda p: p["nodes"].update(extra=p["nodes"]["linear_12"]))
        ),
        r"nodes names extra, not nodes of this model's traced step",
    ),
    Bad(
        "stage-misses-a-node",
        lambda d: estimate(
            edited(d, "gpt.json", lambda p: p["stages"][0]["nodes"].remove("linear_12"))
        ),
        r"stages lists no stage for linear_12",
    ),
    Bad(
        "another-model",
        lambda d: estimate(str(d / "gpt.json"), MLP),
        r"graph_fingerprint: the plan was made for another model.*plan again",
    ),
    Bad(
        "old-version",
        lambda d: show(edited(d, "gpt.json", lambda p: p.update(version=4))),
        r"version must be 5 \(this autoplan reads only that version\), got 4",
    ),
    Bad(
        "not-json",
        lambda d: show(written(d, "half.json", "{\n")),
        r"half\.json is not valid JSON: .* at line 2",
    ),
    Bad(
        "no-plan-file",
        lambda d: show(str(d / "none.json")),
        r"plan file .*none\.json does not exist",
    ),
    # ---- checkpoints (autoplan run, before any process starts)
    Bad(
        "checkpoint-folder-unwritable",
        lambda d: run(
            "--checkpoint-dir", str(Path(written(d, "a-file", "")) / "ckpt"), workload=MLP
        ),
        r"checkpoint folder .*a-file/ckpt cannot be written \(NotADirectoryError: Not a "
        r"directory\); give another --checkpoint-dir",
    ),
    Bad(
        "resume-from-damaged",
        lambda d: run("--checkpoint-dir", str(d / "damaged"), "--resume", workload=MLP),
        r"every checkpoint in .*damaged is damaged \(step-00000001: \.metadata is 20 bytes, but "
        r"was written with \d+\)",
    ),
    # ---- cluster files
    Bad(
        "dtype-typo",
        lambda d: plan(
            MLP, cluster=cluster_file(d, lambda c: c["device"]["peak_flops"].update(float23=1e12))
        ),
        r"unknown field\(s\) device\.peak_flops\.float23; expected only bfloat16, float16, float32",
    ),
    Bad(
        "no-devices",
        lambda d: plan(MLP, cluster=cluster_file(d, lambda c: c.update(devices_per_node=0))),
        r"devices_per_node must be an integer >= 1, got 0",
    ),
    Bad(
        "cluster-not-json",
        lambda d: plan(MLP, cluster=written(d, "half-cluster.json", '{"name": ')),
        r"half-cluster\.json: invalid JSON at line 1",
    ),
    Bad(
        "nodes-0",
        lambda d: plan(MLP, "--nodes", "0"),
        r"argument --nodes: must be at least 1, got 0",
    ),
    # ---- workload files and models
    Bad(
        "syntax-error",
        lambda d: plan(written(d, "syntax.py", "def workload(:\n    pass\n")),
        r"syntax\.py, line 1: invalid syntax; fix the workload file",
    ),
    Bad(
        "import-error",
        lambda d: plan(written(d, "imports.py", "import no_such_module\n")),
        r"imports\.py could not be imported at .*imports\.py:1: ModuleNotFoundError: "
        r"No module named 'no_such_module'",
    ),
    Bad(
        "workload-not-a-function",
        lambda d: plan(written(d, "five.py", "workload = 5\n")),
        r"five\.py: workload is int, not a function",
    ),
    Bad(
        "option-of-wrong-type",
        lambda d: run("--set", "hidden=abc", workload=MLP),
        r"mlp\.py: workload\(hidden='abc'\) failed at .*mlp\.py:\d+: TypeError: .*check the "
        r"options",
    ),
    Bad(
        "option-refused-by-workload",
        lambda d: plan(GPT, "--set", "size=huge"),
        r"workload\(size='huge'\) failed at .*gpt\.py:\d+: ValueError: unknown GPT size 'huge'",
    ),
    Bad(
        "model-not-a-module",
        lambda d: plan(written(d, "notmodule.py", NOT_A_MODULE)),
        r"model is int, not a torch\.nn\.Module",
    ),
    Bad(
        "no-parameters",
        lambda d: run(workload=written(d, "noparams.py", NO_PARAMS)),
        r"Doubling has no trainable parameters",
    ),
    Bad(
        "int-inputs-to-float-model-run",  # fake tensors let it through; eager would not
        lambda d: run(workload=written(d, "intinputs.py", INT_INPUTS)),
        r"could not trace MLP .*: layers\.0 \(aten\.linear\.default\) computes on tensors of "
        r"one dtype, got int64\[64, 32\], float32\[32, 32\], float32\[32\]\. It was called "
        r"on the example inputs \(then the target\): int64\[64, 32\], float32\[64, 32\]",
    ),
    Bad(
        "tuple-without-loss-run",
        lambda d: run(workload=written(d, "tuple.py", TUPLE_OUT)),
        r"LossAndLogits returns a tuple of 2 float32\[\], float32\[4, 4\], not a loss \(one float "
        r"tensor of one element\).* pass a loss_fn",
    ),
    Bad(
        "untraceable-run",
        lambda d: run(workload=written(d, "floatids2.py", FLOAT_IDS)),
        r"could not trace GPT at .*gpt\.py:\d+ .*Long, Int",
    ),
    Bad(
        "flex-attention-mask",  # FlexAttention is planned; a mask_mod vmap cannot trace is not
        lambda d: plan(written(d, "flexmask.py", FLEX_MASK)),
        r"could not trace Masked at .*flexmask\.py:\d+ \(`return qi >= ki if qi > 0 else qi == "
        r"ki`\) in the model \(aten\.item\.default\).*calling score_mod and mask_mod on index "
        r"tensors under vmap.*attn_implementation=\"sdpa\"",
    ),
    Bad(
        "none-while-traced",  # Python fails, no op running: the module's line, and the input
        lambda d: plan(written(d, "nonemask.py", NONE_WHILE_TRACED)),
        r"could not trace Model at .*nonemask\.py:\d+ \(`return nn\.functional\.pad\(mask, .*\) "
        r"in encoder \(no op running, at line \d+ of its forward \(`local = padded\(mask, 8\)`"
        r"\)\): AttributeError: 'NoneType' .*is None as torch\.export traces it.*Pass that input "
        r"with the example inputs",
    ),
    Bad(
        "data-dependent-size",  # export traces .tolist(); the graph held an unknown integer
        lambda d: plan(written(d, "routed.py", ROUTED)),
        r"could not trace Routed at .*routed\.py:\d+ \(`counts = picked.long\(\)\.sum\(0\)\."
        r"tolist\(\)`\): aten\.item\.default gives u0, an integer that depends on what the "
        r"tensors hold.*avoid \.item\(\), \.tolist\(\)",
    ),
    Bad(
        "float-token-ids",  # a dtype the model cannot take: no advice about control flow
        lambda d: plan(written(d, "floatids.py", FLOAT_IDS)),
        r"could not trace GPT at .*gpt\.py:\d+ .*Long, Int.*example inputs \(then the target\): "
        r"float32\[8, 16\], int64\[8, 16\]; check that the model runs on inputs of these dtypes",
    ),
    # ---- command-line options
    Bad("nproc-0", lambda d: run("--nproc", "0"), r"argument --nproc: must be at least 1, got 0"),
    Bad(
        "steps-negative",
        lambda d: run("--steps", "-1"),
        r"argument --steps: must be at least 1, got -1",
    ),
    Bad("lr-0", lambda d: run("--lr", "0"), r"argument --lr: must be > 0, got 0"),
    Bad("nnodes-range", lambda d: run("--nnodes", "4:2"), r"argument --nnodes: .*1 <= MIN <= MAX"),
    Bad(
        "nnodes-without-endpoint",
        lambda d: run("--nnodes", "2:4", "--checkpoint-dir", str(d / "c"), workload=MLP),
        r"--nnodes 2:4 needs --rdzv-endpoint HOST:PORT",
    ),
    Bad(
        "restarts-without-checkpoints",
        lambda d: run("--max-restarts", "2", workload=MLP),
        r"a restart resumes from the newest checkpoint .*give --checkpoint-dir DIR",
    ),
    Bad(
        "mesh-of-an-elastic-job",
        lambda d: run(
            *("--nnodes", "1:2", "--rdzv-endpoint", "localhost:29400", "--mesh", "2"),
            *("--checkpoint-dir", str(d / "c")),
            workload=MLP,
        ),
        r"--mesh fixes the number of processes, but --nnodes 1:2 lets it change: leave --mesh out",
    ),
    Bad("stages-0", lambda d: plan(MLP, "--stages", "0"), r"argument --stages: must be at least 1"),
    Bad(
        "time-limit",
        lambda d: plan(MLP, "--time-limit", "x"),
        r"argument --time-limit: 'x' is not a number",
    ),
    Bad(
        "mesh-of-3", lambda d: plan(MLP, "--mesh", "3"), r"mesh shape \(3,\) has 3 devices .* has 4"
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_in_one_line(
    case: Bad, d: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_torchrun(*_: Any) -> int:
        raise AssertionError("autoplan run started processes for bad input")

    monkeypatch.setattr(run_command, "torchrun", no_torchrun)
    monkeypatch.setattr(profile_command, "torchrun", no_torchrun)
    argv = case.argv(d)
    try:
        code = main(["-q", *argv])
    except SystemExit as e:  # argparse's refusals
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and re.search(case.expected, lines[0]), err
    if case.name == "float-token-ids":
        assert "control flow" not in err


def test_the_catalog_is_large() -> None:
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


def _estimated(d: Path, source: str, capsys: pytest.CaptureFixture[str]) -> autoplan.Plan:
    out = d / f"priced-{Path(source).name}"
    assert main(["-q", *estimate(source), "-o", str(out)]) == 0
    capsys.readouterr()
    return autoplan.Plan.from_json(str(out))


def test_a_storage_edit_is_priced_from_the_placements(
    d: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny GPT's head stored split (ZeRO-3 for one weight), edited in params alone: its
    weight is gathered before use and its gradient reduce-scattered, out of the bucket."""
    before = _estimated(d, str(d / "gpt.json"), capsys)
    after = _estimated(d, edited(d, "gpt.json", lambda p: head(p, "storage", "S(0)")), capsys)
    assert after.nodes["p_model_head_weight"].output == {"dp": "S(0)"}  # params into nodes
    new = [(c.kind, c.phase, c.bytes, c.tensor) for c in after.collectives if not c.params]
    old = [(c.kind, c.phase, c.bytes, c.tensor) for c in before.collectives if not c.params]
    weight = 128 * 64 * 4
    assert sorted(set(new) - set(old)) == [
        ("all_gather", "forward", weight, "p_model_head_weight"),
        ("reduce_scatter", "grad_sync", weight, "p_model_head_weight"),
    ]
    (bucket_before,) = [c for c in before.collectives if c.params]
    (bucket_after,) = [c for c in after.collectives if c.params]
    assert "p_model_head_weight" in bucket_before.params
    assert set(bucket_before.params) - set(bucket_after.params) == {"p_model_head_weight"}
    assert bucket_before.bytes - bucket_after.bytes == weight
    assert after.predicted.comm_s > before.predicted.comm_s
    # three quarters of the weight, its gradient and its two Adam moments no longer kept, nor
    # its slice of the bucket's buffer
    saved = before.predicted.peak_memory_bytes - after.predicted.peak_memory_bytes
    assert saved == pytest.approx(weight * (4 * 3 / 4 + 1), rel=0.05)


def test_the_files_collectives_are_not_used(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = _estimated(d, str(d / "gpt.json"), capsys)
    wrong = _estimated(d, edited(d, "gpt.json", lambda p: p.update(collectives=[])), capsys)
    assert wrong.collectives == original.collectives and len(original.collectives) > 0
    assert wrong.predicted == original.predicted


@pytest.mark.slow
def test_a_legal_edit_trains_exactly(d: Path) -> None:
    """`autoplan run --plan edited.json --check`: the edit as a person makes it, in params
    alone, the file's collectives and nodes left as they were (one torchrun of 4 ranks)."""
    path = edited(d, "gpt.json", lambda p: head(p, "storage", "S(0)"))
    argv = [sys.executable, "-m", "autoplan.cli", *run("--plan", path, "--steps", "3", "--check")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "head.weight                                128x64  [dp=R]   stored [dp=S(0)]" in (
        proc.stdout
    )
    assert "reduce_scatter" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")
    # rank 0 says what it took from params and that it derived the collectives
    assert "params.head.weight.storage [dp=S(0)] is used for nodes.p_model_head_weight" in (
        proc.stderr
    )
    assert "collectives were derived from its placements" in proc.stderr

"""Checkpoint directories, the run options, and `autoplan run` saving, resuming under another
plan and exporting. (Resuming under every kind of plan is tests/test_distributed.py's.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autoplan
from autoplan.cli.main import main
from autoplan.errors import AutoplanError, CheckpointError
from autoplan.execute import checkpoint
from autoplan.execute.checkpoint import check_writable, checkpoint_path, latest
from autoplan.execute.manifest import MANIFEST, damage, write_manifest
from autoplan.training import Checkpointing
from tests.conftest import ROOT, example

# DCP saving the small checkpoints below without a process group says so
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _complete(path: Path) -> Path:
    """A small checkpoint as a save leaves it: DCP's files, progress.json and the manifest."""
    dcp.save({"x": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(path))
    (path / "progress.json").write_text(json.dumps({"step": 1, "rng": {}, "extra": None}))
    write_manifest(path)
    return path


def _ran(command: list[str], cwd: Path) -> str:
    """``command`` (an ``autoplan run``) run to its end in ``cwd``: its output, once it has
    succeeded."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_latest_is_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert latest(tmp_path / "absent") is None
    assert latest(tmp_path) is None
    _complete(checkpoint_path(tmp_path, 3))
    newest = _complete(checkpoint_path(tmp_path, 12))
    # a save cut short after DCP's metadata but before the rename, one cut short before its
    # metadata, and a step directory without metadata are never read
    _complete(tmp_path / ".step-00000020.tmp")
    (tmp_path / ".step-00000021.tmp").mkdir()
    checkpoint_path(tmp_path, 30).mkdir()
    (tmp_path / "step-99").mkdir()  # not ours
    assert latest(tmp_path) == newest
    assert latest(newest) == newest  # a checkpoint itself


def test_run_options_are_checked_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(AutoplanError, match="--checkpoint-dir"):
        Checkpointing(resume=True)
    with pytest.raises(AutoplanError, match="keep=0"):
        Checkpointing(directory="ckpt", keep=0)
    run = [
        "run",
        str(ROOT / "examples/mlp.py"),
        "--cluster",
        str(ROOT / "costmodels/cpu-gloo-4.json"),
    ]
    for bad, said in (
        (["--checkpoint-every", "2"], "--checkpoint-dir"),
        (["--checkpoint-dir", "d", "--checkpoint-every", "0"], "every=0"),
        (["--timeout", "0"], "positive"),
    ):
        assert main([*run, *bad]) == 2  # refused here: no torchrun started
        assert said in capsys.readouterr().err


@pytest.mark.slow
def test_run_saves_then_resumes_under_another_plan(tmp_path: Path) -> None:
    """2 steps tensor parallel with a save every step (keeping 1), then steps 3-4 resumed in
    2 pipeline stages: as 4 steps in one process (--check), and the export loads into a fresh
    model."""
    run = [
        sys.executable,
        "-m",
        "autoplan.cli",
        "run",
        str(ROOT / "examples/mlp.py"),
        "--cluster",
        str(ROOT / "costmodels/cpu-gloo-4.json"),
        "--nproc",
        "2",
        "--set",
        "batch_size=4",
        "--set",
        "hidden=64",
        "--checkpoint-dir",
        "ckpt",
    ]
    save = ["--checkpoint-every", "1", "--checkpoint-keep", "1"]
    _ran([*run, "--steps", "2", "--mesh", "2", *save], tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002"]
    resume = ["--steps", "4", "--resume", "--pipeline", "--stages", "2", "--check"]
    out = _ran([*run, *resume, "--export-to", "model.pt"], tmp_path)
    assert "stage 1" in out and "training steps 3-4 on 2 processes" in out
    assert "step 2/4  loss" not in out and "step 4/4  loss" in out
    assert "check against one process" in out and out.rstrip().endswith("OK")
    model = example("mlp", batch_size=4, hidden=64).model
    model.load_state_dict(torch.load(tmp_path / "model.pt"))  # strict
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]


def test_buffers_forward_updates_are_saved_and_resumed(tmp_path: Path) -> None:
    """A router's token counts and a call counter (tests/models/counters.py), written in
    forward: 2 steps data parallel saved, steps 3-4 resumed under the planner's plan,
    checked against 4 steps in one process (a counter not restored would stand at 2); the
    export holds the counts."""
    run = [
        sys.executable,
        "-m",
        "autoplan.cli",
        "run",
        str(ROOT / "tests/models/counters.py"),
        "--cluster",
        str(ROOT / "costmodels/cpu-gloo-4.json"),
        "--nproc",
        "2",
        "--set",
        "batch_size=16",
        "--checkpoint-dir",
        "ckpt",
    ]
    # data parallel: each rank counts its half of the batch
    _ran([*run, "--steps", "2", "--mesh", "2", "--pin", "input:0=S(0)"], tmp_path)
    resume = ["--steps", "4", "--resume", "--no-pipeline", "--check", "--export-to", "m.pt"]
    out = _ran([*run, *resume], tmp_path)
    assert "training steps 3-4 on 2 processes" in out and out.rstrip().endswith("OK")
    state = torch.load(tmp_path / "m.pt")
    assert state["calls"].item() == 4 and state["tokens_per_expert"].sum().item() == 4 * 16


def test_a_strided_checkpoint_loads_under_another_plan_and_back(tmp_path: Path) -> None:
    """A fused qkv stored strided ("S(0)x3": each rank's heads of q, k and v) is saved as the
    logical tensor: 2 steps so, steps 3-4 resumed with it replicated, steps 5-6 resumed
    strided again, each as many steps in one process (--check)."""
    run = [
        sys.executable, "-m", "autoplan.cli", "run", str(ROOT / "examples/gpt.py"),
        "--cluster", str(ROOT / "costmodels/cpu-gloo-4.json"), "--nproc", "2", "--mesh", "2",
        "--set", "size=tiny", "--set", "num_layers=1", "--set", "batch_size=4",
        "--set", "qkv=fused", "--checkpoint-dir", "ckpt", "--checkpoint-every", "2",
    ]  # fmt: skip
    qkv = "blocks.0.attn.qkv.weight"
    for steps, placement in ((2, "S(0)x3"), (4, "R"), (6, "S(0)x3")):
        resume = ["--resume", "--check"] if steps > 2 else []
        out = _ran([*run, "--steps", str(steps), "--pin", f"{qkv}={placement}", *resume], tmp_path)
        assert re.search(rf"{re.escape(qkv)} .*\[tp={re.escape(placement)}\]", out), out
        if resume:
            assert f"training steps {steps - 1}-{steps} on 2 processes" in out
            assert out.rstrip().endswith("OK")


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


@pytest.mark.parametrize(
    ("harm", "said"),
    [
        (lambda p: _truncate(p / ".metadata"), r"\.metadata is \d+ bytes, but was written with"),
        (lambda p: _flip_a_byte(_shard(p)), r"__0_0\.distcp does not have the checksum"),
        (lambda p: _truncate(p / "progress.json"), r"progress\.json is \d+ bytes"),
        (lambda p: _shard(p).unlink(), r"__0_0\.distcp is missing"),
        (lambda p: (p / MANIFEST).write_text("{"), r"manifest\.json cannot be read"),
    ],
    ids=["metadata-truncated", "shard-flipped", "progress-truncated", "shard-gone", "manifest"],
)
def test_a_damaged_newest_checkpoint_is_reported_and_skipped(
    tmp_path: Path, harm: object, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    intact = _complete(checkpoint_path(tmp_path, 2))
    newest = _complete(checkpoint_path(tmp_path, 4))
    assert damage(newest) is None and latest(tmp_path) == newest
    harm(newest)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, "autoplan.execute.checkpoint"):
        assert latest(tmp_path) == intact
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"checkpoint {newest} is damaged (") and "skipped" in warning
    assert re.search(said, warning), warning
    assert newest.is_dir()  # reported, not deleted
    with pytest.raises(CheckpointError, match=f"checkpoint {newest} is damaged: .*earlier"):
        latest(newest)  # a damaged checkpoint named itself is refused
    harm(intact)  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged \(step-0000"):
        latest(tmp_path)


def test_a_checkpoint_without_manifest_is_still_checked(tmp_path: Path) -> None:
    """Saved before manifests: a truncated .metadata or progress.json is found all the same."""
    older = _complete(checkpoint_path(tmp_path, 1))
    old = _complete(checkpoint_path(tmp_path, 2))
    for path in (older, old):
        (path / MANIFEST).unlink()
    assert latest(tmp_path) == old
    _truncate(old / ".metadata")
    assert "UnpicklingError" in str(damage(old)) or "Error" in str(damage(old))
    assert latest(tmp_path) == older
    (older / "progress.json").write_text('{"step": ')
    assert re.search(r"progress\.json cannot be read \(JSONDecodeError", str(damage(older)))


def test_an_unwritable_checkpoint_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*a-file/ckpt cannot be "):
        check_writable(tmp_path / "a-file" / "ckpt")
    check_writable(tmp_path / "new" / "ckpt")  # made
    assert (tmp_path / "new" / "ckpt").is_dir() and not list((tmp_path / "new/ckpt").iterdir())


def _one_rank_step(cpu4: autoplan.Cluster) -> tuple[autoplan.Step, object]:
    one = dataclasses.replace(cpu4, devices_per_node=1, name="cpu-gloo-1")
    w = example("mlp", batch_size=4, hidden=16)
    return w.parallelize(one), w


@pytest.mark.usefixtures("one_rank")
def test_resume_falls_back_to_the_newest_intact_checkpoint(
    tmp_path: Path, cpu4: autoplan.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Saves verified and listed in a manifest; a damaged newest one is skipped on load; a
    save that fails its check removes nothing (keep=1)."""
    step, w = _one_rank_step(cpu4)
    for _ in range(2):
        step(w.example_inputs, w.example_target)  # type: ignore[attr-defined]
        step.save(tmp_path, keep=2)
    first, second = checkpoint_path(tmp_path, 1), checkpoint_path(tmp_path, 2)
    assert (second / MANIFEST).is_file() and damage(second) is None
    _flip_a_byte(_shard(second))
    again, _ = _one_rank_step(cpu4)
    with caplog.at_level(logging.WARNING, "autoplan.execute.checkpoint"):
        restored = again.load(tmp_path)
    assert restored is not None and restored.path == first and again.steps_done == 1
    assert any("step-00000002 is damaged" in r.getMessage() for r in caplog.records)
    # a save whose check fails: the earlier checkpoints stay, keep=1 notwithstanding
    step(w.example_inputs, w.example_target)  # type: ignore[attr-defined]
    with (
        mock.patch.object(checkpoint, "damage", return_value="x is 0 bytes"),
        pytest.raises(CheckpointError, match=r"step-00000003 failed its check after writing"),
    ):
        step.save(tmp_path, keep=1)
    assert {p.name for p in tmp_path.iterdir()} >= {first.name, second.name}
    assert not checkpoint_path(tmp_path, 3).exists()
    step.save(tmp_path, keep=1)  # verified: only now are the others removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


@pytest.mark.usefixtures("one_rank")
def test_a_damaged_progress_file_gets_our_message(tmp_path: Path, cpu4: autoplan.Cluster) -> None:
    step, w = _one_rank_step(cpu4)
    step(w.example_inputs, w.example_target)  # type: ignore[attr-defined]
    path = step.save(tmp_path)
    (path / MANIFEST).unlink()  # as saved before manifests: nothing to compare it with
    (path / "progress.json").write_text('{"step": 1, "rn')
    again, _ = _one_rank_step(cpu4)
    with pytest.raises(CheckpointError, match=r"every checkpoint .* progress\.json cannot be"):
        again.load(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-00000001 is damaged: .*prog"):
        again.load(path)

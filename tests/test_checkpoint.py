"""Checkpoint directories, the run options, and `autoplan run` saving, resuming under another
plan and exporting. (Resuming under every kind of plan is tests/test_distributed.py's.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoplan.cli.main import main
from autoplan.errors import AutoplanError
from autoplan.execute.checkpoint import checkpoint_path, latest
from autoplan.training import Checkpointing
from tests.conftest import ROOT, example


def _complete(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    return path


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
    first = subprocess.run(
        [*run, "--steps", "2", "--mesh", "2", "--checkpoint-every", "1", "--checkpoint-keep", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002"]
    resume = ["--steps", "4", "--resume", "--pipeline", "--stages", "2", "--check"]
    second = subprocess.run(
        [*run, *resume, "--export-to", "model.pt"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    out = second.stdout
    assert second.returncode == 0, out[-2000:] + second.stderr[-2000:]
    assert "stage 1" in out and "training steps 3-4 on 2 processes" in out
    assert "step 2/4  loss" not in out and "step 4/4  loss" in out
    assert "check against one process" in out and out.rstrip().endswith("OK")
    model = example("mlp", batch_size=4, hidden=64).model
    model.load_state_dict(torch.load(tmp_path / "model.pt"))  # strict
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]

"""The executor on CUDA with NCCL: run only where torch sees a GPU (the lent GPU machine, see
README "What has run on GPUs"); on a CPU-only machine these are skipped, each with the reason.

Each trains an example under `autoplan run ... --check` on the GPU(s) and requires one
process's losses and parameters (the check's 1e-5), as the gloo tests do on CPU ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

needs_gpu = pytest.mark.skipif(GPUS < 1, reason="no CUDA device: the CUDA/NCCL cases need one")
needs_two = pytest.mark.skipif(GPUS < 2, reason="fewer than 2 CUDA devices")


def _run(example: str, nproc: int, *options: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "autoplan.cli",
        "run",
        str(ROOT / "examples" / f"{example}.py"),
        "--cluster",
        str(ROOT / "costmodels/h100-sxm-8.json"),  # NCCL: its backend
        "--nproc",
        str(nproc),
        "--steps",
        "3",
        "--check",
        *options,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout[-2000:]
    return proc.stdout


@needs_gpu
def test_mlp_trains_on_one_gpu_like_one_process() -> None:
    _run("mlp", 1, "--set", "batch_size=64", "--set", "hidden=1024")


@needs_gpu
def test_gpt_in_bfloat16_trains_on_one_gpu_like_one_process() -> None:
    _run("gpt", 1, "--set", "size=small", "--set", "num_layers=2", "--set", "dtype=bfloat16")


@needs_two
def test_gpt_trains_on_two_gpus_over_nccl_like_one_process() -> None:
    out = _run("gpt", 2, "--set", "size=small", "--set", "num_layers=2")
    assert "mesh:" in out

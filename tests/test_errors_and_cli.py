"""Bad input gets a clear error; the CLI plans, shows and reports errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.cli import main
from autoplan.errors import AutoplanError, ClusterFormatError, InfeasiblePlanError, MeshShapeError
from tests.conftest import ROOT, example


def test_mesh_shape_that_does_not_cover_the_cluster(cpu4: autoplan.Cluster) -> None:
    w = example("mlp")
    with pytest.raises(MeshShapeError, match=r"\(3,\).*4") as info:
        w.plan(cpu4, options=PlanOptions(mesh_shape=(3,)))
    assert "(2, 2)" in str(info.value)  # suggests valid shapes


def test_cluster_file_missing_a_field(tmp_path: Path) -> None:
    doc = json.loads((ROOT / "costmodels" / "cpu-gloo-4.json").read_text())
    del doc["intra_node"]["bandwidth"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ClusterFormatError, match=r"intra_node\.bandwidth"):
        autoplan.Cluster.load(path)


def test_model_too_big_even_fully_sharded(cpu4: autoplan.Cluster) -> None:
    w = example("gpt", size="1.3b", batch_size=1, seq_len=128, device="meta")
    with pytest.raises(InfeasiblePlanError) as info:
        w.plan(cpu4)
    message = str(info.value)
    assert "GiB" in message and "3.60 GiB" in message  # what a device offers (90% of 4 GiB)
    need = float(message.split("needs ")[1].split(" GiB")[0])
    assert need > 3.6  # and what it would need
    assert "more devices" in message


def test_bad_pins(cpu4: autoplan.Cluster) -> None:
    w = example("mlp", batch_size=8, hidden=16)
    with pytest.raises(AutoplanError, match=r"layers\.0\.weight"):
        w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin={"layers.0.wieght": "R"}))
    with pytest.raises(AutoplanError, match="not a placement"):
        w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin={"layers.0.weight": "Q"}))
    with pytest.raises(AutoplanError, match="mesh has 1 axis"):
        w.plan(cpu4, PlanOptions(mesh_shape=(4,), pin={"layers.0.weight": ("R", "R")}))


def test_cli_plan_then_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = main(
        [
            "-q",
            "plan",
            str(ROOT / "examples/mlp.py"),
            "--cluster",
            str(ROOT / "costmodels/cpu-gloo-4.json"),
            "--set",
            "batch_size=4",
            "--set",
            "hidden=2048",
            "--mesh",
            "4",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "mesh: tp=4" in printed and "S(0)" in printed and "predicted step time" in printed
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "layers.0.weight" in shown and "all_reduce" in shown


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["-q", "plan", str(ROOT / "examples/mlp.py"), "--cluster", str(tmp_path / "none.json")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error:") and "Traceback" not in err
    code = main(
        [
            "-q",
            "plan",
            str(ROOT / "examples/mlp.py"),
            "--cluster",
            str(ROOT / "costmodels/cpu-gloo-4.json"),
            "--set",
            "colour=1",
        ]
    )
    assert code == 2 and "does not take colour" in capsys.readouterr().err


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme


def test_plan_output_has_no_solver_banner(tmp_path: Path) -> None:
    # a fresh process: HiGHS prints its banner when a process makes its first solver
    out = tmp_path / "plan.json"
    args = [
        "plan",
        str(ROOT / "examples/mlp.py"),
        "--cluster",
        str(ROOT / "costmodels/cpu-gloo-4.json"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "autoplan.cli", *args, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "predicted step time" in proc.stdout and out.exists()
    assert "HiGHS" not in proc.stdout + proc.stderr

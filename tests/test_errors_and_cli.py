"""Bad input gets a clear error; the CLI plans, shows and reports errors without tracebacks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan import PlanOptions
from autoplan.cli.main import main
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


def _plan_in_a_process(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``autoplan [args] -o PLAN`` in a fresh process (HiGHS prints its banner when a process
    makes its first solver); stderr is a pipe, as in a log."""
    proc = subprocess.run(
        [sys.executable, "-m", "autoplan.cli", *args, "-o", str(tmp_path / "plan.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "predicted step time" in proc.stdout and (tmp_path / "plan.json").exists()
    return proc


MLP = ("plan", str(ROOT / "examples/mlp.py"), "--cluster", str(ROOT / "costmodels/cpu-gloo-4.json"))
PROGRESS = re.compile(
    r"\[[#-]+\] +(\d+)% ILP (\d+)/(\d+): (.*) elapsed \d+:\d\d, about \d+:\d\d left"
)


@pytest.mark.slow
def test_short_planning_is_quiet_and_has_no_solver_banner(tmp_path: Path) -> None:
    proc = _plan_in_a_process(tmp_path, *MLP)
    assert proc.stderr == ""  # well under the few seconds after which progress shows
    assert "HiGHS" not in proc.stdout


@pytest.mark.slow
def test_long_planning_shows_progress_on_stderr(tmp_path: Path) -> None:
    # every plan is long past a threshold of 0 s: one line per pipeline tried (in a log), from
    # 4 microbatches (twice the stages) halved while faster
    gpt = [
        "plan",
        str(ROOT / "examples/gpt.py"),
        "--cluster",
        str(ROOT / "costmodels/cpu-gloo-4.json"),
    ]
    gpt += ["--set", "size=tiny", "--set", "batch_size=8", "--pipeline", "--stages", "2"]
    proc = _plan_in_a_process(tmp_path, *gpt, "--progress-after", "0")
    found = [PROGRESS.fullmatch(line) for line in proc.stderr.splitlines()]
    assert found and all(found), proc.stderr  # nothing else on stderr
    lines = [m for m in found if m is not None]
    assert all(m[4].startswith("2 stages of mesh (2,), boundary ") for m in lines)
    assert {"4 microbatches", "2 microbatches"} <= {
        m[4].split(", ")[2].split(":")[0] for m in lines
    }
    solved = [int(m[2]) for m in lines]
    assert solved == sorted(solved) and solved[0] > 0
    assert lines[-1][1] == "100" and lines[-1][2] == lines[-1][3]  # all the ILPs it expected
    assert "HiGHS" not in proc.stdout + proc.stderr
    assert proc.stdout.startswith("plan v")


@pytest.mark.slow
def test_the_solvers_log_is_debug_output_on_stderr(tmp_path: Path) -> None:
    proc = _plan_in_a_process(tmp_path, "-vv", *MLP)
    assert "HiGHS: " in proc.stderr  # the solver's own log, at debug level
    assert "HiGHS" not in proc.stdout and proc.stdout.startswith("plan v")


def test_verbose_planning_says_where_the_seconds_go(tmp_path: Path) -> None:
    """-v ends planning with its time split into phases, which add up to it."""
    err = _plan_in_a_process(tmp_path, "-v", *MLP).stderr
    line = next(x for x in err.splitlines() if "planned in" in x)
    total = float(re.search(r"planned in ([\d.]+) s", line).group(1))  # type: ignore[union-attr]
    phases = dict(re.findall(r" ?([A-Za-z][A-Za-z ]*?) ([\d.]+) s", line.split(": ", 1)[1]))
    assert set(phases) == {"trace", "strategies", "ILP build", "solve", "pricing", "other"}
    assert float(phases["trace"]) > 0 and float(phases["solve"]) > 0
    assert sum(float(v) for v in phases.values()) == pytest.approx(total, abs=0.35)

"""Profiling (`autoplan profile`), the measured section of cluster files, and measured curves in
the cost model."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import autoplan
from autoplan.cli.main import main
from autoplan.cluster.hardware import REQUIRED_DTYPES, Device, Link
from autoplan.cluster.measured import OP_OVERHEAD_KINDS, Curve, machine_fingerprint, monotone
from autoplan.cluster.model import Cluster
from autoplan.costmodel.pipeline_price import send_time
from autoplan.costmodel.pricer import Phased, Pricer
from autoplan.costmodel.timing import (
    COLLECTIVE_KINDS,
    activation_time,
    analytic_collective_time,
    collective_time,
    compute_time,
    host_overhead,
    redistribute_overhead,
    with_overhead,
)
from autoplan.errors import ClusterFormatError
from autoplan.graph.capture import capture
from autoplan.graph.ir import Node, TensorInfo
from autoplan.modes import NodeKind
from autoplan.profile import operations, run
from autoplan.profile.fit import fitted_cluster
from autoplan.profile.tasks import Settings, plan_tasks
from autoplan.progress import Progress
from autoplan.strategies.placement import Collective, P, R
from autoplan.strategies.space import Strategy
from autoplan.workload import load_workload
from tests.conftest import ROOT

MAX_BYTES = 8192
MAX_DIM = 48


def _toy(measured: dict[str, Any]) -> Cluster:
    """Round constants (as in test_cluster) so analytic and measured times are told apart."""
    return Cluster(
        name="toy",
        device=Device(
            "toy", 2**30, {"float32": 100.0, "bfloat16": 400.0, "float16": 400.0}, 10.0, 0.5, 0.5
        ),
        num_nodes=2,
        devices_per_node=4,
        intra_node=Link(bandwidth=100.0, latency=1.0),
        inter_node=Link(bandwidth=10.0, latency=2.0),
        backend="gloo",
        source="test",
        measured=measured,
    )


def _fingerprint(**changes: Any) -> dict[str, Any]:
    return {**machine_fingerprint("gloo").to_dict(), **changes}


# ------------------------------------------------------------------ 2 CPU ranks, end to end


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One `autoplan profile --nproc 2` run with a small, quick size range."""
    out = tmp_path_factory.mktemp("profile") / "two-ranks.json"
    cmd = [
        sys.executable,
        "-m",
        "autoplan.cli",
        "profile",
        "--nproc",
        "2",
        "-o",
        str(out),
        "--max-bytes",
        str(MAX_BYTES),
        "--max-matmul-dim",
        str(MAX_DIM),
        "--repeats",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stderr


@pytest.mark.slow
def test_profile_two_cpu_ranks_writes_a_loadable_file(
    profiled: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    path, stderr = profiled
    with caplog.at_level(logging.WARNING):
        cluster = Cluster.load(path)
    assert not caplog.records  # measured here, so the fingerprint matches this machine
    assert (cluster.name, cluster.backend) == ("two-ranks", "gloo")
    assert (cluster.num_nodes, cluster.devices_per_node) == (1, 2)
    assert cluster.measured["fingerprint"] == machine_fingerprint("gloo").to_dict()
    curves = cluster.curves
    dims = [16, 24, 32, 48]  # n grows by sqrt(2), in multiples of 8, up to --max-matmul-dim
    for dtype in REQUIRED_DTYPES:
        assert curves.matmul[dtype].xs == tuple(2.0 * n**3 for n in dims)
        assert curves.elementwise[dtype].xs[-1] <= 3 * MAX_BYTES
        assert curves.activation[dtype].xs[-1] <= MAX_BYTES
    # 64 ops forward and backward cost more than 8: one more op costs something
    assert curves.op_overhead is not None and curves.op_overhead > 0
    assert set(curves.op_overheads) == set(OP_OVERHEAD_KINDS)
    assert all(s > 0 for s in curves.op_overheads.values())
    # DTensor's redistribution beyond the raw all-reduce, from 4 B by 16x up to --max-bytes
    assert curves.redistribute_overhead is not None
    xs = curves.redistribute_overhead.xs
    assert xs[0] == 4.0 and all(b == 16 * a for a, b in itertools.pairwise(xs))
    assert xs[-1] <= MAX_BYTES < 16 * xs[-1]
    assert curves.sync_overhead is not None and curves.sync_overhead >= 0
    for kind in COLLECTIVE_KINDS:
        curve = curves.collectives[(kind, "intra", 2)]
        assert curve.xs[0] <= 8 and curve.xs[-1] == MAX_BYTES
        assert all(s > 0 for s in curve.seconds)
    assert set(curves.collectives) == {(kind, "intra", 2) for kind in COLLECTIVE_KINDS}
    # a progress bar with the time left, one line per curve when stderr is not a terminal
    lines = [line for line in stderr.splitlines() if re.match(r"\[[#-]+\] ", line)]
    local_curves = len(REQUIRED_DTYPES) * 3  # matmul, elementwise, activation: in 3 passes
    overheads = 1 + len(OP_OVERHEAD_KINDS) + 2  # op_overhead(s), redistribute_, sync_overhead
    assert len(lines) == 3 * local_curves + overheads + len(COLLECTIVE_KINDS)
    assert all("left" in line and "elapsed" in line for line in lines)
    assert "100%" in lines[-1]


def test_profiled_constants_meet_the_curves(profiled: tuple[Path, str]) -> None:
    cluster = Cluster.load(profiled[0])
    fp32 = cluster.curves.matmul["float32"]
    assert fp32.xs[-1] / cluster.peak_flops("float32") == pytest.approx(fp32.seconds[-1])
    ew = cluster.curves.elementwise["float32"]
    assert ew.xs[-1] / cluster.device.memory_bandwidth == pytest.approx(ew.seconds[-1])
    # the link's alpha-beta formula goes through both ends of the all_reduce curve, unless
    # noise puts the small end below the line through the large one (latency clamped to 0)
    ar = cluster.curves.collectives[("all_reduce", "intra", 2)]
    link = cluster.intra_node
    last = analytic_collective_time("all_reduce", ar.xs[-1], 2, link)
    assert last == pytest.approx(ar.seconds[-1])
    first = analytic_collective_time("all_reduce", ar.xs[0], 2, link)
    if link.latency > 0:
        assert first == pytest.approx(ar.seconds[0])
    else:
        assert first >= ar.seconds[0]
    assert cluster.inter_node == cluster.intra_node  # one node


def test_profiled_file_drives_the_cost_model(profiled: tuple[Path, str]) -> None:
    cluster = Cluster.load(profiled[0])
    link = cluster.intra_node
    for kind in COLLECTIVE_KINDS:
        curve = cluster.curves.collectives[(kind, "intra", 2)]
        for x, seconds in zip(curve.xs, curve.seconds, strict=True):
            assert collective_time(cluster, kind, x, 2, link) == seconds
        beyond = 4 * curve.xs[-1]
        expected = analytic_collective_time(kind, beyond, 2, link)
        assert collective_time(cluster, kind, beyond, 2, link) == expected


# ------------------------------------------------------------------ one rank, on a base


@pytest.mark.slow
def test_profile_one_rank_keeps_the_base_clusters_links(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One rank measures its device and no collectives: the links, node shape and backend are
    the base file's (a GPU's published NCCL figures, here the CPU cluster's)."""
    base_path = ROOT / "costmodels" / "cpu-gloo-4.json"
    out = tmp_path / "one-rank.json"
    cmd = [sys.executable, "-m", "autoplan.cli", "profile", "--nproc", "1", "--base"]
    cmd += [str(base_path), "-o", str(out), "--max-bytes", str(MAX_BYTES)]
    cmd += ["--max-matmul-dim", str(MAX_DIM), "--repeats", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ranks that share them compute slower" in proc.stderr  # one CPU rank had 2 cores
    with caplog.at_level(logging.WARNING):
        cluster, base = Cluster.load(out), Cluster.load(base_path)
    assert not caplog.records
    assert cluster.name == "one-rank"
    assert (cluster.intra_node, cluster.inter_node) == (base.intra_node, base.inter_node)
    assert (cluster.num_nodes, cluster.devices_per_node) == (base.num_nodes, base.devices_per_node)
    assert (cluster.backend, cluster.cores_per_node) == (base.backend, None)
    assert cluster.device.kind == machine_fingerprint("gloo").device
    curves = cluster.curves
    assert set(curves.matmul) == set(curves.elementwise) == set(REQUIRED_DTYPES)
    assert curves.op_overhead is not None and curves.op_overhead > 0
    assert set(curves.op_overheads) == set(OP_OVERHEAD_KINDS)
    assert not curves.collectives
    assert curves.redistribute_overhead is None and curves.sync_overhead is None
    assert cluster.source.endswith(f"cpu-gloo-4's source: {base.source}")
    rate = curves.matmul["float32"].xs[-1] / curves.matmul["float32"].seconds[-1]
    assert f"float32 {rate / base.peak_flops('float32'):.0%} of " in cluster.source


def test_one_rank_profile_needs_a_base_and_more_ranks_refuse_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--nproc", "1", "-o", "x.json"]) == 2
    assert "give --base CLUSTER.json" in capsys.readouterr().err
    base = str(ROOT / "costmodels" / "cpu-gloo-4.json")
    assert main(["profile", "--nproc", "2", "--base", base, "-o", "x.json"]) == 2
    assert "--base is for a profile of one rank" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    assert main(["profile", "--nproc", "1", "--base", str(broken), "-o", "x.json"]) == 2
    assert str(broken) in capsys.readouterr().err  # refused before torchrun starts


def test_one_gpu_profile_is_committed_with_its_provenance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """costmodels/h100-sxm-8-profiled.json: one H100's compute curves on the DGX H100 figures,
    and its matmul efficiency against the datasheet's peak in the source."""
    with caplog.at_level(logging.WARNING):
        cluster = Cluster.load(ROOT / "costmodels" / "h100-sxm-8-profiled.json")
        base = Cluster.load(ROOT / "costmodels" / "h100-sxm-8.json")
    assert "--nproc 1 --base BASE.json" in caplog.text  # profiled elsewhere: how to redo it
    fingerprint = cluster.curves.fingerprint
    assert fingerprint is not None and fingerprint.device.startswith("NVIDIA H100")
    assert (cluster.intra_node, cluster.inter_node) == (base.intra_node, base.inter_node)
    assert (cluster.num_devices, cluster.backend) == (8, "nccl")
    assert not cluster.curves.collectives
    for dtype in REQUIRED_DTYPES:
        efficiency = cluster.peak_flops(dtype) / base.peak_flops(dtype)
        assert 0.3 < efficiency <= 1.0
        assert f"{dtype} {efficiency:.0%} of {base.peak_flops(dtype) / 1e12:.3g}" in cluster.source


# ------------------------------------------------------------------ the bundled profile


def test_bundled_profile_is_canonical_and_complete() -> None:
    path = ROOT / "costmodels" / "cpu-gloo-4-profiled.json"
    cluster = Cluster.load(path)
    assert path.read_text() == json.dumps(cluster.to_dict(), sort_keys=True, indent=2) + "\n"
    assert cluster.num_devices == 4
    keys = {(kind, "intra", n) for kind in COLLECTIVE_KINDS for n in (2, 4)}
    assert set(cluster.curves.collectives) == keys - {("send_recv", "intra", 4)}
    assert set(cluster.curves.matmul) == set(cluster.curves.elementwise) == set(REQUIRED_DTYPES)
    assert set(cluster.curves.activation) == set(REQUIRED_DTYPES)
    assert cluster.curves.op_overhead is not None and cluster.curves.op_overhead > 0
    assert cluster.curves.redistribute_overhead is not None
    assert cluster.curves.sync_overhead is not None


# ------------------------------------------------------------------ fingerprints


def test_mismatched_fingerprint_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    curve = [[4.0, 1e-3], [8.0, 2e-3]]
    here = _toy({"fingerprint": _fingerprint(), "all_reduce": {"intra/2": curve}})
    other = _toy({"fingerprint": _fingerprint(torch="1.0.0"), "all_reduce": {"intra/2": curve}})
    here.save(tmp_path / "here.json")
    other.save(tmp_path / "other.json")
    with caplog.at_level(logging.WARNING, logger="autoplan.cluster"):
        assert Cluster.load(tmp_path / "here.json") == here
        assert not caplog.records
        loaded = Cluster.load(tmp_path / "other.json")  # a warning, not an error
    assert loaded == other
    (record,) = caplog.records
    message = record.getMessage()
    stored, mine = other.curves.fingerprint, machine_fingerprint("gloo")
    assert stored is not None and stored.id != mine.id
    assert stored.id in message and mine.id in message
    assert "torch 1.0.0" in message and "re-profile" in message
    assert str(tmp_path / "other.json") in message


def test_fingerprint_matches_a_host_of_a_multi_host_profile() -> None:
    mine = machine_fingerprint("gloo")
    hosts = sorted([*mine.hosts, "0" * 12])
    measured = {"fingerprint": _fingerprint(hosts=hosts)}
    stored = _toy(measured).curves.fingerprint
    assert stored is not None and stored.matches(mine)
    elsewhere = _toy({"fingerprint": _fingerprint(hosts=["0" * 12])}).curves.fingerprint
    assert elsewhere is not None and not elsewhere.matches(mine)


# ------------------------------------------------------------------ corrupted profiles


def _good() -> dict[str, Any]:
    return {
        "fingerprint": _fingerprint(),
        "matmul": {"float32": [[100.0, 5.0], [200.0, 6.0]]},
        "all_reduce": {"intra/2": [[4.0, 1e-3], [8.0, 2e-3]]},
        "send_recv": {"inter/2": [[4.0, 1e-3]]},
    }


@pytest.mark.parametrize(
    ("corrupt", "field", "says"),
    [
        (lambda m: m.pop("fingerprint"), "measured.fingerprint", "missing field"),
        (lambda m: m["fingerprint"].pop("torch"), "measured.fingerprint.torch", "missing"),
        (lambda m: m["fingerprint"].update(hosts=[]), "measured.fingerprint.hosts", "non-empty"),
        (lambda m: m.update(matmull={}), "measured.matmull", "unknown field"),
        (lambda m: m["all_reduce"].update({"intra/1": [[4, 1]]}), "intra/1", "group size"),
        (lambda m: m["all_reduce"].update({"cross/2": [[4, 1]]}), "cross/2", "intra or inter"),
        (lambda m: m["send_recv"].update({"intra/4": [[4, 1]]}), "intra/4", "group size 2"),
        (lambda m: m["all_reduce"].update({"intra/2": []}), "measured.all_reduce.intra/2", "list"),
        (
            lambda m: m["all_reduce"]["intra/2"].append([16.0, 1e-4]),
            "measured.all_reduce.intra/2[2]",
            "must not decrease",
        ),
        (
            lambda m: m["matmul"]["float32"].append([150.0, 7.0]),
            "measured.matmul.float32[2]",
            "sizes must increase",
        ),
        (
            lambda m: m["matmul"]["float32"].append([300.0, "slow"]),
            "measured.matmul.float32[2][1]",
            "finite number",
        ),
        (lambda m: m["matmul"]["float32"].append([0.0]), "measured.matmul.float32[2]", "pair"),
        (lambda m: m["matmul"]["float32"][0].__setitem__(0, -1), "float32[0][0]", "> 0"),
        (lambda m: m.update(op_overhead=-1e-6), "measured.op_overhead", ">= 0 s"),
        (lambda m: m.update(op_overhead="5us"), "measured.op_overhead", "finite number"),
        (lambda m: m.update(op_overheads={"view": -1}), "measured.op_overheads.view", ">= 0 s"),
        (lambda m: m.update(op_overheads=[1e-5]), "measured.op_overheads", "object"),
        (lambda m: m.update(redistribute_overhead=1e-3), "redistribute_overhead", "again"),
        (lambda m: m.update(redistribute_overhead=[[4, -1]]), "overhead[0][1]", ">= 0"),
        (lambda m: m.update(sync_overhead=[1e-3]), "measured.sync_overhead", "finite number"),
        (lambda m: m.update(activation={"float32": [[8, 2], [4, 3]]}), "activation", "increase"),
    ],
)
def test_corrupted_profile_is_refused(corrupt: Any, field: str, says: str, tmp_path: Path) -> None:
    data = _toy({}).to_dict()
    data["measured"] = _good()
    Cluster.from_dict(copy.deepcopy(data))  # valid before the corruption
    corrupt(data["measured"])
    path = tmp_path / "corrupt.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterFormatError) as info:
        Cluster.load(path)
    message = str(info.value)
    assert str(path) in message and field in message and says in message


# ------------------------------------------------------------------ interpolation


def test_curve_is_exact_at_points_linear_between_and_none_outside() -> None:
    curve = Curve((1.0, 2.0, 4.0), (10.0, 10.0, 30.0))
    assert [curve(x) for x in (1.0, 2.0, 4.0)] == [10.0, 10.0, 30.0]
    assert curve(1.5) == 10.0
    assert curve(3.0) == pytest.approx(20.0)
    assert curve(0.999) is None and curve(4.001) is None and curve(0.0) is None
    single = Curve((8.0,), (1.0,))
    assert single(8.0) == 1.0 and single(7.0) is None


def test_curve_is_monotone_on_random_profiles() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        xs = np.cumsum(rng.uniform(0.1, 100.0, size=12))
        seconds = monotone(rng.uniform(0.0, 1.0, size=12).tolist())  # noisy, made monotone
        curve = Curve(tuple(xs.tolist()), tuple(seconds))
        for x, s in zip(xs, seconds, strict=True):
            assert curve(float(x)) == s
        dense = np.linspace(xs[0], xs[-1], 2000)
        values = [curve(float(x)) for x in dense]
        assert all(v is not None for v in values)
        assert all(a <= b for a, b in itertools.pairwise(values))


def test_monotone_pools_adjacent_violators() -> None:
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert monotone([1.0, 1.0, 5.0]) == [1.0, 1.0, 5.0]  # already monotone: unchanged
    noisy = np.random.default_rng(1).uniform(size=50).tolist()
    fitted = monotone(noisy)
    assert all(a <= b for a, b in itertools.pairwise(fitted))
    assert sum(fitted) == pytest.approx(sum(noisy))  # pooling keeps every run's mean
    assert monotone(fitted) == fitted


# ------------------------------------------------------------------ cost model: measured or not


def test_collective_time_uses_curves_inside_and_analytic_outside() -> None:
    measured = {
        "fingerprint": _fingerprint(),
        "all_reduce": {"intra/4": [[1000.0, 1.0], [2000.0, 3.0]]},
        "send_recv": {"intra/2": [[1000.0, 0.5]]},
    }
    cluster = _toy(measured)
    intra, inter = cluster.intra_node, cluster.inter_node
    assert collective_time(cluster, "all_reduce", 1000, 4, intra) == 1.0
    assert collective_time(cluster, "all_reduce", 1500, 4, intra) == pytest.approx(2.0)
    assert collective_time(cluster, "all_reduce", 2000, 4, intra) == 3.0
    for nbytes, size, link in (
        (999, 4, intra),
        (2001, 4, intra),
        (1500, 2, intra),
        (1500, 4, inter),
    ):
        expected = analytic_collective_time("all_reduce", nbytes, size, link)
        assert collective_time(cluster, "all_reduce", nbytes, size, link) == expected
    assert collective_time(cluster, "all_reduce", 1500, 4, intra) != analytic_collective_time(
        "all_reduce", 1500, 4, intra
    )
    assert collective_time(cluster, "all_gather", 1500, 4, intra) == analytic_collective_time(
        "all_gather", 1500, 4, intra
    )
    # a send is keyed by its two ranks whatever group it belongs to
    assert collective_time(cluster, "send_recv", 1000, 8, intra) == 0.5
    assert collective_time(cluster, "all_reduce", 0, 4, intra) == 0.0
    assert collective_time(cluster, "all_reduce", 1500, 1, intra) == 0.0
    # a link that is neither of the cluster's: the formula
    odd = Link(bandwidth=5.0, latency=0.1)
    assert collective_time(cluster, "all_reduce", 1500, 4, odd) == analytic_collective_time(
        "all_reduce", 1500, 4, odd
    )


def test_compute_time_uses_curves_inside_and_roofline_outside() -> None:
    measured = {
        "fingerprint": _fingerprint(),
        "matmul": {"float32": [[100.0, 5.0], [200.0, 6.0]]},
        "elementwise": {"float32": [[10.0, 4.0], [20.0, 8.0]]},
    }
    cluster = _toy(measured)
    analytic = _toy({})
    assert compute_time(cluster, 150, 0, "float32") == pytest.approx(5.5)
    assert compute_time(cluster, 150, 0, "int64") == pytest.approx(5.5)  # float32 stands in
    assert compute_time(cluster, 150, 20, "float32") == 8.0  # max of the two curves
    assert compute_time(cluster, 1000, 0, "float32") == compute_time(analytic, 1000, 0, "float32")
    assert compute_time(cluster, 50, 0, "float32") == compute_time(analytic, 50, 0, "float32")
    assert compute_time(cluster, 150, 0, "bfloat16") == compute_time(analytic, 150, 0, "bfloat16")
    # memory-bound part outside its curve, compute part inside its own
    assert compute_time(cluster, 150, 100, "float32") == pytest.approx(20.0)
    assert compute_time(cluster, 0, 0, "float32") == 0.0


def test_activation_time_uses_its_curve_and_its_rate_beyond() -> None:
    cluster = _toy({"fingerprint": _fingerprint(), "activation": {"float32": [[10, 2], [20, 6]]}})
    assert activation_time(cluster, 10, "float32") == 2.0  # exact at a point
    assert activation_time(cluster, 15, "float32") == pytest.approx(4.0)
    assert activation_time(cluster, 15, "int64") == pytest.approx(4.0)  # float32 stands in
    assert activation_time(cluster, 40, "float32") == pytest.approx(12.0)  # the largest's rate
    assert activation_time(cluster, 5, "float32") == pytest.approx(1.0)  # the smallest's rate
    assert activation_time(cluster, 0, "float32") == 0.0
    assert activation_time(cluster, 15, "bfloat16") == 0.0  # not measured: the roofline alone
    assert activation_time(_toy({}), 15, "float32") == 0.0


def test_redistribute_overhead_is_its_curve_its_first_point_below_and_its_rate_above() -> None:
    cluster = _toy({"fingerprint": _fingerprint(), "redistribute_overhead": [[4, 1], [64, 3]]})
    assert redistribute_overhead(cluster, 64) == 3.0  # exact at a point
    assert redistribute_overhead(cluster, 34) == pytest.approx(2.0)
    assert redistribute_overhead(cluster, 2) == 1.0  # a smaller tensor costs the fixed part
    assert redistribute_overhead(cluster, 128) == pytest.approx(6.0)  # the largest's rate
    assert redistribute_overhead(_toy({}), 34) == 0.0  # not measured


def test_op_overhead_adds_on_cpu_ranks_and_is_summed_apart_on_gpus() -> None:
    overheads = {"aten.linear.default": 3.0, "view": 0.5}
    measured = {"fingerprint": _fingerprint(), "op_overhead": 2.0, "op_overheads": overheads}
    cpu = _toy(measured)
    gpu = dataclasses.replace(_toy(measured), backend="nccl")
    assert (with_overhead(cpu, 5.0), with_overhead(cpu, 0.0)) == (7.0, 2.0)
    assert with_overhead(cpu, 5.0, "aten.linear.default") == 8.0  # the op's own
    assert with_overhead(cpu, 0.0, "view") == 0.5
    assert with_overhead(cpu, 5.0, "aten.mm.default") == 7.0  # not measured apart
    assert host_overhead(cpu, "aten.linear.default") == 0.0  # added to the op instead
    assert with_overhead(gpu, 5.0, "aten.linear.default") == 5.0
    assert (host_overhead(gpu), host_overhead(gpu, "aten.linear.default")) == (2.0, 3.0)
    nothing = _toy({})
    assert with_overhead(nothing, 5.0, "view") == 5.0  # not measured
    assert host_overhead(dataclasses.replace(nothing, backend="nccl"), "view") == 0.0


def test_a_gpu_step_computes_for_the_longer_of_its_kernels_and_its_host_work() -> None:
    """The host queues kernels while the GPU runs earlier ones: a step's compute is the larger
    of the two sums, not the sum of each op's larger."""
    w = load_workload(ROOT / "examples" / "mlp.py", hidden=256, num_layers=4, batch_size=512)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    issued = sum(
        1 for n in graph if n.kind == NodeKind.OP or (n.kind == NodeKind.PARAM and n.needs_grad)
    )
    one_gpu = dataclasses.replace(_toy({}), backend="nccl", num_nodes=1, devices_per_node=1)

    def compute_s(overhead: float) -> float:
        measured = {"fingerprint": _fingerprint(), "op_overhead": overhead}
        cluster = dataclasses.replace(one_gpu, measured=measured)
        pricer = Pricer(cluster, (1,), "adamw")
        assert sum(pricer.host_time(n) for n in graph) == pytest.approx(issued * overhead)
        plan = autoplan.plan(
            w.model, w.example_inputs, cluster, loss_fn=w.loss_fn, example_target=w.example_target
        )
        return plan.predicted.compute_s

    kernels = compute_s(0.0)
    assert kernels > 0
    # each op's host work well below its kernels': the GPU sets the pace
    assert compute_s(kernels / (10 * issued)) == pytest.approx(kernels)
    # each op's host work as long as all the kernels: the host sets it
    assert compute_s(kernels) == pytest.approx(issued * kernels)


def test_step_costs_add_the_measured_overheads() -> None:
    overheads = {
        "op_overhead": 0.5,
        "redistribute_overhead": [[4.0, 3.0], [1e6, 3.0]],
        "sync_overhead": 1.0,
    }
    measured = {"fingerprint": _fingerprint(), "activation": {"float32": [[1.0, 0.0], [1e6, 2.0]]}}
    plain = Pricer(_toy({}), (4,), "adamw")
    pricer = Pricer(_toy({**measured, **overheads}), (4,), "adamw")
    t = TensorInfo((1000,), "float32")

    def op(name: str, **fields: Any) -> Node:
        base = dict(args=(), kwargs=(), outputs=(t,), flops=1000.0, bwd_flops=1000.0)
        base |= dict(bytes_moved=8000.0, module_path="", target="", params=(), needs_grad=True)
        return Node(name, NodeKind.OP, "aten.gelu.default", **(base | {"is_view": False} | fields))

    replicated = Strategy(output=(R,), inputs=((R,),))
    # a view moves nothing (a cast, traced as a view too, moves its bytes: priced as a copy)
    view = op("v", is_view=True, flops=0.0, bwd_flops=0.0, bytes_moved=0.0)
    assert (plain.node_time(view, replicated), pricer.node_time(view, replicated)) == (0.0, 0.5)
    gelu = op("g", transcendental=1000.0)  # 4000 bytes of elements: 0.008 s on the curve
    expected = plain.node_time(gelu, replicated) + 0.008 + 0.5
    assert pricer.node_time(gelu, replicated) == pytest.approx(expected)
    param = dataclasses.replace(op("w"), kind=NodeKind.PARAM)
    assert pricer.node_time(param, replicated) == plain.node_time(param, replicated) + 0.5
    # a redistribution pays DTensor's overhead; a gradient bucket's all-reduce does not
    all_reduce = Collective("all_reduce", (0,), 4000)
    raw = pricer.collective_s(all_reduce)
    assert raw == plain.collective_s(all_reduce) > 0
    assert pricer.redistribution_s(all_reduce) == raw + 3.0
    partial = Strategy(output=(P,), inputs=())
    seconds, found = pricer.forward(t, partial, replicated, 0)
    assert found == (all_reduce,) and seconds == raw + 3.0
    # the step waits for the ranks' skew at it: sync_s, once per op (step_price.price_step)
    assert (pricer.sync_s, plain.sync_s) == (1.0, 0.0)
    user = dataclasses.replace(op("u"), needs_grad=False)
    assert pricer.edge(op("p", needs_grad=False), t, partial, user, replicated, 0, 1) == raw + 4.0
    assert pricer.phased_s(Phased(all_reduce, "grad_sync", ("w",))) == raw  # a bucket's
    zero = Phased(all_reduce, "grad_sync")  # outside the buckets: ZeRO's, say
    assert pricer.phased_s(zero) == raw + 3.0
    # those are issued asynchronously and waited for once, at the optimizer
    bucket = Phased(all_reduce, "grad_sync", ("w",))
    assert pricer.gradients_s([bucket, bucket]) == 2 * raw
    assert pricer.gradients_s([zero, zero, bucket]) == 3 * raw + 2 * 3.0 + 1.0
    # a pipeline's activation and its gradient: two messages, each waited for
    message = collective_time(pricer.cluster, "send_recv", 4000, 2, pricer.cluster.inter_node)
    assert send_time(pricer.cluster, 4000) == 2 * (message + 1.0)
    assert send_time(plain.cluster, 4000) == 2 * message and send_time(pricer.cluster, 0) == 0


# ------------------------------------------------------------------ what is measured, and the fit


def test_local_curves_keep_each_points_median_over_passes_spread_through_the_profile() -> None:
    passes = [
        [[1.0, 2.0], [2.0, 5.0], [4.0, 9.0]],
        [[1.0, 3.0], [2.0, 4.0], [4.0, 8.0]],
        [[1.0, 9.0], [2.0, 9.5]],  # slow, and ended early: its next size was predicted too slow
    ]
    # one slow pass moves no point; past the short pass the median of two, kept non-decreasing
    assert run._median_curve(passes) == [[1.0, 3.0], [2.0, 5.0], [4.0, 8.5]]
    assert run._median_curve(passes[::-1]) == run._median_curve(passes)
    tasks = plan_tasks(1, 4, Settings())
    order = run._in_passes(tasks)
    local = [t for t in tasks if t.section in run.LOCAL]
    others = [t for t in tasks if t.section not in run.LOCAL]
    assert set(run.LOCAL) == {"matmul", "elementwise", "activation"}
    assert order[: len(local)] == local and order[-len(local) :] == local
    assert [t for t in order if t.section not in run.LOCAL] == others  # each once, in order
    assert len(order) == len(others) + run.LOCAL_PASSES * len(local)
    middle = len(local) + len(others) // 2  # the second pass, halfway through the others
    assert run.LOCAL_PASSES == 3 and order[middle : middle + len(local)] == local


def test_local_ops_are_timed_on_operands_cycled_through_the_caches() -> None:
    cpu = torch.device("cpu")
    seen: list[int] = []
    small = operations.cold((64, 64), torch.float32, cpu, lambda a, b, out: seen.append(id(a)))
    for _ in range(2 * operations.COLD_POOL_SETS):
        small.call()
    assert small.local and len(set(seen)) == operations.COLD_POOL_SETS  # 48 KiB a set: capped
    assert seen[: operations.COLD_POOL_SETS] == seen[operations.COLD_POOL_SETS :]  # in turn, again
    seen.clear()
    large = operations.cold((2**23,), torch.float32, cpu, lambda a, b, out: seen.append(id(a)))
    for _ in range(4):
        large.call()
    assert len(set(seen)) == 2  # 96 MiB a set: two pass 128 MiB


def test_group_sizes_and_layouts_are_the_meshes() -> None:
    tasks = plan_tasks(2, 8, Settings(max_bytes=64, max_matmul_dim=16))
    groups = {(t.section, t.key): t.groups for t in tasks if t.groups}
    keys = {key for _, key in groups}
    assert keys == {"intra/2", "intra/4", "intra/8", "inter/2", "inter/4", "inter/8", "inter/16"}
    assert groups[("all_reduce", "inter/2")] == tuple((r, r + 8) for r in range(8))
    assert groups[("all_reduce", "intra/4")] == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        (12, 13, 14, 15),
    )
    assert ("send_recv", "intra/4") not in groups and ("send_recv", "inter/2") in groups
    cluster = dataclasses.replace(_toy({}), devices_per_node=8)  # 2 nodes of 8
    for (_, key), gs in groups.items():
        nodes = [{cluster.node_of(r) for r in g} for g in gs]
        assert all((len(n) > 1) == key.startswith("inter") for n in nodes), key
    # gathered and scattered sizes divide evenly among the group's ranks
    for t in tasks:
        if t.section in ("all_gather", "reduce_scatter", "all_to_all"):
            assert all(s % (4 * len(t.groups[0])) == 0 for s in t.sizes)
    assert plan_tasks(1, 4, Settings())[-1].key == "intra/4"


def test_fit_recovers_alpha_and_beta() -> None:
    link = Link(bandwidth=2e9, latency=3e-5)
    sizes = [4.0 * 2**k for k in range(20)]
    all_reduce = [[x, analytic_collective_time("all_reduce", x, 4, link)] for x in sizes]
    measured = {
        "fingerprint": _fingerprint(),
        "matmul": {d: [[1e6, 1e-4], [1e9, 0.02]] for d in REQUIRED_DTYPES},
        "elementwise": {"float32": [[1e3, 1e-6], [1e9, 0.1]]},
        "all_reduce": {"intra/2": [[4.0, 1.0], [8.0, 2.0]], "intra/4": all_reduce},
    }
    cluster = fitted_cluster(
        name="fit",
        backend="gloo",
        num_nodes=1,
        devices_per_node=4,
        memory_bytes=2**30,
        measured=measured,
        how="synthetic.",
    )
    assert cluster.intra_node.bandwidth == pytest.approx(2e9)
    assert cluster.intra_node.latency == pytest.approx(3e-5)
    assert cluster.inter_node == cluster.intra_node
    assert cluster.peak_flops("bfloat16") == pytest.approx(5e10)
    assert cluster.device.memory_bandwidth == pytest.approx(1e10)
    assert cluster.source.startswith("synthetic. Constants fitted")


def test_progress_line_estimates_time_left() -> None:
    line = Progress(done=0.25, elapsed=10.0, label="all_reduce intra/4 1 MiB", milestone=False)
    text = line.line()
    assert text.startswith("[######------------------]  25% all_reduce intra/4 1 MiB")
    assert "elapsed 0:10, about 0:30 left" in text
    assert "about ? left" in Progress(0.0, 0.0, "x", False).line()


def test_multi_node_profile_needs_a_rendezvous(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["profile", "--nproc", "2", "--nnodes", "2", "-o", "x.json"])
    assert code == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err
    assert main(["profile", "-o", "x.json"]) == 2
    assert "--nproc" in capsys.readouterr().err

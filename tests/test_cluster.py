"""Cluster files, validation, mesh helpers and the analytic cost model."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from autoplan.cluster.hardware import Device, Link
from autoplan.cluster.mesh import mesh_groups, mesh_shapes
from autoplan.cluster.model import Cluster
from autoplan.costmodel.timing import (
    COLLECTIVE_KINDS,
    collective_time,
    compute_time,
    tile_share,
)
from autoplan.errors import ClusterFormatError, MeshShapeError

COSTMODELS = Path(__file__).resolve().parent.parent / "costmodels"
FILES = ("cpu-gloo-4.json", "dgx-a100-80gb.json", "h100-sxm-8.json")


def _raw(name: str = "dgx-a100-80gb.json") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((COSTMODELS / name).read_text())
    return data


def _toy(num_nodes: int = 1, devices_per_node: int = 4) -> Cluster:
    """Round numbers so expected times can be written out by hand."""
    return Cluster(
        name="toy",
        device=Device(
            kind="toy",
            memory_bytes=2**30,
            peak_flops={"float32": 100.0, "bfloat16": 400.0, "float16": 400.0},
            memory_bandwidth=10.0,
            compute_efficiency=0.5,
            memory_efficiency=0.5,
        ),
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        intra_node=Link(bandwidth=100.0, latency=1.0),
        inter_node=Link(bandwidth=10.0, latency=2.0),
        backend="gloo",
        source="test",
        measured={},
    )


# ------------------------------------------------------------------ files


@pytest.mark.parametrize("name", FILES)
def test_load_save_round_trip(name: str, tmp_path: Path) -> None:
    cluster = Cluster.load(COSTMODELS / name)
    assert cluster.name == name.removesuffix(".json")
    out = tmp_path / name
    cluster.save(out)
    text = out.read_text()
    assert text.endswith("}\n")
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    assert Cluster.load(out) == cluster
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert hash(Cluster.load(out)) == hash(cluster)


@pytest.mark.parametrize("name", FILES)
def test_bundled_files_are_canonical(name: str) -> None:
    # The files are written by Cluster.save; keeping them so makes diffs of edits minimal.
    cluster = Cluster.load(COSTMODELS / name)
    expected = json.dumps(cluster.to_dict(), sort_keys=True, indent=2) + "\n"
    assert (COSTMODELS / name).read_text() == expected


def test_bundled_numbers() -> None:
    a100 = Cluster.load(COSTMODELS / "dgx-a100-80gb.json")
    assert a100.num_devices == 8
    assert a100.backend == "nccl"
    assert a100.device.memory_bytes == 80 * 2**30
    assert a100.peak_flops("bfloat16") == 312e12
    assert a100.intra_node.bandwidth == 300e9
    assert a100.inter_node.bandwidth == 25e9
    cpu = Cluster.load(COSTMODELS / "cpu-gloo-4.json")
    assert (cpu.num_nodes, cpu.devices_per_node, cpu.backend) == (1, 4, "gloo")
    assert cpu.measured == {}


def test_num_nodes_override() -> None:
    cluster = Cluster.load(COSTMODELS / "dgx-a100-80gb.json", num_nodes=4)
    assert cluster.num_nodes == 4
    assert cluster.num_devices == 32
    assert cluster == Cluster.load(COSTMODELS / "dgx-a100-80gb.json").with_nodes(4)
    assert cluster.node_of(7) == 0
    assert cluster.node_of(8) == 1
    assert cluster.node_of(31) == 3
    with pytest.raises(ClusterFormatError, match="num_nodes"):
        Cluster.load(COSTMODELS / "dgx-a100-80gb.json", num_nodes=0)
    with pytest.raises(ClusterFormatError, match="num_nodes"):
        cluster.with_nodes(-1)


def test_fingerprint() -> None:
    cluster = Cluster.load(COSTMODELS / "h100-sxm-8.json")
    fp = cluster.fingerprint()
    assert len(fp) == 16
    assert int(fp, 16) >= 0
    assert cluster.with_nodes(2).fingerprint() != fp
    renamed = Cluster.from_dict({**cluster.to_dict(), "name": "other", "source": "elsewhere"})
    assert renamed.fingerprint() == fp
    # Ints and floats of the same value fingerprint alike (JSON files may write either).
    data = cluster.to_dict()
    data["intra_node"]["bandwidth"] = 450_000_000_000
    assert Cluster.from_dict(data).fingerprint() == fp


def test_pickle_and_deepcopy() -> None:
    cluster = _toy().with_nodes(2)
    assert pickle.loads(pickle.dumps(cluster)) == cluster
    assert copy.deepcopy(cluster) == cluster


def test_frozen_mappings() -> None:
    flops = {"float32": 1.0, "bfloat16": 2.0, "float16": 2.0}
    device = Device("d", 1, flops, 1.0, 1.0, 1.0)
    flops["float32"] = 5.0  # the caller's dict is copied, not shared
    assert device.peak_flops["float32"] == 1.0
    with pytest.raises(TypeError):
        device.peak_flops["float32"] = 3.0  # type: ignore[index]


def test_peak_flops_falls_back_to_float32() -> None:
    cluster = _toy()
    assert cluster.peak_flops("bfloat16") == 400.0
    assert cluster.peak_flops("int64") == 100.0


# ------------------------------------------------------------------ validation


def test_missing_field_names_path() -> None:
    data = _raw()
    del data["device"]["memory_bytes"]
    with pytest.raises(ClusterFormatError, match=r"device\.memory_bytes"):
        Cluster.from_dict(data, "a100.json")


def test_missing_dtype_names_path(tmp_path: Path) -> None:
    data = _raw()
    del data["device"]["peak_flops"]["float32"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterFormatError) as info:
        Cluster.load(path)
    assert "device.peak_flops.float32" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("intra_node", "bandwidth"), -1.0, r"intra_node\.bandwidth.*> 0"),
        (("inter_node", "latency"), -1e-6, r"inter_node\.latency.*>= 0"),
        (("device", "compute_efficiency"), 1.5, r"device\.compute_efficiency.*\(0, 1\]"),
        (("device", "memory_bytes"), 1.5, r"device\.memory_bytes.*integer"),
        (("device", "kind"), 3, r"device\.kind.*string"),
        (("device", "peak_flops", "bfloat16"), "fast", r"device\.peak_flops\.bfloat16.*number"),
        (("num_nodes",), True, r"num_nodes.*integer"),
        (("backend",), "mpi", r"backend.*gloo, nccl"),
        (("measured",), [], r"measured.*object"),
        (("cores_per_node",), 0, r"cores_per_node.*>= 1"),
    ],
)
def test_bad_values(path: tuple[str, ...], value: Any, expected: str) -> None:
    data = copy.deepcopy(_raw())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ClusterFormatError, match=expected):
        Cluster.from_dict(data)


def test_ranks_sharing_cores_run_faster_while_others_wait() -> None:
    shared = dataclasses.replace(_toy(devices_per_node=4), cores_per_node=2)
    # all 4 busy: a half core each, as profiled; 2 or fewer busy: a whole core, twice as fast
    assert [shared.rank_speed(n) for n in (4, 3, 2, 1)] == [1.0, 4 / 3, 2.0, 2.0]
    assert Cluster.from_dict(shared.to_dict()) == shared
    own_device = dataclasses.replace(shared, cores_per_node=None)
    assert "cores_per_node" not in own_device.to_dict()  # files without it keep their hash
    assert own_device.rank_speed(1) == 1.0
    assert dataclasses.replace(shared, cores_per_node=4).rank_speed(1) == 1.0


def test_unknown_field() -> None:
    data = _raw()
    data["intra_node"]["bandwith"] = 1.0
    with pytest.raises(ClusterFormatError, match=r"intra_node\.bandwith"):
        Cluster.from_dict(data)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterFormatError, match="does not exist"):
        Cluster.load(tmp_path / "nope.json")


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "name": "x",\n  "backend": \n}\n')
    with pytest.raises(ClusterFormatError, match=r"bad\.json.*line 4"):
        Cluster.load(path)


def test_top_level_not_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]\n")
    with pytest.raises(ClusterFormatError, match="top level must be a JSON object"):
        Cluster.load(path)


# ------------------------------------------------------------------ meshes


def test_mesh_groups_2x4() -> None:
    # ranks laid row-major:  0 1 2 3
    #                        4 5 6 7
    assert mesh_groups((2, 4), 0) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh_groups((2, 4), 1) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mesh_groups((2, 4), -1) == mesh_groups((2, 4), 1)
    assert mesh_groups((4,), 0) == ((0, 1, 2, 3),)
    with pytest.raises(MeshShapeError, match="axis 2"):
        mesh_groups((2, 4), 2)


def test_mesh_groups_3d() -> None:
    # (2, 2, 2): rank = 4*i + 2*j + k; axis 1 varies j with i, k fixed.
    assert mesh_groups((2, 2, 2), 1) == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_mesh_groups_along_several_axes_are_the_flattened_groups() -> None:
    # the ranks that differ only along the axes, in row-major order of those axes
    assert mesh_groups((2, 2, 2), (0, 2)) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert mesh_groups((2, 4), (0, 1)) == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert mesh_groups((2, 2, 2), (1,)) == mesh_groups((2, 2, 2), 1)
    with pytest.raises(MeshShapeError, match="axis 3"):
        mesh_groups((2, 2, 2), (0, 3))


def test_mesh_shapes() -> None:
    assert mesh_shapes(4, 1) == ((4,),)
    assert mesh_shapes(4, 2) == ((1, 4), (2, 2), (4, 1))
    assert len(mesh_shapes(8, 3)) == 10


def test_check_mesh_shape() -> None:
    cluster = _toy()
    cluster.check_mesh_shape((4,))
    cluster.check_mesh_shape((2, 2))
    cluster.check_mesh_shape((1, 4))
    with pytest.raises(MeshShapeError) as info:
        cluster.check_mesh_shape((3,))
    message = str(info.value)
    assert "(3,)" in message
    assert "has 3 devices" in message
    assert "has 4" in message
    assert "(4,), (1, 4), (2, 2), (4, 1)" in message
    with pytest.raises(MeshShapeError):
        cluster.check_mesh_shape((0, 4))
    with pytest.raises(MeshShapeError):
        cluster.check_mesh_shape(())


def test_axis_link_two_nodes() -> None:
    cluster = _toy(num_nodes=2, devices_per_node=8)
    assert cluster.axis_link((2, 8), 0) == cluster.inter_node
    assert cluster.axis_link((2, 8), 1) == cluster.intra_node
    # (8, 2): axis 0 groups are {0, 2, ..., 14}, spanning both nodes.
    assert cluster.axis_link((8, 2), 0) == cluster.inter_node
    assert cluster.axis_link((8, 2), 1) == cluster.intra_node
    assert cluster.axis_link((16,), 0) == cluster.inter_node
    # several axes together: slow if their groups span nodes
    assert cluster.axis_link((2, 2, 4), (1, 2)) == cluster.intra_node
    assert cluster.axis_link((2, 2, 4), (0, 2)) == cluster.inter_node
    # A one-node submesh, wherever it starts on a node boundary, stays inside the node.
    assert cluster.axis_link((2, 4), 0) == cluster.intra_node
    assert cluster.axis_link((2, 4), 0, first_rank=8) == cluster.intra_node
    assert cluster.axis_link((2, 4), 0, first_rank=4) == cluster.inter_node
    with pytest.raises(MeshShapeError, match="ranks"):
        cluster.axis_link((4, 8), 0)
    assert cluster.link_for_ranks([7, 8]) == cluster.inter_node
    assert cluster.link_for_ranks([8, 15]) == cluster.intra_node


# ------------------------------------------------------------------ cost model


def test_collective_time_by_hand() -> None:
    cluster = _toy()
    link = Link(bandwidth=100.0, latency=1.0)
    # n = 4, nbytes = 800, alpha = 1 s, beta = 100 B/s:
    #   all_reduce: (2*3 + 1)*1 + 2*(3/4)*800/100 = 7 + 12 = 19
    #   all_gather / reduce_scatter / all_to_all: (3 + 1)*1 + (3/4)*800/100 = 4 + 6 = 10
    #   send_recv: 1 + 800/100 = 9 (group size ignored)
    assert collective_time(cluster, "all_reduce", 800, 4, link) == pytest.approx(19.0)
    assert collective_time(cluster, "all_gather", 800, 4, link) == pytest.approx(10.0)
    assert collective_time(cluster, "reduce_scatter", 800, 4, link) == pytest.approx(10.0)
    assert collective_time(cluster, "all_to_all", 800, 4, link) == pytest.approx(10.0)
    assert collective_time(cluster, "send_recv", 800, 4, link) == pytest.approx(9.0)
    # n = 2: all_reduce (2*1 + 1)*1 + 2*(1/2)*800/100 = 3 + 8 = 11
    assert collective_time(cluster, "all_reduce", 800, 2, link) == pytest.approx(11.0)


def test_a_ring_across_nodes_pays_the_network_latency_only_between_nodes() -> None:
    """NCCL's ring model (src/graph/tuning.cc): 16 ranks on 2 nodes of 8 cross the network
    on 1 step of a pass (2 for an all-reduce), the other 14 (28) at the NVLink latency; the
    8 ranks of a node carry 8 rings side by side, one through each GPU's NIC."""
    h100 = Cluster.load(COSTMODELS / "h100-sxm-8.json").with_nodes(2)
    inter, intra = h100.inter_node, h100.intra_node
    assert h100.axis_nodes((16,), 0) == 2 and h100.axis_nodes((2, 8), 0) == 2
    assert h100.axis_nodes((2, 8), 1) == 1
    nbytes = 2**26  # large: Simple, NCCL's protocol for bandwidth
    rings = min(8 * inter.bandwidth, intra.bandwidth)
    want = (2 + 1) * inter.latency + 28 * intra.latency + 2 * 15 / 16 * nbytes / rings
    got = collective_time(h100, "all_reduce", nbytes, 16, inter, num_nodes=2)
    assert got == pytest.approx(want)
    # one rank a node (dp across nodes, tp inside): every step crosses, through one NIC
    every = (30 + 1) * inter.latency + 2 * 15 / 16 * nbytes / inter.bandwidth
    assert collective_time(h100, "all_reduce", nbytes, 16, inter, num_nodes=16) == every
    assert got < every
    # all_to_all goes rank to rank: each rank's NIC carries its own rows
    a2a = (1 + 1) * inter.latency + 14 * intra.latency + 15 / 16 * nbytes / inter.bandwidth
    assert collective_time(h100, "all_to_all", nbytes, 16, inter, num_nodes=2) == a2a


def test_nccl_takes_the_low_latency_protocol_for_small_messages() -> None:
    """NCCL's LL protocol (src/graph/tuning.cc's ring latencies, as shares of Simple's) for
    a small all-gather: far less latency, a quarter of the bandwidth across nodes; Simple for
    a large one. gloo has Simple alone."""
    h100 = Cluster.load(COSTMODELS / "h100-sxm-8.json").with_nodes(6)
    inter, intra = h100.inter_node, h100.intra_node
    rings = min(8 * inter.bandwidth, intra.bandwidth)

    def simple(nbytes: int) -> float:
        return 6 * inter.latency + 42 * intra.latency + 47 / 48 * nbytes / rings

    def ll(nbytes: int) -> float:
        latency = (
            3.6 / 8.4 + 5 * 2.7 / 9.6
        ) * inter.latency + 42 * 1.8 * 0.47 / 3.4 * intra.latency
        return latency + 47 / 48 * nbytes / (rings / 4)

    small, large = 2**16, 2**26
    assert ll(small) < simple(small) and simple(large) < ll(large)
    for nbytes in (small, large):
        got = collective_time(h100, "all_gather", nbytes, 48, inter, num_nodes=6)
        assert got == pytest.approx(min(simple(nbytes), ll(nbytes)))
    gloo = dataclasses.replace(h100, backend="gloo")
    assert collective_time(gloo, "all_gather", small, 48, inter, num_nodes=6) == pytest.approx(
        simple(small)
    )


def test_collective_time_trivial_and_errors() -> None:
    cluster = _toy()
    link = cluster.intra_node
    for kind in COLLECTIVE_KINDS:
        assert collective_time(cluster, kind, 0, 4, link) == 0.0
        if kind != "send_recv":
            assert collective_time(cluster, kind, 800, 1, link) == 0.0
    with pytest.raises(ValueError, match="all_gatherv"):
        collective_time(cluster, "all_gatherv", 800, 4, link)
    with pytest.raises(ValueError, match="group_size"):
        collective_time(cluster, "all_reduce", 800, 0, link)


def test_collective_time_cpu_file_matches_measurement() -> None:
    # The CPU file's link was fitted to a ~0.14 s 64 MiB all_reduce on 4 gloo ranks.
    cpu = Cluster.load(COSTMODELS / "cpu-gloo-4.json")
    t = collective_time(cpu, "all_reduce", 64 * 2**20, 4, cpu.axis_link((4,), 0))
    assert 0.12 < t < 0.16


def test_compute_time_roofline() -> None:
    cluster = _toy()
    # Compute-bound: 1000 FLOP / (100 FLOP/s * 0.5) = 20 s > 10 B / (10 B/s * 0.5) = 2 s.
    assert compute_time(cluster, 1000, 10, "float32") == pytest.approx(20.0)
    # Memory-bound: 100 B / (10 B/s * 0.5) = 20 s > 100 FLOP / (400 FLOP/s * 0.5) = 0.5 s.
    assert compute_time(cluster, 100, 100, "bfloat16") == pytest.approx(20.0)
    # Unlisted dtypes use the float32 peak: 100 FLOP / (100 * 0.5) = 2 s.
    assert compute_time(cluster, 100, 0, "int64") == pytest.approx(2.0)
    assert compute_time(cluster, 0, 0, "float32") == 0.0
    with pytest.raises(ValueError):
        compute_time(cluster, -1, 0, "float32")
    # a quarter of the work useful: 1000 FLOP / (100 FLOP/s * 0.5 * 0.25) = 80 s
    assert compute_time(cluster, 1000, 10, "float32", 0.25) == pytest.approx(80.0)
    with pytest.raises(ValueError):
        compute_time(cluster, 1000, 10, "float32", 0.0)


def test_a_matmul_result_is_computed_in_whole_128_x_128_tiles() -> None:
    assert tile_share(128, 128) == 1.0
    assert tile_share(4096, 1024) == 1.0
    # 130 rows take two tiles of 128: 130 / 256 of their work is useful
    assert tile_share(130, 128) == pytest.approx(130 / 256)
    assert tile_share(4, 16) == pytest.approx(64 / 128**2)
    assert tile_share(200, 300) == pytest.approx(200 * 300 / (256 * 384))

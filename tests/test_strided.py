"""Strided splits of fused projections (strategies/strided.py): the placement, the rules that
find and keep it, and the price of a fused qkv against three separate projections."""

from __future__ import annotations

import pytest
import torch

import autoplan
from autoplan import PlanOptions
from autoplan.execute.placements import deinterleave, interleave
from autoplan.graph.capture import capture
from autoplan.graph.ir import Graph, Ref
from autoplan.strategies import strided
from autoplan.strategies.placement import (
    Collective,
    is_valid,
    movable,
    pieces,
    redistribute,
    shard_dim,
    widths,
)
from autoplan.strategies.placement import strided as strided_split
from autoplan.strategies.space import plain_rules, strategy_space
from autoplan.workload import load_workload
from tests.conftest import ROOT, example


def _graph(w: autoplan.Workload) -> Graph:
    return capture(w.model, w.example_inputs, w.loss_fn, w.example_target)


def test_strided_placement_by_hand() -> None:
    assert shard_dim("S(1)x3") == 1 and pieces("S(1)x3") == 3 and pieces("S(1)") == 1
    assert shard_dim("S(1)x1") is None  # one piece is a plain split: written "S(1)"
    # three pieces of 8 rows: each splits in 4 or 8, not in 6 (though 24 rows do)
    assert is_valid(("S(0)x3",), (24, 4), (4,))
    assert is_valid(("S(0)x3",), (24, 4), (8,))
    assert not is_valid(("S(0)x3",), (24, 4), (6,))
    # no other mesh axis splits a strided dim
    assert not is_valid(("S(0)", "S(0)x3"), (48, 4), (2, 2))
    assert is_valid(("S(1)", "S(0)x3"), (48, 4), (2, 2))


def test_strided_redistribution_by_hand() -> None:
    shape, mesh = (12, 16), (4,)
    full = 12 * 16 * 4
    assert redistribute(("R",), ("S(0)x3",), shape, 4, mesh) == ()  # a local slice
    assert redistribute(("S(0)x3",), ("R",), shape, 4, mesh) == (
        Collective("all_gather", (0,), full),
    )
    # strided and plain splits of one dim hold different rows: DTensor (measured with
    # CommDebugMode) gathers the whole tensor, and reduces partial sums whole, then slices
    for src, dst in (("S(0)x3", "S(0)"), ("S(0)", "S(0)x3")):
        assert redistribute((src,), (dst,), shape, 4, mesh) == (
            Collective("all_gather", (0,), full),
        )
    assert redistribute(("P",), ("S(0)x3",), shape, 4, mesh) == (
        Collective("all_reduce", (0,), full),
    )


def test_fused_qkv_splits_strided_into_plain_heads() -> None:
    graph = _graph(example("gpt", qkv="fused", num_layers=1))
    marks = strided.marks(graph, plain_rules)
    # the split's input, and back along the linear's column split to its weight's rows; not
    # to the linear's input (whole in that rule)
    assert marks == {
        Ref("p_model_blocks_0_attn_qkv_weight"): {(0, (1, 1, 1))},
        Ref("linear"): {(2, (1, 1, 1))},
    }
    space = strategy_space(graph, (4,))
    stored = {s.output for s in space["p_model_blocks_0_attn_qkv_weight"].strategies}
    assert ("S(0)x3",) in stored
    linear = {(s.output, s.inputs) for s in space["linear"].strategies}
    assert (("S(2)x3",), (("R",), ("S(0)x3",))) in linear
    split = {(s.output, s.inputs) for s in space["split"].strategies}
    assert (("S(2)",), (("S(2)x3",),)) in split
    # the separate projections' graph has no split, so nothing strided
    assert strided.marks(_graph(example("gpt", num_layers=1)), plain_rules) == {}


def test_gpt2_conv1d_projection_is_marked_through_addmm_and_view() -> None:
    """transformers' GPT-2: ``addmm(bias, x, W)`` of a (D, 3D) weight, viewed to (b, t, 3D),
    then split: DTensor's addmm rule and our view rule carry the mark to W's columns."""
    w = load_workload(ROOT / "tests/models/zoo.py", model="gpt2", batch_size=4, seq_len=16)
    marks = strided.marks(_graph(w), plain_rules)
    assert marks[Ref("p_model_transformer_h_0_attn_c_attn_weight")] == {(1, (1, 1, 1))}
    assert marks[Ref("p_model_transformer_h_0_attn_c_attn_bias")] == {(0, (1, 1, 1))}


class _FusedSwiGLU(torch.nn.Module):
    """A SwiGLU's gate and up in one linear, then ``chunk``; a GQA-like projection cut into
    pieces of unequal widths, by ``split_with_sizes`` and by slices (Phi-3's); and the halves
    of an activation sliced as rotary embeddings rotate them (no projection behind them)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(8, 32, bias=False)
        self.down = torch.nn.Linear(16, 8, bias=False)
        self.qkv = torch.nn.Linear(8, 24, bias=False)
        self.sliced = torch.nn.Linear(8, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        q, k, v = self.qkv(x).split_with_sizes([16, 4, 4], dim=-1)
        fused = self.sliced(x)
        q2, k2, v2 = fused[..., :16], fused[..., 16:20], fused[..., 20:]
        h = torch.nn.functional.silu(x)
        rotated = torch.cat([-h[..., 4:], h[..., :4]], dim=-1)
        mixed = (k * v).sum() + (k2 * v2).sum()
        return self.down(torch.nn.functional.silu(gate) * up) + (q + q2)[..., :8] * mixed + rotated


def test_fused_projections_are_marked_and_slices_of_no_projection_are_not() -> None:
    graph = capture(_FusedSwiGLU(), (torch.randn(4, 6, 8),))
    marks = strided.marks(graph, plain_rules)
    # each projection's weight rows and its output; not the silu's halves
    unequal = {(0, (4, 1, 1))}
    assert marks == {
        Ref("p_model_gate_up_weight"): {(0, (1, 1))},
        Ref("p_model_qkv_weight"): unequal,
        Ref("p_model_sliced_weight"): unequal,
        Ref("linear"): {(2, (1, 1))},
        Ref("linear_1"): {(2, (4, 1, 1))},
        Ref("linear_2"): {(2, (4, 1, 1))},
    }
    space = strategy_space(graph, (2,))
    chunk = space["chunk"].strategies
    assert (("S(2)",), (("S(2)x2",),)) in {(s.output, s.inputs) for s in chunk}
    for piece in ("split_with_sizes", "slice_1", "slice_2", "slice_3"):
        found = {(s.output, s.inputs) for s in space[piece].strategies}
        assert (("S(2)",), (("S(2)x4:1:1",),)) in found, piece
    assert ("S(0)x4:1:1",) in {s.output for s in space["p_model_qkv_weight"].strategies}


def test_unequal_pieces_by_hand() -> None:
    assert strided_split(0, (64, 16, 16)) == "S(0)x4:1:1"
    assert strided_split(0, (8, 8)) == "S(0)x2"
    assert widths("S(0)x4:1:1") == (4, 1, 1) and pieces("S(0)x4:1:1") == 3
    assert widths("S(0)x3") == (1, 1, 1) and widths("S(0)") == (1,)
    # pieces of 64, 16 and 16 rows: each splits in 16, none in 32 (nor in 6, though 96 does)
    assert is_valid(("S(0)x4:1:1",), (96, 8), (16,))
    assert not is_valid(("S(0)x4:1:1",), (96, 8), (32,))
    assert not is_valid(("S(0)x4:1:1",), (96, 8), (6,))
    # no move to or from one (DTensor has no such placement), any other axis may move
    assert not movable(("S(0)x4:1:1",), ("R",)) and not movable(("P",), ("S(0)x4:1:1",))
    assert movable(("S(0)x4:1:1", "S(1)"), ("S(0)x4:1:1", "R"))
    assert movable(("S(0)x3",), ("R",))


def test_interleaving_holds_each_ranks_share_of_every_piece() -> None:
    """The executor's layout of unequal pieces (execute/placements.py): a plain split of the
    interleaved tensor is each rank's share of each piece, and the model's order comes back."""
    rows = torch.arange(24.0)  # q: 0-15, k: 16-19, v: 20-23
    held = interleave(rows, 0, (4, 1, 1), 4)
    assert held.chunk(4)[1].tolist() == [4, 5, 6, 7, 17, 21]
    assert torch.equal(deinterleave(held, 0, (4, 1, 1), 4), rows)


@pytest.mark.parametrize("kv_heads", [None, 8])
def test_fused_and_separate_qkv_priced_alike_at_tp8(
    a100: autoplan.Cluster, kv_heads: int | None
) -> None:
    """4 blocks of d 4096, 32 heads, batch 1, 2048 tokens, bf16 on one 8-GPU node, mesh (8,):
    split strided, the fused projection's plan costs what the separate projections' does
    (split plainly, q, k and v had to be redistributed); with 8 key-value heads too, its
    q|k|v pieces of unequal widths (4096, 1024, 1024)."""
    times = {}
    for qkv in ("separate", "fused"):
        w = example(
            "gpt", size="7b", num_layers=4, batch_size=1, seq_len=2048, device="meta",
            dtype="bfloat16", qkv=qkv, num_kv_heads=kv_heads,
        )  # fmt: skip
        plan = w.plan(a100, options=PlanOptions(mesh_shape=(8,)))
        times[qkv] = plan.predicted.step_time_s
        if qkv == "fused":
            stored = "S(0)x3" if kv_heads is None else "S(0)x4:1:1"
            assert plan.params["blocks.0.attn.qkv.weight"].storage == {"tp": stored}
    assert abs(times["fused"] / times["separate"] - 1) < 0.01, times


def test_strided_shard_is_each_ranks_share_of_every_piece() -> None:
    """The executor's placement: DTensor's _StridedShard, rank r's rows of each piece."""
    from autoplan.execute.placements import from_dtensor, to_dtensor
    from autoplan.torch_private import StridedShard

    (placement,) = to_dtensor({"tp": "S(0)x3"}, ["tp"])
    assert placement == StridedShard(0, split_factor=3)
    assert from_dtensor([placement]) == ("S(0)x3",)
    whole = torch.arange(12)
    shards = [placement._split_tensor(whole, 2, with_padding=False)[0][r] for r in range(2)]
    assert [s.tolist() for s in shards] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]


def test_strided_redistributions_are_what_dtensor_issues() -> None:
    """Each move to or from a strided split is priced as the collectives DTensor issues for
    it (counted by CommDebugMode on 4 simulated ranks), and keeps the values."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoplan.execute.placements import to_dtensor

    names = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather"}
    names |= {"reduce_scatter_tensor": "reduce_scatter"}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with LocalTensorMode(4):  # each simulated rank's own copy of what is made in it
            whole = torch.arange(24.0).reshape(24, 1)
            mesh = init_device_mesh("cpu", (4,))
            for src, dst in [("P", "S(0)x3"), ("S(0)x3", "S(0)"), ("S(0)", "S(0)x3"),
                             ("S(0)x3", "R"), ("R", "S(0)x3")]:  # fmt: skip
                a, b = to_dtensor({"x": src}, ["x"]), to_dtensor({"x": dst}, ["x"])
                if src == "P":
                    placed = DTensor.from_local(whole / 4, mesh, a, run_check=False)
                else:
                    placed = distribute_tensor(whole, mesh, a)
                with CommDebugMode() as comms:
                    moved = placed.redistribute(mesh, b)
                issued = sorted(names[str(op).rpartition(".")[2]] for op in comms.get_comm_counts())
                priced = sorted(c.kind for c in redistribute((src,), (dst,), (24, 1), 4, (4,)))
                assert issued == priced, (src, dst)
                assert torch.equal(moved.full_tensor(), whole), (src, dst)
    finally:
        dist.destroy_process_group()


def test_unequal_pieces_are_saved_in_the_models_order_and_loaded_back() -> None:
    """A fused q|k|v of unequal pieces, held interleaved on a (2, 2) mesh (dp outside, its
    pieces' shares on tp), and its optimizer state alike: a checkpoint gets the model's
    order split plainly (what any other plan loads), and a load puts it back interleaved."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoplan.execute.checkpoint import _restrided, _unstrided

    layouts = {"qkv.weight": ((1, 0, (4, 1, 1)),)}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with LocalTensorMode(4):
            mesh = init_device_mesh("cpu", (2, 2))
            whole = torch.arange(48.0).reshape(24, 2)
            held = distribute_tensor(
                interleave(whole, 0, (4, 1, 1), 2), mesh, [Replicate(), Shard(0)]
            )
            state = {"qkv.weight": held, "state.qkv.weight.exp_avg": held * 2}
            saved = _unstrided(state, layouts)
            for key, scale in (("qkv.weight", 1), ("state.qkv.weight.exp_avg", 2)):
                assert isinstance(saved[key], DTensor)
                assert saved[key].placements == (Replicate(), Shard(0))
                assert torch.equal(saved[key].full_tensor(), whole * scale)
            back = _restrided(saved, state, layouts)
            assert all(torch.equal(back[k].to_local(), state[k].to_local()) for k in state)
    finally:
        dist.destroy_process_group()

"""Tracing into the graph IR, layer detection, and trace errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autoplan
from autoplan import PlanOptions
from autoplan.costmodel.pricer import Pricer
from autoplan.errors import TraceError
from autoplan.graph.blocks import block_of, find_sharing
from autoplan.graph.capture import capture, export_step
from autoplan.modes import NodeKind
from autoplan.strategies.space import Strategy
from autoplan.workload import load_workload
from tests.conftest import ROOT, example


def test_mlp_graph_has_shapes_flops_paths_and_params() -> None:
    w = example("mlp", batch_size=8, hidden=16, num_layers=3)
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    linears = [n for n in graph if n.op == "aten.linear.default"]
    assert [n.module_path for n in linears] == ["layers.0", "layers.1", "layers.2"]
    first, second = linears[0], linears[1]
    assert first.output.shape == (8, 16) and first.output.dtype == "float32"
    assert first.flops == 2 * 8 * 16 * 16
    # layer 0's input is data: backward computes only the weight gradient; later layers both
    assert first.bwd_flops == first.flops and second.bwd_flops == 2 * second.flops
    assert first.params == ("layers.0.weight", "layers.0.bias")
    assert first.params == ("layers.0.weight", "layers.0.bias")
    weight = graph.node(first.refs[1].name)
    assert (
        weight.kind == NodeKind.PARAM and weight.target == "layers.0.weight" and weight.needs_grad
    )
    assert [n.kind for n in graph if n.kind == NodeKind.INPUT] == [
        NodeKind.INPUT,
        NodeKind.INPUT,
    ]  # input and target
    assert graph.nodes[-1].kind == NodeKind.OUTPUT and graph.num_params == 3 * (16 * 16 + 16)
    assert all(n.is_view is False for n in linears)


def test_meta_model_is_traced_without_memory() -> None:
    w = example("gpt", size="1.3b", batch_size=1, device="meta")
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    assert 1.2e9 < graph.num_params < 1.5e9
    assert all(p.is_meta for p in w.model.parameters())
    layers = find_sharing(graph)
    assert len(layers.blocks) == 24
    # blocks 2..23 take the decisions of blocks 0 and 1
    reps = {block_of(graph.node(rep)) for rep in layers.canonical.values()}
    assert reps == {"blocks.0", "blocks.1"}
    assert len(layers.canonical) == 22 * len(layers.blocks["blocks.0"])


def test_transcendental_elements_of_gpt() -> None:
    w = example("gpt", size="tiny", batch_size=2)  # dim 64, 4 heads, vocabulary 128, seq 16
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    counted = {n.op: n.transcendental for n in graph if n.transcendental}
    assert counted == {
        "aten.gelu.default": 2 * 16 * 4 * 64,  # the MLP's hidden activations
        "aten.scaled_dot_product_attention.default": 2 * 4 * 16 * 16,  # the scores
        "aten.cross_entropy_loss.default": 2 * 16 * 128,  # the logits
    }
    assert all(n.transcendental == 0 for n in graph if n.op == "aten.linear.default")


def test_same_model_same_fingerprint_other_shape_other_fingerprint() -> None:
    a = example("mlp", batch_size=8, hidden=16)
    b = example("mlp", batch_size=8, hidden=16)
    c = example("mlp", batch_size=16, hidden=16)
    fp = [
        capture(w.model, w.example_inputs, w.loss_fn, w.example_target).fingerprint
        for w in (a, b, c)
    ]
    assert fp[0] == fp[1] != fp[2]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow cannot be traced
            return self.fc(x)
        return x


def test_untraceable_model_names_the_user_line(cpu4: autoplan.Cluster) -> None:
    with pytest.raises(TraceError) as info:
        autoplan.plan(Branchy(), torch.randn(2, 4), cpu4)
    message = str(info.value)
    assert "Branchy" in message
    assert "test_capture.py" in message and "if x.sum() > 0" in message
    assert "torch.where" in message  # says what to do


class Widening(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(x.shape[-1] + 1)  # one too wide: no broadcast


def test_a_failing_op_is_named_with_its_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Widening())
    with pytest.raises(TraceError) as info:
        capture(model, torch.randn(2, 4))
    assert "no broadcast`) in 1 (aten.add.Tensor): RuntimeError" in str(info.value)


PACKAGED = """import torch
from torch import nn


def padding_mask(ids):
    mask = ids.eq(0)
    if not mask.any():  # as FSMT's make_padding_mask
        mask = None
    return mask


class Packaged(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)

    def forward(self, ids):
        mask = padding_mask(ids)
        return self.embed(ids).sum() if mask is None else self.embed(ids * mask).sum()
"""


def test_a_packaged_model_is_refused_at_its_own_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model from an installed package (transformers') has no line in the user's files: the
    refusal names the innermost line of the model's own folder, not torch's generated code."""
    source = tmp_path / "site-packages" / "vendor" / "modeling.py"
    source.parent.mkdir(parents=True)
    source.write_text(PACKAGED)
    spec = importlib.util.spec_from_file_location("vendor_modeling", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "vendor_modeling", module)
    spec.loader.exec_module(module)
    with pytest.raises(TraceError) as info:
        capture(module.Packaged(), (torch.randint(1, 8, (2, 3)),))
    assert f"could not trace Packaged at {source}:7 (`if not mask.any():" in str(info.value)
    # the op: the mask's value read by Python's `if`
    assert "in the model (aten._local_scalar_dense" in str(info.value)


class Counting(nn.Module):
    """Tokens per expert by bincount: used beside the expert scores (their length fixed at
    minlength) or alone (a length the data sets)."""

    def __init__(self, beside: bool) -> None:
        super().__init__()
        self.router, self.beside = nn.Linear(8, 4), beside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x)
        counts = torch.bincount(scores.topk(2).indices.flatten(), minlength=4).float()
        return (scores * counts).sum() if self.beside else scores.sum() + counts.sum()


def test_bincount_is_traced_where_its_length_is_fixed_else_refused_at_its_line() -> None:
    graph = capture(Counting(beside=True), torch.randn(6, 8))
    (counts,) = (n for n in graph if n.op == "aten.bincount.default")
    assert counts.outputs[0].shape == (4,)
    with pytest.raises(TraceError) as info:
        capture(Counting(beside=False), torch.randn(6, 8))
    message = str(info.value)
    assert "test_capture.py" in message and "counts = torch.bincount(" in message
    assert "aten.bincount.default gives u0" in message and "scatter_add" in message


def test_loss_without_target_is_a_clear_error(cpu4: autoplan.Cluster) -> None:
    w = example("mlp")
    with pytest.raises(TraceError, match="example_target"):
        autoplan.plan(w.model, w.example_inputs, cpu4, loss_fn=w.loss_fn)


class Renorm(nn.Module):
    """A model with an op that DTensor has no rule for in any torch autoplan supports."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.renorm(self.fc(x), p=2, dim=1, maxnorm=1.0)


def test_ops_without_rule_are_replicated_with_one_warning(
    cpu4: autoplan.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        plan = autoplan.plan(
            Renorm(), torch.randn(16, 8), cpu4, options=PlanOptions(mesh_shape=(4,))
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "aten.renorm.default" in warnings[0]
    renorm = next(n for n in plan.nodes.values() if n.op == "aten.renorm.default")
    assert renorm.rule == "replicated" and set(renorm.output.values()) == {"R"}
    assert [n.kind for n in capture(Renorm(), torch.randn(16, 8))][-2:] == [
        NodeKind.OP,
        NodeKind.OUTPUT,
    ]


def test_export_checks_are_not_ops_and_constants_are_inputs() -> None:
    from tests.models.casts import workload

    w = workload()
    ep = export_step(w.model, w.example_inputs, w.loss_fn, w.example_target)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "aten.to.dtype" in targets  # the casts stay: they change the values' dtype
    assert not [t for t in targets if "_assert" in t]  # their metadata checks do not
    # nor does the Python assert on values, nor the ops only it read
    assert targets[0] == "aten.linear.default" and "aten.item.default" not in targets
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    assert not [n for n in graph if n.kind == NodeKind.OP and "_assert" in n.op]
    constants = [n for n in graph if n.kind == NodeKind.PARAM and "lifted_tensor" in n.target]
    assert len(constants) == 1 and not constants[0].needs_grad  # torch.tensor(0.01)


def test_a_tied_parameter_is_one_parameter() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight  # a language model's tied head

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids)).sum()

    ids = torch.randint(0, 16, (2, 4))
    ep = export_step(Tied(), (ids,))
    assert list(ep.graph_signature.inputs_to_parameters.values()) == ["model.embed.weight"]
    graph = capture(Tied(), (ids,))
    params = [n for n in graph if n.kind == NodeKind.PARAM]
    # one node under the name named_parameters() gives, read by the embedding and the head
    assert [n.target for n in params] == ["embed.weight"]
    readers = [n.op for n in graph if any(r.name == params[0].name for r in n.refs)]
    assert readers == ["aten.embedding.default", "aten.linear.default"]


def test_writes_through_views_are_made_functional() -> None:
    class Shift(nn.Module):  # as BART makes its decoder's inputs from the labels
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 4)

        def forward(self, labels: torch.Tensor) -> torch.Tensor:
            shifted = labels.new_zeros(labels.shape)
            shifted[:, 1:] = labels[:, :-1].clone()
            shifted[:, 0] = 2
            return self.embed(shifted).sum()

    labels = torch.randint(0, 16, (2, 5))
    model = Shift()
    ep = export_step(model, (labels,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not {"aten.copy_.default", "aten.fill_.Tensor"} & targets
    assert "aten.slice_scatter.default" in targets
    assert torch.equal(ep.module()(labels), model(labels))  # computes what the model does
    # the examples' graphs, which write nothing in place, stay as export gave them
    w = example("mlp", batch_size=4, hidden=8)
    plain = export_step(w.model, w.example_inputs, w.loss_fn, w.example_target)
    assert "aten.linear.default" in {str(n.target) for n in plain.graph.nodes}


def test_no_grad_and_autocast_off_regions_are_inlined_with_their_gradients() -> None:
    from tests.models.regions import workload

    w = workload(batch_size=4, hidden=8)
    ep = export_step(w.model, w.example_inputs, w.loss_fn, w.example_target)
    assert all(n.op != "get_attr" for n in ep.graph.nodes)  # no wrapped submodules left
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    means = [n for n in graph if n.op == "aten.mean.dim"]
    assert len(means) == 1 and not means[0].needs_grad  # the no_grad statistic
    # the inlined graph computes the model's loss and gradients
    import copy

    model = copy.deepcopy(w.model)
    ep.module()(*w.example_inputs, w.example_target).backward()
    w.loss(model).backward()
    for (name, p), q in zip(w.model.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_blocks_that_make_tensors_in_forward_still_share_decisions(precision: str | None) -> None:
    # Hugging Face's Llama makes a tensor in each attention's forward; export numbers them
    # across the model, which must not make the blocks look different. Under mixed precision
    # the step is traced in one autocast region, whose ops must keep their own module paths
    w = load_workload(ROOT / "examples" / "hf_llama.py", size="small", batch_size=2, seq_len=8)
    graph = capture(w.model, w.example_inputs, precision=precision)
    sharing = find_sharing(graph)
    copies = list(sharing.canonical)  # nodes that take another node's decision
    in_blocks = [n.name for n in graph if (block_of(n) or "").endswith(("layers.2", "layers.3"))]
    assert in_blocks and sorted(copies) == sorted(in_blocks)  # every node of the copies
    linears = [n for n in graph if n.kind == NodeKind.OP and "linear" in n.op]
    assert all(block_of(n) for n in linears[:-1])  # all but the head lie in a layer


class Lookup(nn.Module):
    """Token ids read by an embedding, an index_select or one_hot: export lets floats through
    some of them (torch 2.11 the embedding, 2.13 one_hot, both index_select)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.how == "embedding":
            return self.emb(ids).sum()
        if self.how == "index_select":
            return self.emb.weight.index_select(0, ids).sum()
        return nn.functional.one_hot(ids, 10).float().sum() * self.emb.weight.sum()


@pytest.mark.parametrize("how", ["embedding", "index_select", "one_hot"])
def test_float_indices_are_refused_at_the_user_line_under_any_torch(how: str) -> None:
    ids = torch.tensor([1, 2, 3])
    assert capture(Lookup(how), (ids,)).num_params == 40  # integer ids trace
    with pytest.raises(TraceError) as info:
        capture(Lookup(how), (ids.float(),))
    message = str(info.value)
    assert (
        "test_capture.py" in message and "example inputs (then the target): float32[3]" in message
    )
    # export refuses some itself (which depends on the torch release), autoplan the others by
    # name: index_select's under every release
    assert "Long" in message, message
    if how == "index_select":
        assert "aten.index_select.default takes integer index (Long, Int), got float32" in message


def test_factories_of_a_trained_tensor_carry_no_gradient() -> None:
    """``h.new_empty(...)`` and ``torch.zeros_like(h)`` read ``h`` for its dtype and shape:
    no gradient flows to them, so the planner prices none to reduce (DeepSeek-V3's attention
    joins its query parts in such a tensor)."""

    class Joined(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            joined = h.new_empty(8, 6)
            joined[:, :4] = h
            joined[:, 4:] = 0.0
            return joined.sum() + torch.zeros_like(h).sum()

    graph = capture(Joined(), torch.randn(8, 4))
    needs = {n.op: n.needs_grad for n in graph if n.kind == NodeKind.OP}
    assert needs["aten.linear.default"] and needs["aten.slice_scatter.default"]
    assert not needs["aten.new_empty.default"] and not needs["aten.zeros_like.default"]


def test_a_cast_is_a_copy_and_a_residual_add_moves_nothing_in_backward(
    a100: autoplan.Cluster,
) -> None:
    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x.to(torch.bfloat16).float())
            return h + self.lin(h)

    graph = capture(Cast(), (torch.randn(4, 16),), nn.functional.mse_loss, torch.randn(4, 16))
    casts = [n for n in graph if n.op == "aten.to.dtype"]
    # aten.to's schema says it may return its input (a view, for memory); to a new dtype it
    # copies all the same, and its bytes are priced
    assert [n.bytes_moved for n in casts] == [4 * 16 * (4 + 2)] * 2
    (add,) = [n for n in graph if n.op == "aten.add.Tensor"]
    assert add.needs_grad and (add.flops, add.bwd_flops) == (64.0, 0.0)
    pricer = Pricer(a100, (1,), "adamw")
    bandwidth = a100.device.memory_bandwidth * a100.device.memory_efficiency
    whole = Strategy(("R",), ("R", "R"))
    # forward: two inputs read, one output written, 4 bytes each; backward: nothing
    assert pricer.node_time(add, whole) == pytest.approx(3 * 64 * 4 / bandwidth)
    # a cast's bytes (of the input, which needs no gradient: no backward), not a view's 0
    cast = Strategy(("R",), ("R",))
    assert not casts[0].needs_grad
    assert pricer.node_time(casts[0], cast) == pytest.approx(384 / bandwidth)
    assert pricer.forward_time(casts[0], cast) == pytest.approx(384 / bandwidth)


def test_a_small_matmul_on_a_gpu_pays_for_whole_tiles(a100: autoplan.Cluster) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(200, 300)
            self.second = nn.Linear(300, 300)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x))

    graph = capture(Two(), (torch.randn(130, 200),), nn.functional.mse_loss, torch.randn(130, 300))
    first, second = [n for n in graph if n.op == "aten.linear.default"]
    pricer = Pricer(a100, (2,), "adamw")
    whole = Strategy(("R",), ("R", "R", "R"))
    # forward: the 130 x 300 result in 2 x 3 tiles of 128 x 128 (output rows x columns)
    assert pricer.tile_share(first, whole, backward=False) == pytest.approx(130 * 300 / (256 * 384))
    # backward of the first: the weight's gradient alone (the input needs none), 300 x 200
    fwd, weight = 130 * 300 / (256 * 384), 300 * 200 / (384 * 256)
    assert pricer.tile_share(first, whole) == pytest.approx(2 / (1 / fwd + 1 / weight))
    # the second also makes its input's gradient, 130 x 300; split in two along the batch
    # (65 rows) and the inner dim (150): a shard's own results
    split = Strategy(("S(0)",), ("S(0)", "R", "R"))
    fwd, inp, weight = 65 * 300 / (128 * 384), 65 * 300 / (128 * 384), 300 * 300 / 384**2
    expected = 3 / (1 / fwd + 1 / inp + 1 / weight)
    assert pricer.tile_share(second, split) == pytest.approx(expected)
    partial = Strategy(("P",), ("S(1)", "S(1)", "R"))
    fwd, inp, weight = 130 * 300 / (256 * 384), 130 * 150 / (256 * 256), 150 * 300 / (256 * 384)
    assert pricer.tile_share(second, partial) == pytest.approx(3 / (1 / fwd + 1 / inp + 1 / weight))
    # the compute term pays for it; CPU ranks compute no tiles
    flops = (second.flops + second.bwd_flops) / 2
    peak = a100.device.peak_flops["float32"] * a100.device.compute_efficiency
    assert pricer.node_time(second, split) == pytest.approx(flops / (peak * expected))
    cpu = Pricer(dataclasses.replace(a100, backend="gloo"), (2,), "adamw")
    assert cpu.tile_share(second, split) == 1.0


def test_complex_tensors_carry_gradients_and_eight_bytes_an_element() -> None:
    """torchtitan's rotary embeddings rotate queries as complex numbers: the complex tensors
    between ``view_as_complex`` and ``view_as_real`` have gradients (the planner prices their
    backward collectives) and 8 bytes an element (complex64)."""

    class Rotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("turn", torch.polar(torch.ones(2), torch.tensor([0.3, 0.7])))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pairs = torch.view_as_complex(self.fc(x).view(8, 2, 2))
            return torch.view_as_real(pairs * self.turn).sum()

    graph = capture(Rotated(), torch.randn(8, 4))
    ops = {n.op: n for n in graph if n.kind == NodeKind.OP}
    rotated = ops["aten.mul.Tensor"]
    assert rotated.output.dtype == "complex64" and rotated.output.nbytes == 8 * 2 * 8
    assert rotated.needs_grad and ops["aten.view_as_real.default"].needs_grad

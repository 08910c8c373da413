"""How the executor's interpreter walks a graph: the arguments it fills in for each op and
the values it frees (execute/interpreter.py), on small exported graphs."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autoplan.execute.checkpointed import RecomputedRegion, gathers_ahead
from autoplan.execute.interpreter import Arguments, last_uses


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).relu()
        both = torch.cat([h, x], dim=1)  # x read again, late, inside a list
        return both.view(8, 2, 6).sum()


def _graph() -> torch.fx.Graph:
    return torch.export.export(_Residual(), (torch.randn(8, 6),)).graph


def _readers(graph: torch.fx.Graph) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        for read in node.all_input_nodes:
            found.setdefault(read.name, []).append(node.name)
    return found


def test_every_value_is_freed_once_by_its_last_reader() -> None:
    graph = _graph()
    freed = last_uses(list(graph.nodes))
    by_value = {value: node for node, values in freed.items() for value in values}
    assert sum(len(v) for v in freed.values()) == len(by_value)  # none freed twice
    readers = _readers(graph)
    assert by_value == {value: names[-1] for value, names in readers.items()}
    (x,) = [n.name for n in graph.nodes if n.op == "placeholder" and n.name.startswith("x")]
    cat = next(n.name for n in graph.nodes if n.target is torch.ops.aten.cat.default)
    assert by_value[x] == cat


def test_values_kept_for_later_are_never_freed() -> None:
    graph = _graph()
    relu = next(n.name for n in graph.nodes if n.target is torch.ops.aten.relu.default)
    freed = last_uses(list(graph.nodes), keep=[relu])
    assert relu not in {value for values in freed.values() for value in values}


def test_arguments_are_filled_with_the_tensors_in_order() -> None:
    nodes = {str(n.target): n for n in _graph().nodes if n.op == "call_function"}
    linear = nodes["aten.linear.default"]
    args, kwargs = Arguments.of(linear, torch.device("cpu")).fill(["x", "w", "b"])
    assert args == ("x", "w", "b") and kwargs == {}

    cat = nodes["aten.cat.default"]  # its tensors sit inside a list
    args, _ = Arguments.of(cat, torch.device("cpu")).fill(["h", "x"])
    assert args == (["h", "x"], 1)

    view = nodes["aten.view.default"]  # a local view gets its local size
    args, _ = Arguments.of(view, torch.device("cpu"), shape=[2, 2, 6]).fill(["both"])
    assert args == ("both", [2, 2, 6])
    assert view.args[1] == [8, 2, 6]  # the graph is left as it was


def test_factory_calls_traced_on_meta_run_on_the_device() -> None:
    class _Positions(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[1], device=x.device)

    graph = torch.export.export(_Positions(), (torch.randn(2, 3, device="meta"),)).graph
    (arange,) = [n for n in graph.nodes if n.target is torch.ops.aten.arange.default]
    args, kwargs = Arguments.of(arange, torch.device("cpu")).fill([])
    assert kwargs["device"] == torch.device("cpu") and args == tuple(arange.args)


def test_moves_traced_on_meta_run_on_the_device() -> None:
    """Llama's rotary embedding moves its buffer to the input's device (``aten.to.device``,
    the device positional): traced on meta, it runs on the mesh's device (the fake-tensor
    check of Llama 3 8B found it, `autoplan.execute.dry_run`)."""

    class _Moved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale.to(x.device, torch.float32)

    with torch.device("meta"):
        module = _Moved()
    graph = torch.export.export(module, (torch.randn(2, 3, device="meta"),)).graph
    (move,) = [n for n in graph.nodes if n.target is torch.ops.aten.to.device]
    assert torch.device("meta") in move.args
    args, _ = Arguments.of(move, torch.device("cpu")).fill(["scale"])
    assert args[1:] == (torch.device("cpu"), torch.float32)


def test_zero3_gathers_issue_at_forward_start_or_at_their_region() -> None:
    """A parameter stored split and read whole is gathered once, ahead: at forward's start
    (-1), or, first read inside a recomputed region, at the region's index (`steps`)."""
    ep = torch.export.export(_Residual(), (torch.randn(8, 6),))
    nodes = list(ep.graph.nodes)
    (weight, bias) = ep.graph_signature.inputs_to_parameters
    linear = next(n for n in nodes if n.target is torch.ops.aten.linear.default)
    reads = {linear.name: [r.name for r in linear.all_input_nodes]}
    whole, split = (Replicate(),), (Shard(0),)
    inputs = {linear.name: [whole, whole, whole]}
    stored = {weight: split, bias: whole}  # the bias is read as stored: nothing to gather
    params = {weight, bias}
    assert gathers_ahead(nodes, params, reads, inputs, stored) == {-1: [(weight, whole)]}
    at = nodes.index(linear)
    region = RecomputedRegion((linear,), tuple(reads[linear.name]))
    steps = [*nodes[:at], region, *nodes[at + 1 :]]
    assert gathers_ahead(steps, params, reads, inputs, stored) == {at: [(weight, whole)]}

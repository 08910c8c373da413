"""An exported step as the graph IR: one frozen `Node` per ATen op, parameter and input,
with shapes, FLOPs, bytes and module paths, and the graph's fingerprint."""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.multiprocessing.reductions import StorageWeakRef

from autoplan.errors import TraceError
from autoplan.graph.flops import op_flops, transcendental
from autoplan.graph.ir import Graph, Node, Ref, TensorInfo, Write
from autoplan.graph.saved import with_saved
from autoplan.modes import NodeKind

# ops no gradient flows through: detach, and factories that read their input for its dtype
# and shape alone (``x.new_empty(...)``, ``torch.zeros_like(x)``), whose output needs none
_GRAD_STOPS = {
    "aten.detach.default",
    *(f"aten.new_{kind}.default" for kind in ("empty", "zeros", "ones", "full")),
    *(f"aten.{kind}_like.default" for kind in ("empty", "zeros", "ones", "full")),
    *(f"aten.{kind}_like.default" for kind in ("rand", "randn", "randint")),
}
WRAPPED = "model."  # prefix of parameter and module paths inside TrainStep


def graph_from_export(ep: ExportedProgram, precision: str | None = None) -> Graph:
    """The IR of an exported step, traced under mixed ``precision`` (or None)."""
    kinds: dict[str, tuple[str, str, bool]] = {}
    frozen: list[str] = []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        target = (spec.target or name).removeprefix(WRAPPED)
        if spec.kind == InputKind.PARAMETER:
            # a frozen parameter has no gradient: nothing to reduce, store or update
            trains = ep.state_dict[spec.target].requires_grad
            kinds[name] = (NodeKind.PARAM, target, trains)
            if not trains:
                frozen.append(target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kinds[name] = (NodeKind.PARAM, target, False)
        else:
            kinds[name] = (NodeKind.INPUT, name, False)

    done: dict[str, Node] = {}
    for fx_node in ep.graph.nodes:
        if fx_node.op == "call_function" and fx_node.target is operator.getitem:
            continue  # its users refer to the multi-output op directly (see _to_ir)
        if fx_node.op == "get_attr":
            continue  # a function's graph (FlexAttention's score_mod), no tensor: see _to_ir
        node = _convert(fx_node, kinds, done)
        done[node.name] = node
    nodes = tuple(done.values())
    writes = _writes(ep)
    graph = Graph(
        nodes=nodes,
        fingerprint=_fingerprint(nodes, frozen, writes),
        precision=precision,
        writes=writes,
    )
    return with_saved(graph, _aliases(ep, done))


def _writes(ep: ExportedProgram) -> tuple[Write, ...]:
    """The buffers forward updates, each with the value written (an output of the step)."""
    (output,) = [n for n in ep.graph.nodes if n.op == "output"]
    values = output.args[0]
    assert isinstance(values, tuple | list)
    specs = ep.graph_signature.output_specs
    return tuple(
        Write((spec.target or "").removeprefix(WRAPPED), _to_ir(value))
        for spec, value in zip(specs, values, strict=True)
        if spec.kind == OutputKind.BUFFER_MUTATION
    )


def _tensors(val: Any) -> tuple[torch.Tensor, ...]:
    """A node's traced value as its tensors, flat (as `Node.outputs` indexes them)."""
    if isinstance(val, torch.Tensor):
        return (val,)
    if isinstance(val, list | tuple):
        return tuple(t for v in val for t in _tensors(v))
    return ()


def _infos(val: Any) -> tuple[TensorInfo, ...]:
    return tuple(
        TensorInfo(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))
        for t in _tensors(val)
    )


def _to_ir(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        if value.op == "call_function" and value.target is operator.getitem:
            # getitem of a multi-output op refers to that op's output directly
            return Ref(value.args[0].name, int(value.args[1]))  # type: ignore[union-attr, arg-type]
        if value.op == "get_attr":  # FlexAttention's score_mod and mask_mod, by name
            return f"<{value.target}>"
        return Ref(value.name)
    if isinstance(value, list | tuple):
        return tuple(_to_ir(v) for v in value)
    if isinstance(value, dict):  # FlexAttention's kernel options
        return tuple(sorted((k, _to_ir(v)) for k, v in value.items()))
    return value


def module_path(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = path.removeprefix("L['self'].").removeprefix(WRAPPED)
    return "" if path in ("model", "L['self']") else path


def _convert(
    fx_node: torch.fx.Node, kinds: dict[str, tuple[str, str, bool]], done: dict[str, Node]
) -> Node:
    outputs = _infos(fx_node.meta.get("val"))
    if fx_node.op == "placeholder":
        kind, target, trainable = kinds[fx_node.name]
        return Node(
            name=fx_node.name,
            kind=kind,
            op=kind,
            args=(),
            kwargs=(),
            outputs=outputs,
            flops=0.0,
            bwd_flops=0.0,
            bytes_moved=0.0,
            module_path=target.rpartition(".")[0] if kind == NodeKind.PARAM else "",
            target=target,
            params=(),
            needs_grad=trainable and all(o.is_differentiable for o in outputs),
            is_view=False,
        )
    args = tuple(_to_ir(a) for a in fx_node.args)
    kwargs = tuple(sorted((k, _to_ir(v)) for k, v in fx_node.kwargs.items()))
    if fx_node.op == "output":
        return Node(
            fx_node.name,
            NodeKind.OUTPUT,
            NodeKind.OUTPUT,
            args,
            kwargs,
            (),
            0.0,
            0.0,
            0.0,
            "",
            "",
            (),
            False,
            True,
        )
    if fx_node.op != "call_function":
        raise TraceError(f"unexpected graph node {fx_node.format_node()}; please report this")

    refs = Node(
        fx_node.name, NodeKind.OP, "", args, kwargs, (), 0, 0, 0, "", "", (), False, False
    ).refs
    ins = [done[r.name].outputs[r.index] for r in refs]
    grads = [done[r.name].needs_grad for r in refs]
    op = str(fx_node.target)
    needs_grad = any(grads) and any(o.is_differentiable for o in outputs) and op not in _GRAD_STOPS
    schema = getattr(fx_node.target, "_schema", None)
    is_view = bool(schema and schema.returns and schema.returns[0].alias_info is not None)
    is_view = is_view or returns_input(fx_node)
    # `aten.to` may return its input (its schema says alias), but to a new dtype it copies:
    # its time is priced as a copy's (its memory stays a view's, as benchmarks/memory_truth.py
    # measured it)
    casts = op.startswith("aten.to.") and bool(ins and outputs) and ins[0].dtype != outputs[0].dtype
    computes = casts or not is_view
    flops, bwd = op_flops(op, ins, outputs, grads) if computes else (0.0, 0.0)
    moved = float(sum(i.nbytes for i in ins) + sum(o.nbytes for o in outputs)) if computes else 0.0
    return Node(
        name=fx_node.name,
        kind=NodeKind.OP,
        op=op,
        args=args,
        kwargs=kwargs,
        outputs=outputs,
        flops=flops,
        bwd_flops=bwd,
        bytes_moved=moved,
        module_path=module_path(fx_node),
        target="",
        params=tuple(
            dict.fromkeys(done[r.name].target for r in refs if done[r.name].kind == NodeKind.PARAM)
        ),
        needs_grad=needs_grad,
        is_view=is_view,
        transcendental=0.0 if is_view else transcendental(op, ins, outputs),
    )


_DROPOUTS = frozenset(
    {
        torch.ops.aten.dropout.default,
        torch.ops.aten.feature_dropout.default,
        torch.ops.aten.alpha_dropout.default,
        torch.ops.aten.feature_alpha_dropout.default,
    }
)


def returns_input(fx_node: torch.fx.Node) -> bool:
    """A dropout that drops nothing (``p`` 0, or not training), which ATen's ``dropout``
    returns as its input itself (aten/src/ATen/native/Dropout.cpp: ``if (p == 0 || !train
    || input.sym_numel() == 0) return input``): a view, no compute, no memory of its own
    (transformers' attention dropout at its default 0; the traced value, a copy, says
    otherwise)."""
    if fx_node.target not in _DROPOUTS or len(fx_node.args) < 3:
        return False
    _, p, train = fx_node.args[:3]
    return bool(p == 0 or train is False)


def _aliases(ep: ExportedProgram, done: dict[str, Node]) -> dict[Ref, Ref]:
    """Each op output that shares its storage with one of the op's inputs as traced (a view;
    not a ``reshape`` that copied an expanded tensor): output -> that input."""
    by_name = {n.name: n for n in ep.graph.nodes}

    def storages(name: str) -> list[StorageWeakRef]:
        return [StorageWeakRef(t.untyped_storage()) for t in _tensors(by_name[name].meta["val"])]

    found: dict[Ref, Ref] = {}
    for name, node in done.items():
        if node.kind != NodeKind.OP:
            continue
        if returns_input(by_name[name]):  # as run, though export's value is a copy
            found[Ref(name, 0)] = node.refs[0]
            continue
        ins: dict[StorageWeakRef, Ref] = {}
        for ref in node.refs:
            ins.setdefault(storages(ref.name)[ref.index], ref)
        for j, storage in enumerate(storages(name)):
            if storage in ins:
                found[Ref(name, j)] = ins[storage]
    return found


def _fingerprint(nodes: Sequence[Node], frozen: Sequence[str], writes: Sequence[Write]) -> str:
    """A hash of the graph, of which parameters are frozen, if any (a plan for other
    trainable parameters reduces other gradients), and of the buffers it writes, if any."""
    doc: list[Any] = [
        [n.name, n.kind, n.op, repr(n.args), repr(n.kwargs), repr(n.outputs), n.target]
        for n in nodes
    ]
    if frozen:
        doc.append(["frozen", sorted(frozen)])
    if writes:
        doc.append(["writes", [w.buffer for w in writes]])
    text = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

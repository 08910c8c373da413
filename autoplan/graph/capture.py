"""Capture: trace a model (and optionally its loss) into the graph IR with torch.export.

Tracing is non-strict `torch.export.export`, which runs the model on fake tensors: a model
built under ``torch.device("meta")`` is traced without any parameter memory, and a model with
real weights is never copied. The ATen graph of the forward (loss included) is kept at the
level export gives it (``aten.linear``, ``aten.scaled_dot_product_attention`` ...); backward
costs are derived per op (see `flops`), since the backward of each op mirrors its forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import re
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autoplan.errors import TraceError
from autoplan.graph.fake import on_fake_cpu
from autoplan.graph.flops import op_flops, transcendental
from autoplan.graph.ir import INPUT, OP, OUTPUT, PARAM, Graph, Node, Ref, TensorInfo
from autoplan.precision import autocast, autocast_device

log = logging.getLogger(__name__)

_WRAPPED = "model."  # prefix of parameter and module paths inside TrainStep


class TrainStep(nn.Module):
    """``model`` followed by ``loss_fn(output, target)``: the module that gets traced. Without
    a ``loss_fn`` the model computes its own loss: its output, or the output's ``loss``
    (Hugging Face's ``ModelOutput``, or a dict with a "loss"). The last ``len(keywords)``
    inputs are passed to ``model`` by those names (see `keywords`). With a ``precision``
    (`autoplan.precision`) model and loss run under ``torch.autocast`` of its dtype."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None,
        keywords: tuple[str, ...] = (),
        precision: str | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keywords = keywords
        self.precision = precision
        self.device_type = autocast_device(model.parameters())

    def forward(self, *args: Any) -> Any:
        with autocast(self.precision, self.device_type):
            return self._loss(*args)

    def _loss(self, *args: Any) -> Any:
        inputs, target = (args, None) if self.loss_fn is None else (args[:-1], args[-1])
        positional = len(inputs) - len(self.keywords)
        named = dict(zip(self.keywords, inputs[positional:], strict=True))
        output = self.model(*inputs[:positional], **named)
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        if isinstance(output, Mapping) and "loss" in output:
            return output["loss"]
        return output


def keywords(example_inputs: Any) -> tuple[str, ...]:
    """The names of the inputs passed by keyword: a mapping's keys, sorted (``model(**inputs)``,
    as Hugging Face models are called); none for a tensor, tuple or list."""
    if not isinstance(example_inputs, Mapping):
        return ()
    names = tuple(sorted(example_inputs))
    if not all(isinstance(n, str) for n in names):
        raise TraceError(
            f"example inputs given as a mapping must have argument names as keys, got {names}"
        )
    return names


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """The inputs as positional values: a mapping's in the order of `keywords`."""
    if isinstance(example_inputs, Mapping):
        return tuple(example_inputs[name] for name in keywords(example_inputs))
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def microbatch(batch: Any, count: int) -> Any:
    """The first of ``count`` equal microbatches of ``batch`` (tensors split along dim 0;
    tuples, lists and mappings element by element); what a pipeline stage sees per step. One
    microbatch is the batch itself: a tensor given twice (token ids as their own labels) stays
    one tensor, which export traces otherwise than two."""
    if count == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch[: batch.shape[0] // count] if batch.dim() else batch
    if isinstance(batch, tuple | list):
        return type(batch)(microbatch(b, count) for b in batch)
    if isinstance(batch, Mapping):
        return {name: microbatch(b, count) for name, b in batch.items()}
    return batch


def step_args(
    model: nn.Module, example_inputs: Any, example_target: Any, with_loss: bool
) -> tuple[Any, ...]:
    """The positional arguments of `TrainStep`, on the meta device if the model is on meta."""
    args = as_tuple(example_inputs)
    if with_loss:
        if example_target is None:
            raise TraceError(
                "a loss_fn was given without example_target; pass the target batch too, e.g. "
                "plan(model, x, cluster, loss_fn=F.mse_loss, example_target=y)"
            )
        args = (*args, example_target)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    return args


def export_step(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    precision: str | None = None,
) -> ExportedProgram:
    """Export the train step (under autocast for a ``precision``, `autoplan.precision`); a
    failure becomes a `TraceError` that names the user's line."""
    args = step_args(model, example_inputs, example_target, loss_fn is not None)
    wrapper = TrainStep(model, loss_fn, keywords(example_inputs), precision)
    try:
        with on_fake_cpu(wrapper, args, precision is not None) as fake_args:
            ep = torch.export.export(wrapper, fake_args, strict=False)
    except Exception as e:  # torch raises many types here; all become one clear error
        raise TraceError(_explain_trace_failure(model, e, args)) from e
    if precision is not None:  # autocast's region inlined, each of its casts an op
        ep = _decomposed(ep)
    _inline_regions(ep)
    if _mutates(ep):
        ep = _decomposed(ep)
    _refuse_buffer_updates(ep)
    _refuse_float_indices(ep, model, args)
    _drop_checks(ep)
    _tie_parameters(ep)
    return ep


def _decomposed(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` made functional by ``run_decompositions({})``, which keeps composite ops such as
    ``linear`` whole (see `_mutates`) and inlines autocast's regions with their casts."""
    with warnings.catch_warnings():  # torch 2.13 warns about its own pytree internals here
        warnings.simplefilter("ignore", FutureWarning)
        return ep.run_decompositions({})


_DETACH_ = torch.ops.aten.detach_.default
# ops no gradient flows through: detach, and factories that read their input for its dtype
# and shape alone (``x.new_empty(...)``, ``torch.zeros_like(x)``), whose output needs none
_GRAD_STOPS = {
    "aten.detach.default",
    *(f"aten.new_{kind}.default" for kind in ("empty", "zeros", "ones", "full")),
    *(f"aten.{kind}_like.default" for kind in ("empty", "zeros", "ones", "full")),
    *(f"aten.{kind}_like.default" for kind in ("rand", "randn", "randint")),
}
_DETACH = torch.ops.aten.detach.default
# export's wrappers of a region of forward run under a context manager: (the index of the
# submodule among the wrapper's arguments, what the region's outputs need)
_REGIONS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}


def _inline_regions(ep: ExportedProgram) -> None:
    """Regions that export wraps in a submodule of their own, because forward ran them under
    ``torch.no_grad()`` / ``torch.set_grad_enabled`` or ``torch.autocast(enabled=False)`` (as
    Llama's rotary embedding is), are put back inline, so that the planner places their ops
    like any others. A region without gradients computes from detached values, as it did in
    forward. An enabled autocast region of the model's own is refused: autoplan runs the
    model's dtypes, or those of the plan's mixed precision, which traces the whole step under
    autocast (then `_decomposed` has inlined every region before this runs)."""
    root = ep.graph_module
    graph = root.graph
    for node in list(graph.nodes):
        at = _REGIONS.get(str(node.target)) if node.op == "call_function" else None
        if at is None:
            continue
        where = _module_path(node) or "the model"
        if str(node.target) == "wrap_with_autocast" and node.args[2]:
            raise TraceError(
                f"{where} runs part of forward under torch.autocast({node.args[0]!r}, "
                f"dtype={node.args[1]}); autoplan plans and runs the model's own dtypes: cast "
                "explicitly (x.to(torch.bfloat16)), build the model in that dtype, or plan the "
                'whole step in mixed precision (PlanOptions(mixed_precision="bf16"))'
            )
        submodule = getattr(root, str(node.args[at].target))
        if any(n.op == "get_attr" for n in submodule.graph.nodes):
            raise TraceError(f"{where}: nested no_grad/autocast regions are not supported")
        no_grad = str(node.target) == "wrap_with_set_grad_enabled" and not node.args[0]
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(node.args[at + 1 :])
        outputs: tuple[Any, ...] = ()
        with graph.inserting_before(node):
            for inner in submodule.graph.nodes:
                if inner.op == "placeholder":  # without gradients, what enters is detached
                    value = next(inputs)
                    env[inner] = _detached(graph, value) if no_grad else value
                elif inner.op == "output":
                    outputs = tuple(env[o] for o in inner.args[0])
                else:
                    env[inner] = graph.node_copy(inner, env.__getitem__)
        for user in list(node.users):  # getitem(region, i)
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        wrapped = node.args[at]
        graph.erase_node(node)
        if isinstance(wrapped, torch.fx.Node) and not wrapped.users:
            graph.erase_node(wrapped)
            delattr(root, str(wrapped.target))
    root.recompile()


def _detached(graph: torch.fx.Graph, value: Any) -> Any:
    if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    out = graph.call_function(_DETACH, (value,))
    out.meta = {**value.meta, "val": value.meta["val"].detach()}
    return out


def _refuse_buffer_updates(ep: ExportedProgram) -> None:
    """A forward that updates buffers (batch norm's running statistics in training) is not
    run yet: the step would have to write them back, and a batch norm over a split batch
    normalizes by each rank's statistics, not the batch's."""
    updated = sorted(
        {b.removeprefix(_WRAPPED) for b in ep.graph_signature.buffers_to_mutate.values()}
    )
    if updated:
        shown = ", ".join(updated[:4]) + (
            f" and {len(updated) - 4} more" if len(updated) > 4 else ""
        )
        raise TraceError(
            f"the model updates buffers in forward ({shown}): autoplan does not train models "
            "whose forward writes buffers yet (batch norm in training mode does); use "
            "GroupNorm or LayerNorm, or put the batch norms in eval mode (model.eval() on them)"
        )


def _mutates(ep: ExportedProgram) -> bool:
    """Whether an op of the step writes into a tensor in place (``shifted[:, 1:] = labels``
    ... as BART shifts its labels): a write through a view changes the tensor it views,
    which placing and sharding each op's value apart cannot follow. Such a graph is made
    functional (``run_decompositions({})``: in-place writes become ``slice_scatter`` and the
    like; composite ops such as ``linear`` stay whole); other graphs stay as export gave
    them. ``detach_`` (on a tensor made in forward) writes no data."""
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        writes = schema is not None and schema.is_mutable
        if node.op == "call_function" and writes and node.target is not _DETACH_:
            return True
    return False


def _tie_parameters(ep: ExportedProgram) -> None:
    """One placeholder per parameter: export gives a tied parameter (a language model's head
    sharing the embedding's weight) a placeholder under each of its names, and reads it
    through one of them. Every read goes to the placeholder of its first name, the one
    ``named_parameters()`` gives, and the others are removed, so that planner and executor
    see one parameter: one placement, one gradient, synchronized once."""
    first: dict[int, torch.fx.Node] = {}  # id of the tensor -> its first name's placeholder
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    aliases: list[str] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.PARAMETER or spec.target is None:
            continue
        node = placeholders[spec.arg.name]
        key = id(ep.state_dict[spec.target])
        if key not in first:
            first[key] = node
            continue
        node.replace_all_uses_with(first[key])
        ep.graph.erase_node(node)
        aliases.append(spec.arg.name)
    if aliases:
        specs = ep.graph_signature.input_specs
        specs[:] = [spec for spec in specs if spec.arg.name not in aliases]
        ep.graph_module.recompile()


def _is_check(node: torch.fx.Node) -> bool:
    """A check that export writes into the graph (``_assert_tensor_metadata`` after a dtype
    cast, ``_assert_scalar``, ``sym_constrain_range*``): it returns nothing and no op reads
    it. The shapes and dtypes it checks were fixed when the model was traced."""
    if node.op != "call_function" or node.users:
        return False
    name = getattr(node.target, "__name__", "")
    return name.startswith(("_assert", "sym_constrain_range"))


def _drop_checks(ep: ExportedProgram) -> None:
    """Remove the checks from the exported graph: they carry no data to place or shard, and
    DTensor has no rule to run them on sharded tensors. Planner and executor both read this
    graph, so neither sees them."""
    graph = ep.graph_module.graph
    checks = [n for n in graph.nodes if _is_check(n)]
    for node in checks:
        graph.erase_node(node)
    if checks:
        ep.graph_module.recompile()


def _data_dependent(e: BaseException) -> bool:
    """Whether tracing failed on Python that reads tensor values (control flow, ``.item()``)."""
    while e is not None:
        text = f"{type(e).__name__} {e}".lower()
        if "datadependent" in text or "data-dependent" in text or "data dependent" in text:
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def _described(args: tuple[Any, ...]) -> str:
    """The step's arguments as dtype[shape]: "int64[8, 16], int64[8, 16]"."""

    def one(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
        return type(a).__name__

    return ", ".join(one(a) for a in args)


def _user_line(frames: Sequence[tuple[str, int, str]]) -> str:
    """Where the innermost of ``frames`` (file, line number, code) in the user's code (not
    torch's, autoplan's or another package's) is, as " at file:line (`code`)"; "" if none is."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    user = [
        f for f in frames if not f[0].startswith((torch_dir, here)) and "site-packages" not in f[0]
    ]
    if not user:
        return ""
    filename, lineno, code = user[-1]
    return f" at {filename}:{lineno} (`{code.strip()}`)"


def _inputs_hint(args: tuple[Any, ...]) -> str:
    return (
        f"It was called on the example inputs (then the target): {_described(args)}; "
        "check that the model runs on inputs of these dtypes and shapes."
    )


def _explain_trace_failure(model: nn.Module, e: Exception, args: tuple[Any, ...]) -> str:
    frames = [
        (f.filename, f.lineno or 0, f.line or "") for f in traceback.extract_tb(e.__traceback__)
    ]
    first_line = next((ln for ln in str(e).strip().splitlines() if ln.strip()), type(e).__name__)
    if _data_dependent(e):
        hint = (
            "autoplan traces the model with torch.export on fake tensors: replace Python "
            "control flow that depends on tensor values with tensor ops (torch.where, masks), "
            "and avoid .item(), .tolist() and printing tensors inside forward."
        )
    else:
        hint = _inputs_hint(args)
    return (
        f"could not trace {type(model).__name__}{_user_line(frames)}: {type(e).__name__}: "
        f"{first_line}. {hint}"
    )


# the arguments that are indices into another tensor, besides those the op's schema names
# "index" or "indices" (embedding, gather, index_select, index, scatter ...)
_INDEX_ARGS: dict[Any, str] = {torch.ops.aten.one_hot.default: "self"}
# a frame of an fx node's stack trace: file, line number, then the line's code
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')


def _refuse_float_indices(ep: ExportedProgram, model: nn.Module, args: tuple[Any, ...]) -> None:
    """Indices of a floating dtype (token ids given as floats) are refused, as the eager ops
    refuse them: export lets some of them through on fake tensors (torch 2.11 an embedding's,
    2.13 a one_hot's, both an index_select's), and the model would fail in its first step."""
    for node in ep.graph.nodes:
        found = _float_indices(node) if node.op == "call_function" else None
        if found is None:
            continue
        name, dtype = found
        trace = node.meta.get("stack_trace") or ""
        frames = [(f, int(n), code) for f, n, code in _FRAME.findall(trace)]
        module = _module_path(node)
        op = f"{module} ({node.target})" if module else str(node.target)
        raise TraceError(
            f"could not trace {type(model).__name__}{_user_line(frames)}: {op} takes integer "
            f"{name} (Long, Int), got {dtype}. {_inputs_hint(args)}"
        )


def _float_indices(node: torch.fx.Node) -> tuple[str, str] | None:
    """The name of ``node``'s index argument that is a floating tensor, and its dtype."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, argument in enumerate(schema.arguments):
        if argument.name not in ("index", "indices", _INDEX_ARGS.get(node.target)):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        for v in value if isinstance(value, list | tuple) else [value]:
            val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex()):
                return argument.name, str(val.dtype).removeprefix("torch.")
    return None


def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    precision: str | None = None,
) -> Graph:
    """Trace ``model`` (and ``loss_fn`` applied to its output and ``example_target``), under
    autocast for a mixed ``precision``."""
    ep = export_step(model, example_inputs, loss_fn, example_target, precision)
    return graph_from_export(ep, precision)


def capture_microbatches(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: Any = None,
    precision: str | None = None,
) -> Callable[[int], Graph]:
    """``capture`` of the step at a number of microbatches: ``at(count)`` traces it on the
    first of ``count`` microbatches of the example batch (`microbatch`)."""

    def at(count: int) -> Graph:
        inputs, target = microbatch(example_inputs, count), microbatch(example_target, count)
        return capture(model, inputs, loss_fn, target, precision)

    return at


def graph_from_export(ep: ExportedProgram, precision: str | None = None) -> Graph:
    """The IR of an exported step, traced under mixed ``precision`` (or None)."""
    kinds: dict[str, tuple[str, str, bool]] = {}
    frozen: list[str] = []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        target = (spec.target or name).removeprefix(_WRAPPED)
        if spec.kind == InputKind.PARAMETER:
            # a frozen parameter has no gradient: nothing to reduce, store or update
            trains = ep.state_dict[spec.target].requires_grad
            kinds[name] = (PARAM, target, trains)
            if not trains:
                frozen.append(target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kinds[name] = (PARAM, target, False)
        else:
            kinds[name] = (INPUT, name, False)

    done: dict[str, Node] = {}
    for fx_node in ep.graph.nodes:
        if fx_node.op == "call_function" and fx_node.target is operator.getitem:
            continue  # its users refer to the multi-output op directly (see _to_ir)
        node = _convert(fx_node, kinds, done)
        done[node.name] = node
    nodes = tuple(done.values())
    return Graph(nodes=nodes, fingerprint=_fingerprint(nodes, frozen), precision=precision)


def _infos(val: Any) -> tuple[TensorInfo, ...]:
    if isinstance(val, torch.Tensor):
        return (
            TensorInfo(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch.")),
        )
    if isinstance(val, list | tuple):
        return tuple(i for v in val for i in _infos(v))
    return ()


def _to_ir(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        if value.op == "call_function" and value.target is operator.getitem:
            # getitem of a multi-output op refers to that op's output directly
            return Ref(value.args[0].name, int(value.args[1]))  # type: ignore[union-attr, arg-type]
        return Ref(value.name)
    if isinstance(value, list | tuple):
        return tuple(_to_ir(v) for v in value)
    return value


def _module_path(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = path.removeprefix("L['self'].").removeprefix(_WRAPPED)
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
            module_path=target.rpartition(".")[0] if kind == PARAM else "",
            target=target,
            params=(),
            needs_grad=trainable and all(o.is_float for o in outputs),
            is_view=False,
        )
    args = tuple(_to_ir(a) for a in fx_node.args)
    kwargs = tuple(sorted((k, _to_ir(v)) for k, v in fx_node.kwargs.items()))
    if fx_node.op == "output":
        return Node(
            fx_node.name, OUTPUT, OUTPUT, args, kwargs, (), 0.0, 0.0, 0.0, "", "", (), False, True
        )
    if fx_node.op != "call_function":
        raise TraceError(f"unexpected graph node {fx_node.format_node()}; please report this")

    refs = Node(fx_node.name, OP, "", args, kwargs, (), 0, 0, 0, "", "", (), False, False).refs
    ins = [done[r.name].outputs[r.index] for r in refs]
    grads = [done[r.name].needs_grad for r in refs]
    op = str(fx_node.target)
    needs_grad = any(grads) and any(o.is_float for o in outputs) and op not in _GRAD_STOPS
    schema = getattr(fx_node.target, "_schema", None)
    is_view = bool(schema and schema.returns and schema.returns[0].alias_info is not None)
    flops, bwd = (0.0, 0.0) if is_view else op_flops(op, ins, outputs, grads)
    moved = 0.0 if is_view else float(sum(i.nbytes for i in ins) + sum(o.nbytes for o in outputs))
    return Node(
        name=fx_node.name,
        kind=OP,
        op=op,
        args=args,
        kwargs=kwargs,
        outputs=outputs,
        flops=flops,
        bwd_flops=bwd,
        bytes_moved=moved,
        module_path=_module_path(fx_node),
        target="",
        params=tuple(
            dict.fromkeys(done[r.name].target for r in refs if done[r.name].kind == PARAM)
        ),
        needs_grad=needs_grad,
        is_view=is_view,
        transcendental=0.0 if is_view else transcendental(op, ins, outputs),
    )


def _fingerprint(nodes: Sequence[Node], frozen: Sequence[str]) -> str:
    """A hash of the graph, and of which parameters are frozen, if any (a plan for other
    trainable parameters reduces other gradients)."""
    doc: list[Any] = [
        [n.name, n.kind, n.op, repr(n.args), repr(n.kwargs), repr(n.outputs), n.target]
        for n in nodes
    ]
    if frozen:
        doc.append(["frozen", sorted(frozen)])
    text = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

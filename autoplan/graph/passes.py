"""Passes over an exported step before it becomes the graph IR: regions export wraps
(autocast, no_grad) inlined, functionalized where it mutates (batch norm in training made of
its reductions), shape checks dropped, tied parameters made one, parameters' casts moved to
their readers, and writes in forward to anything but buffers refused."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autoplan.errors import TraceError
from autoplan.graph.batch_norm import DECOMPOSITIONS
from autoplan.graph.convert import WRAPPED, module_path


def decomposed(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` made functional by ``run_decompositions``, which keeps composite ops such as
    ``linear`` whole (see `mutates`) and inlines autocast's regions with their casts; batch
    norm in training becomes its reductions (`autoplan.graph.batch_norm`), its running
    statistics' updates buffer writes.

    A region's body is run node by node (an fx ``Interpreter``), so that the ops it becomes
    keep their own module paths: run whole, every op of a step traced under autocast would
    take the region's (the step's), and no two layers would be seen as copies
    (`autoplan.graph.blocks`)."""
    for node in ep.graph.nodes:
        if node.op == "call_function" and str(node.target) == "wrap_with_autocast":
            body = getattr(ep.graph_module, str(node.args[_REGIONS["wrap_with_autocast"]].target))
            body.forward = torch.fx.Interpreter(body).run
    with warnings.catch_warnings():  # torch 2.13 warns about its own pytree internals here
        warnings.simplefilter("ignore", FutureWarning)
        return ep.run_decompositions(DECOMPOSITIONS)


_DETACH_ = torch.ops.aten.detach_.default


_DETACH = torch.ops.aten.detach.default


# export's wrappers of a region of forward run under a context manager: (the index of the
# submodule among the wrapper's arguments, what the region's outputs need)
_REGIONS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}


def inline_regions(ep: ExportedProgram) -> None:
    """Regions that export wraps in a submodule of their own, because forward ran them under
    ``torch.no_grad()`` / ``torch.set_grad_enabled`` or ``torch.autocast(enabled=False)`` (as
    Llama's rotary embedding is), are put back inline, so that the planner places their ops
    like any others. A region without gradients computes from detached values, as it did in
    forward. An enabled autocast region of the model's own is refused: autoplan runs the
    model's dtypes, or those of the plan's mixed precision, which traces the whole step under
    autocast (then `decomposed` has inlined every region before this runs)."""
    root = ep.graph_module
    graph = root.graph
    for node in list(graph.nodes):
        at = _REGIONS.get(str(node.target)) if node.op == "call_function" else None
        if at is None:
            continue
        where = module_path(node) or "the model"
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


def refuse_other_writes(ep: ExportedProgram) -> None:
    """Forward may write buffers (batch norm's running statistics, a counter): the step hands
    each written value back and the executor writes it into the buffer after forward
    (`autoplan.graph.ir.Write`). A forward that writes into a parameter or an input in place
    is refused: its parameters change only in the optimizer's step, and its batch is read on
    every step anew."""
    sig = ep.graph_signature
    written = sorted(
        {
            *(p.removeprefix(WRAPPED) for p in sig.parameters_to_mutate.values()),
            *(f"input {sig.user_inputs.index(i)}" for i in sig.user_inputs_to_mutate.values()),
        }
    )
    if written:
        raise TraceError(
            f"the model writes in place into {', '.join(written)} in forward: autoplan trains "
            "models that write only their buffers in forward; compute a new tensor instead "
            "(x = x + y rather than x += y), or register what forward updates as a buffer "
            "(module.register_buffer)"
        )


def mutates(ep: ExportedProgram) -> bool:
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


def tie_parameters(ep: ExportedProgram) -> None:
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


def casts_to_readers(ep: ExportedProgram) -> None:
    """Each op that reads parameters alone (bf16-params' cast of each parameter, made as the
    step begins, `autoplan.precision.computing`) moved to just before its reader, in the
    reader's module, one copy for each op that reads it: the cast of a layer's weight is in
    the layer, so that a pipeline stage casts its own weights rather than receiving them, and
    a tied weight's readers (an embedding and a head, stages apart) cast it each."""
    params = {
        spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.PARAMETER
    }
    graph = ep.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        reads = node.all_input_nodes
        if node.op != "call_function" or not reads or not node.users:
            continue
        if not all(r.op == "placeholder" and r.name in params for r in reads):
            continue
        first, *others = sorted(node.users, key=order.__getitem__)
        first.prepend(node)
        _in_module_of(node, first)
        for user in others:
            with graph.inserting_before(user):
                copy = graph.node_copy(node)
            _in_module_of(copy, user)
            user.replace_input_with(node, copy)
    ep.graph_module.recompile()


def _in_module_of(node: torch.fx.Node, reader: torch.fx.Node) -> None:
    """``node`` traced as if in ``reader``'s module (`autoplan.graph.convert.module_path`)."""
    if "nn_module_stack" in reader.meta:
        node.meta["nn_module_stack"] = dict(reader.meta["nn_module_stack"])
    else:
        node.meta.pop("nn_module_stack", None)


def _is_check(node: torch.fx.Node) -> bool:
    """A check that export writes into the graph (``_assert_tensor_metadata`` after a dtype
    cast, ``_assert_scalar``, ``sym_constrain_range*``): it returns nothing and no op reads
    it. The shapes and dtypes it checks were fixed when the model was traced."""
    if node.op != "call_function" or node.users:
        return False
    name = getattr(node.target, "__name__", "")
    return name.startswith(("_assert", "sym_constrain_range"))


def drop_checks(ep: ExportedProgram) -> None:
    """Remove the checks from the exported graph, and every op whose result nothing reads
    and that has no effect (what only a check read; what a Python ``assert
    x.max().item() <= n`` in forward leaves: ``max``, ``item``, ``le`` on the symbolic
    scalar): they carry no data to place or shard, and DTensor has no rule to run them on
    sharded tensors. Planner and executor both read this graph, so neither sees them. Ops
    that mutate or draw random numbers stay (torch.fx's `Node.is_impure`)."""
    graph = ep.graph_module.graph
    checks = [n for n in graph.nodes if _is_check(n)]
    for node in checks:
        graph.erase_node(node)
    if graph.eliminate_dead_code() or checks:
        ep.graph_module.recompile()

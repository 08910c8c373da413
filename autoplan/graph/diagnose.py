"""Why a model could not be traced, or traced to a graph that would train wrongly, told as
the user's line and what to change: the messages of `autoplan.graph.capture`."""

from __future__ import annotations

import linecache
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from autoplan.errors import TraceError
from autoplan.graph.convert import module_path

# the arguments that are indices into another tensor, besides those the op's schema names
# "index" or "indices" (embedding, gather, index_select, index, scatter ...)
_INDEX_ARGS: dict[Any, str] = {torch.ops.aten.one_hot.default: "self"}


def data_dependent(e: BaseException) -> bool:
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


def _user_line(frames: Sequence[tuple[str, int, str]], model: nn.Module) -> str:
    """Where the innermost of ``frames`` (file, line number, code) in the user's code is, as
    " at file:line (`code`)"; "" if none is. The user's code: their own files (not torch's,
    autoplan's, another package's, nor code generated at run time, "<string>"); for a model
    from a package (transformers'), the files of the model's own folder."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    real = [f for f in frames if not f[0].startswith((torch_dir, here, "<"))]
    user = [f for f in real if "site-packages" not in f[0]]
    if not user:
        source = getattr(sys.modules.get(type(model).__module__), "__file__", None)
        folder = os.path.dirname(source or "")
        user = [f for f in real if folder and os.path.dirname(f[0]) == folder]
    if not user:
        return ""
    filename, lineno, code = user[-1]
    return f" at {filename}:{lineno} (`{code.strip()}`)"


_DATA_DEPENDENT = (
    "autoplan traces the model with torch.export on fake tensors: replace Python "
    "control flow that depends on tensor values with tensor ops (torch.where, masks), "
    "and avoid .item(), .tolist() and printing tensors inside forward."
)


# bincount's length is the largest value + 1 (at least minlength): known only where the
# model uses the counts beside a tensor of minlength's length, which fixes it when traced
_BINCOUNT = (
    "Count at a length the trace can see: torch.zeros(n, dtype=torch.long).scatter_add(0, x, "
    "torch.ones_like(x)) or F.one_hot(x, n).sum(0) for n values (or torch.histc), or bincount "
    "with minlength=n where its counts meet a tensor of n elements (counts * weights)."
)


# a Python error on None while tracing: transformers builds some inputs only outside
# torch.compile and torch.export (LongT5's attention_mask, under is_torchdynamo_compiling())
_NONE = (
    "A value the model reads is None as torch.export traces it: an optional input the model "
    "makes itself only when not compiling (transformers: `if attention_mask is None and not "
    "is_torchdynamo_compiling()`), or a config value left None. Pass that input with the "
    "example inputs (attention_mask=torch.ones_like(input_ids)), or set the value."
)


def _of_none(e: BaseException) -> bool:
    """Whether Python failed on a value that is None (an attribute, a subscript, a call)."""
    return isinstance(e, AttributeError | TypeError) and "'NoneType'" in str(e)


def _flex_attention(frames: Sequence[tuple[str, int, str]]) -> bool:
    """Whether the failure was raised inside torch's FlexAttention."""
    return any(
        f[0].replace(os.sep, "/").endswith("/nn/attention/flex_attention.py") for f in frames
    )


def _inputs_hint(args: tuple[Any, ...]) -> str:
    return (
        f"It was called on the example inputs (then the target): {_described(args)}; "
        "check that the model runs on inputs of these dtypes and shapes. If it does, the line "
        "fails only as torch.export traces it (fake tensors; a package may take another path "
        "while tracing, under torch.compiler.is_compiling()): reproduce it with "
        "torch.export.export(model, args, strict=False), then change the line or choose "
        "another implementation of the module (transformers: attn_implementation)."
    )


def explain_trace_failure(model: nn.Module, e: Exception, args: tuple[Any, ...]) -> str:
    frames = [
        (f.filename, f.lineno or 0, f.line or "") for f in traceback.extract_tb(e.__traceback__)
    ]
    first_line = next((ln for ln in str(e).strip().splitlines() if ln.strip()), type(e).__name__)
    if _flex_attention(frames):
        hint = (
            "autoplan traces FlexAttention as torch's operator (torch.ops.higher_order."
            "flex_attention), which torch traces by calling score_mod and mask_mod on index "
            "tensors under vmap: a function that reads a tensor's value in Python, or indexes "
            "with more than the indices it is given, fails there. Make the function tensor "
            "ops of its indices, or choose another attention (transformers: "
            'attn_implementation="sdpa", which autoplan plans as attention; or '
            "scaled_dot_product_attention with the same mask)."
        )
    elif data_dependent(e):
        hint = _DATA_DEPENDENT
    elif _of_none(e):
        hint = _NONE + " " + _inputs_hint(args)
    else:
        hint = _inputs_hint(args)
    return (
        f"could not trace {type(model).__name__}{_user_line(frames, model)}{_failed_in(e, model)}"
        f": {type(e).__name__}: {first_line.rstrip('.')}. {hint}"
    )


def _failed_in(e: BaseException, model: nn.Module) -> str:
    """``" in module (op)"``: the innermost of ``model``'s modules whose forward the failure
    went through, and the innermost ATen op it was running (the failure's frames' ``self``
    and ``func``, where export dispatched it), or where no op was running (Python failed),
    the module's line it reached; "" for what is not found."""
    names = {id(m): name for name, m in model.named_modules()}
    module, op, line = "", "", ""
    tb = e.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        owner = local.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module, op = names[id(owner)], ""  # an op before this module's call is not its
            code = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
            line = f"line {tb.tb_lineno} of its {tb.tb_frame.f_code.co_name} (`{code}`)"
        for value in (local.get("func"), owner):
            if isinstance(value, torch._ops.OpOverload):
                op = str(value)
        tb = tb.tb_next
    if not op and data_dependent(e):  # Python read a tensor's value: bool(), .item()
        op = "aten._local_scalar_dense, a tensor's value read in Python"
    elif not op and line:  # Python failed, no op running: the module's line it reached
        op = f"no op running, at {line}"
    if not module and not op:
        return ""
    return f" in {module or 'the model'}" + (f" ({op})" if op else "")


# a frame of an fx node's stack trace: file, line number, then the line's code
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')


def refuse_float_indices(ep: ExportedProgram, model: nn.Module, args: tuple[Any, ...]) -> None:
    """Indices of a floating dtype (token ids given as floats) are refused, as the eager ops
    refuse them: export lets some of them through on fake tensors (torch 2.11 an embedding's,
    2.13 a one_hot's, both an index_select's), and the model would fail in its first step."""
    for node in ep.graph.nodes:
        found = _float_indices(node) if node.op == "call_function" else None
        if found is None:
            continue
        name, dtype = found
        raise TraceError(
            f"could not trace {_where(node, model)} takes integer {name} (Long, Int), got "
            f"{dtype}. {_inputs_hint(args)}"
        )


def refuse_data_dependent(ep: ExportedProgram, model: nn.Module) -> None:
    """A size that depends on what the tensors hold (an integer from ``.item()`` or
    ``.tolist()``, a ``nonzero``'s count) is refused at the first op that makes one: export
    traces it as an unknown integer, but a plan places and prices tensors of known shapes."""
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        symbolic = [s for s in _sizes(val) if _unknown(s)]
        if node.op != "call_function" or not symbolic:
            continue
        hint = _BINCOUNT if node.target is torch.ops.aten.bincount.default else _DATA_DEPENDENT
        raise TraceError(
            f"could not trace {_where(node, model)} gives {symbolic[0]}, an integer that "
            f"depends on what the tensors hold, and autoplan plans tensors of known shapes. "
            f"{hint}"
        )


def _where(node: torch.fx.Node, model: nn.Module) -> str:
    """``"Model (at its line): module (op)"``: the model, its line that made ``node``, and
    the op in its module."""
    trace = node.meta.get("stack_trace") or ""
    frames = [(f, int(n), code) for f, n, code in _FRAME.findall(trace)]
    module = module_path(node)
    op = f"{module} ({node.target})" if module else str(node.target)
    return f"{type(model).__name__}{_user_line(frames, model)}: {op}"


def _sizes(val: Any) -> list[Any]:
    """The sizes of a traced value's tensors, or the value itself if it is an integer."""
    if isinstance(val, torch.Tensor):
        return list(val.shape)
    if isinstance(val, list | tuple):
        return [s for v in val for s in _sizes(v)]
    return [val] if isinstance(val, torch.SymInt) else []


def _unknown(size: Any) -> bool:
    """Whether a traced size is unknown: not an integer, nor a symbol the trace then fixed
    (bincount's length, where the model uses the counts beside a tensor of known length)."""
    return not isinstance(size, int) and size.node.maybe_as_int() is None


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


_aten = torch.ops.aten
# ops whose kernels take tensors of one dtype (eager raises "mat1 and mat2 must have the same
# dtype"), and how many of their leading tensor arguments must agree (attention's mask may
# be bool)
_ONE_DTYPE: dict[Any, int] = {
    _aten.linear.default: 3,
    _aten.mm.default: 2,
    _aten.addmm.default: 3,
    _aten.bmm.default: 2,
    _aten.baddbmm.default: 3,
    _aten.matmul.default: 2,
    _aten.mv.default: 2,
    _aten.dot.default: 2,
    _aten.convolution.default: 3,
    _aten.conv1d.default: 3,
    _aten.conv2d.default: 3,
    _aten.conv3d.default: 3,
    _aten.scaled_dot_product_attention.default: 3,
}


def refuse_mixed_dtypes(ep: ExportedProgram, model: nn.Module, args: tuple[Any, ...]) -> None:
    """An op that computes on tensors of one dtype, given several (integer inputs to a float
    model's linear), is refused: fake tensors let it through, and every rank would fail at the
    first step ("mat1 and mat2 must have the same dtype")."""
    for node in ep.graph.nodes:
        count = _ONE_DTYPE.get(node.target) if node.op == "call_function" else None
        if count is None:
            continue
        vals = [a.meta.get("val") for a in node.args[:count] if isinstance(a, torch.fx.Node)]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if len({v.dtype for v in tensors}) < 2:
            continue
        trace = node.meta.get("stack_trace") or ""
        frames = [(f, int(n), code) for f, n, code in _FRAME.findall(trace)]
        module = module_path(node)
        op = f"{module} ({node.target})" if module else str(node.target)
        got = ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in tensors)
        raise TraceError(
            f"could not trace {type(model).__name__}{_user_line(frames, model)}: {op} computes on "
            f"tensors of one dtype, got {got}. {_inputs_hint(args)}"
        )


def refuse_non_loss(ep: ExportedProgram, model: nn.Module, with_loss_fn: bool) -> None:
    """The traced step must return one loss, a floating tensor of one element: a model that
    returns more (logits, a tuple) needs a loss_fn."""
    (output,) = (n for n in ep.graph.nodes if n.op == "output")
    user = [
        v.meta.get("val") if isinstance(v, torch.fx.Node) else v
        for v, spec in zip(output.args[0], ep.graph_signature.output_specs, strict=True)
        if spec.kind.name == "USER_OUTPUT"
    ]
    loss = user[0] if len(user) == 1 else None
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1:
        return
    kind = _output_kind(ep)
    what = "the loss_fn" if with_loss_fn else type(model).__name__
    fix = (
        "make the loss_fn return the loss (a float tensor of one element, e.g. .mean())"
        if with_loss_fn
        else "pass a loss_fn (and example_target) that turns the output into the loss, or "
        "make forward return the loss (or a dict or ModelOutput with a 'loss')"
    )
    raise TraceError(
        f"{what} returns {kind} {_described(tuple(user))}, not a loss (one float tensor of one "
        f"element): autoplan trains the step's loss; {fix}"
    )


def _output_kind(ep: ExportedProgram) -> str:
    """What the step's output is: "a tuple of 2", "a dict of 3", "a tensor"."""
    spec = ep.call_spec.out_spec
    if spec is None or spec.num_children == 0:
        return "a tensor"
    name = getattr(spec.type, "__name__", "a value")
    return f"a {name} of {spec.num_children}"

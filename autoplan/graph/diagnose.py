"""Why a model could not be traced, or traced to a graph that would train wrongly, told as
the user's line and what to change: the messages of `autoplan.graph.capture`."""

from __future__ import annotations

import os
import re
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


def explain_trace_failure(model: nn.Module, e: Exception, args: tuple[Any, ...]) -> str:
    frames = [
        (f.filename, f.lineno or 0, f.line or "") for f in traceback.extract_tb(e.__traceback__)
    ]
    first_line = next((ln for ln in str(e).strip().splitlines() if ln.strip()), type(e).__name__)
    if data_dependent(e):
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
        trace = node.meta.get("stack_trace") or ""
        frames = [(f, int(n), code) for f, n, code in _FRAME.findall(trace)]
        module = module_path(node)
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

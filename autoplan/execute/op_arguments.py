"""An op's arguments as the executor calls it: the traced node's arguments with its tensor
inputs filled in per step (`Arguments`), the order the plan lists those inputs in, and which
values each op is the last to read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every fx Node in ``value`` that is a tensor (lists and tuples walked in
    order); a function's graph (FlexAttention's ``score_mod``, a ``get_attr``) is no tensor."""
    if isinstance(value, torch.fx.Node) and value.op != "get_attr":
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    map_tensors(value, found.append)
    return found


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s tensor inputs in the order the plan lists them: args, then kwargs."""
    return nodes_in([node.args, *node.kwargs.values()])


def last_uses(nodes: Sequence[torch.fx.Node], keep: Sequence[str] = ()) -> dict[str, list[str]]:
    """By node, the values it is the last to read (``nodes`` in the order they run), to free
    once it has run;
    ``keep``: values needed after the last node (a stage's sent tensors). A value kept to the
    end of the step would hold its memory through the whole forward, and every op would write
    into fresh pages, which the kernel maps and zeroes (the module's own forward frees as it
    goes)."""
    freed: dict[str, list[str]] = {}
    seen: set[str] = set(keep)
    for node in reversed(nodes):
        for read in tensor_inputs(node):
            if read.name not in seen:
                seen.add(read.name)
                freed.setdefault(node.name, []).append(read.name)
    return freed


def _function(value: Any) -> Any:
    """``value`` with each ``get_attr`` of a function's graph (FlexAttention's ``score_mod``,
    its mask's ``mask_mod``) replaced by that graph, which the op calls."""
    if isinstance(value, torch.fx.Node) and value.op == "get_attr":
        module = value.graph.owning_module
        assert module is not None, value
        return getattr(module, str(value.target))
    if isinstance(value, list | tuple):
        return type(value)(_function(v) for v in value)
    return value


@dataclass(frozen=True)
class Arguments:
    """An op's arguments with its tensor inputs to fill in, in `tensor_inputs` order (made
    once per op: the executor fills them for every op of every step)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # where each tensor input goes: a position in args or a keyword; None where one sits
    # inside a list (``cat``)
    slots: tuple[int | str, ...] | None

    @classmethod
    def of(
        cls, node: torch.fx.Node, device: torch.device, shape: Any = None, args: Any = None
    ) -> Arguments:
        """``shape``: a local view's or factory's size argument, or a local split's pieces, in
        place of the traced one; ``args``: all of them (a local slice's)."""
        if args is None:
            args = tuple(node.args) if shape is None else (node.args[0], shape, *node.args[2:])
        # graphs traced on meta carry device=meta in factories and moves (inv_freq.to(x.device))
        args = tuple(device if isinstance(v, torch.device) else _function(v) for v in args)
        kwargs = {k: device if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
        places: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
        if any(not isinstance(v, torch.fx.Node) and nodes_in(v) for _, v in places):
            return cls(args, kwargs, None)
        slots = tuple(where for where, v in places if isinstance(v, torch.fx.Node))
        return cls(args, kwargs, slots)

    def fill(self, values: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.slots is None:
            supply = iter(values)
            args = map_tensors(self.args, lambda _: next(supply))
            kwargs = {k: map_tensors(v, lambda _: next(supply)) for k, v in self.kwargs.items()}
            return args, kwargs
        args, kwargs = list(self.args), dict(self.kwargs)
        for slot, value in zip(self.slots, values, strict=True):
            if isinstance(slot, int):
                args[slot] = value
            else:
                kwargs[slot] = value
        return tuple(args), kwargs

"""A model on the meta device traced as if on the CPU, for autocast.

Autocast has no kernels for meta tensors: a step over meta parameters traced under
``torch.autocast("cpu")`` makes no casts. So a meta model is traced with fake CPU tensors in
its place (no memory either): its parameters and buffers are swapped for fake ones for the
time of the trace (``torch.nn.utils.stateless``), one fake per tensor, so that tied
parameters stay one, and the example inputs are made fake too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autoplan.torch_private import FakeTensorMode, reparametrize_module


@contextmanager
def on_fake_cpu(
    module: nn.Module, args: tuple[Any, ...], wanted: bool
) -> Iterator[tuple[Any, ...]]:
    """Within, ``module``'s meta parameters and buffers are fake CPU tensors; yields ``args``
    with its meta tensors fake CPU ones. Nothing changes unless ``wanted`` and the module has
    a meta tensor."""
    named = list(
        itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        )
    )
    if not wanted or not any(t.is_meta for _, t in named):
        yield args
        return
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}  # id of the meta tensor -> its fake
    with mode:
        for _, t in named:
            if id(t) not in made:
                fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                made[id(t)] = (
                    nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                )
        fakes = tuple(_fake(a) for a in args)
    with reparametrize_module(module, {name: made[id(t)] for name, t in named}):
        yield fakes


def _fake(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_meta:
        return torch.empty(value.shape, dtype=value.dtype, device="cpu")
    return value

"""FlexAttention, traced and run on the CPU (torch 2.13's private parts of it).

``torch.nn.attention.flex_attention`` refuses inputs that need a gradient on the CPU, and
tensors on the meta device anywhere (its ``_validate_device``): its fused kernel, which
``torch.compile`` generates, has no CPU backward. The operator it calls,
``torch.ops.higher_order.flex_attention``, has a dense implementation of its own for every
device (``sdpa_dense``: the scores materialized, ``score_mod`` and the mask's ``mask_mod``
applied to them by ``vmap``) and a backward (``sdpa_dense_backward``) that autograd runs
uncompiled; both agree with attention written out in float64 to ~1e-15
(tests/test_flex_attention.py). `traced_flex_attention` lets the check pass while autoplan
traces a step (`eager_flex_attention` also while one process trains as the reference); the
executor then calls that operator on each rank's shards (execute/flex_shards.py), never the
function. On GPUs the operator's dense implementation runs too, uncompiled: exact, with the
scores materialized as eager attention's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.attention.flex_attention as _flex
from torch._higher_order_ops.flex_attention import flex_attention_backward

from autoplan.torch_private import FakeTensorMode, FakeValues

# the operator the function calls; what a traced step's graph holds
FLEX_ATTENTION: Any = torch.ops.higher_order.flex_attention
_CREATE_MASK = _flex.create_mask  # what create_block_mask calls first

# the step's check on fake tensors (execute/dry_run.py) runs under `FakeValues`, which a
# higher-order operator finds no rule for (it looks its mode's type up exactly): FakeTensorMode's
for _op in (FLEX_ATTENTION, flex_attention_backward):
    if FakeValues not in _op.python_key_table:
        _op.py_impl(FakeValues)(_op.python_key_table[FakeTensorMode])
_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps", "meta")


def _uncached() -> None:
    """The trace's fake tensors cache no more op results: FlexAttention's tracing (``vmap``
    over the indices in ``create_block_mask`` and in the operator) leaves entries in
    FakeTensorMode's cache, which every mode shares, that a later trace then fails on
    ("... is not tracked with proxy"); other traces keep the cache."""
    mode = torch._guards.detect_fake_mode()
    if mode is not None:
        mode.cache_enabled = False


def _create_mask(*args: Any, **kwargs: Any) -> Any:
    _uncached()
    return _CREATE_MASK(*args, **kwargs)


def _validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """torch's check without its refusal of a gradient on the CPU and of the meta device
    (the fake tensors of a trace): any other device is still refused as torch refuses it."""
    del key, value
    _uncached()
    if query.device.type not in _DEVICES:
        raise ValueError(
            "FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices. "
            f"Found input tensors on {query.device.type} device."
        )


@contextmanager
def traced_flex_attention() -> Iterator[None]:
    """Within, ``flex_attention`` takes CPU tensors that need a gradient, and meta tensors."""
    original = _flex._validate_device
    _flex._validate_device, _flex.create_mask = _validate_device, _create_mask
    try:
        yield
    finally:
        _flex._validate_device, _flex.create_mask = original, _CREATE_MASK


@contextmanager
def eager_flex_attention() -> Iterator[None]:
    """`traced_flex_attention`, and ``torch.compile`` off: a model that compiles
    ``flex_attention`` itself (transformers' ``WrappedFlexAttention``, torchtitan's
    ``FlexAttention``) runs torch's operator uncompiled, as autoplan's ranks run it, where
    Inductor would generate the CPU kernel that has no backward. The one-process reference."""
    debug = _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    # the function then calls the operator itself, not through dynamo's eager backend
    _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        with traced_flex_attention(), torch._dynamo.config.patch(disable=True):
            yield
    finally:
        _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug

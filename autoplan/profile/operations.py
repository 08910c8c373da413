"""The operations `autoplan profile` times: one `Op` per point of a curve, built on every rank.

Every rank runs the operation at once, as in training: local ops on every device, a collective
on all its groups (`Operations.for_task`). Matmuls, element-wise ops and GELU cycle through
operands larger than the caches (`cold`), as a step streams its tensors through them. Sends are
a ping-pong between the two ranks of a pair, each call two messages (`Op.scale` 0.5).
`op_overhead(s)` run chains of tiny ops forward and backward (`chain`); `redistribute_overhead`
and `sync_overhead` an all-reduce raw or through DTensor's redistribution (`redistribution`),
the latter after a few ms of compute (`compute_then_sync`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from autoplan.profile.tasks import COLLECTIVE_ITEMSIZE, SYNC_WORK_CALLS, SYNC_WORK_DIM, Task
from autoplan.torch_private import all_gather_single, reduce_scatter_single, wait_collective

SYNC_BYTES = COLLECTIVE_ITEMSIZE  # the tensor sync_overhead redistributes: the curves' first size
# local ops cycle through operands of at least this many bytes, more than a CPU's last-level
# cache or a GPU's L2 (50 MB on an H100), in at most this many sets
COLD_POOL_BYTES = 128 * 2**20
COLD_POOL_SETS = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Op(NamedTuple):
    call: Callable[[], object]
    scale: float = 1.0  # the time of one call times this is the curve's seconds
    local: bool = False  # no communication: end each timed run with a barrier


class Operations:
    """The operation timed at each size of each task, on this rank; keeps the process groups
    the collectives run on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._groups: dict[tuple[tuple[int, ...], ...], Any] = {}

    def for_task(self, task: Task, size: int) -> Op:
        """The operation timed at `size` of `task` on this rank."""
        device = self.device
        if task.section in ("matmul", "elementwise"):
            shape = (size, size) if task.section == "matmul" else (size,)
            fn = torch.matmul if task.section == "matmul" else torch.add
            return cold(shape, DTYPES[task.key], device, lambda a, b, out: fn(a, b, out=out))
        if task.section == "activation":
            return cold((size,), DTYPES[task.key], device, gelu_forward_backward)
        if task.section in ("op_overhead", "op_overheads"):
            return chain(size, device, task.key)
        if task.section == "sync_overhead":
            if size == 2:
                return redistribution(SYNC_BYTES, dtensor=True, device=device)
            return compute_then_sync(sync=size == 1, device=device)
        mine = self._group(task.groups)
        if mine is None:
            return Op(lambda: None)
        ranks, group = mine
        full = torch.zeros(size // 4, device=device)  # float32: the sizes are multiples of 4 * n
        part = torch.zeros(size // 4 // len(ranks), device=device)
        if task.section == "send_recv":
            first = dist.get_rank() == ranks[0]
            peer = ranks[1] if first else ranks[0]

            def ping_pong() -> None:
                if first:
                    dist.send(full, peer)
                    dist.recv(full, peer)
                else:
                    dist.recv(full, peer)
                    dist.send(full, peer)

            return Op(ping_pong, scale=0.5)  # a round trip is two messages
        other = torch.zeros_like(full)
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_gather": lambda: all_gather_single(full, part, group=group),
            "reduce_scatter": lambda: reduce_scatter_single(part, full, group=group),
            "all_to_all": lambda: dist.all_to_all_single(other, full, group=group),
        }
        return Op(calls[task.section])

    def _group(self, groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], Any] | None:
        """This rank's group among `groups` and its process group (None if it is in none).
        Every rank creates every group, in the same order, including those it is not in."""
        if groups not in self._groups:
            handles = [dist.new_group(list(g)) for g in groups]
            self._groups[groups] = dict(zip(groups, handles, strict=True))
        rank = dist.get_rank()
        return next(((g, h) for g, h in self._groups[groups].items() if rank in g), None)


def cold(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object],
) -> Op:
    """`fn(a, b, out)` on tensors of `shape`, each call on the next of a pool of such triples
    that together pass `COLD_POOL_BYTES`: a step streams its weights and activations through
    the caches once, and an op timed on the same operands again and again finds them cached
    (by hand, 4 ranks on 2 cores: a 256x512 @ 512x512 matmul 7% faster, a 362^3 one 18%)."""
    nbytes = 3 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    count = max(1, min(COLD_POOL_SETS, math.ceil(COLD_POOL_BYTES / nbytes)))
    # filled, not random: the speed does not depend on the values, and filling 256 MB tensors
    # with random numbers on every rank would take longer than timing them
    pool = [
        tuple(torch.full(shape, 0.5, dtype=dtype, device=device) for _ in range(3))
        for _ in range(count)
    ]
    sets = itertools.cycle(pool)

    def call() -> None:
        fn(*next(sets))

    return Op(call, local=True)


def cold_matmul(n: int, device: torch.device) -> Op:
    """An n x n float32 matmul on cold operands (`cold`), as the float32 matmul curve's."""
    return cold((n, n), torch.float32, device, lambda a, b, out: torch.matmul(a, b, out=out))


def compute_then_sync(*, sync: bool, device: torch.device) -> Op:
    """A few ms of matmuls on every rank, each call followed by a tiny redistribution (as
    `redistribution`) if `sync`."""
    work = cold_matmul(SYNC_WORK_DIM, device)
    redistribute = redistribution(SYNC_BYTES, dtensor=True, device=device)

    def call() -> None:
        for _ in range(SYNC_WORK_CALLS):
            work.call()
        if sync:
            redistribute.call()

    return Op(call, local=True)


def gelu_forward_backward(x: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    """GELU's forward into `out`, then its backward into `out` (`measured.activation`)."""
    torch.ops.aten.gelu.out(x, out=out)
    torch.ops.aten.gelu_backward.grad_input(grad, x, grad_input=out)


def chain(length: int, device: torch.device, op: str = "") -> Op:
    """`length` ops on a tiny tensor, forward and backward through autograd: `op` (one of
    `OP_OVERHEAD_KINDS`; a linear or layer norm with parameters of its own, as in a model), or
    element-wise ops (`op` empty)."""
    leaf = torch.ones(1, 1, 4, 4, device=device, requires_grad=True)
    # each op's own leaves (a linear's weight; a layer norm's weight and bias), as a model's
    shapes: dict[str, list[tuple[int, ...]]] = {
        "aten.linear.default": [(4, 4)],
        "aten.layer_norm.default": [(4,), (4,)],
    }
    params = [
        [torch.ones(shape, device=device, requires_grad=True) for shape in shapes.get(op, [])]
        for _ in range(length)
    ]
    links: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "": lambda y, i: y * 1.5 if i % 2 else y + 1.0,
        "aten.linear.default": lambda y, i: F.linear(y, *params[i]),
        "aten.layer_norm.default": lambda y, i: F.layer_norm(y, (4,), params[i][0], params[i][1]),
        "aten.gelu.default": lambda y, i: F.gelu(y),
        "aten.scaled_dot_product_attention.default": (
            lambda y, i: F.scaled_dot_product_attention(y, y, y)
        ),
        "view": lambda y, i: y.transpose(2, 3),
    }
    link = links[op]

    def call() -> None:
        y = leaf
        for i in range(length):
            y = link(y, i)
        y.sum().backward()
        leaf.grad = None
        for own in params:
            for p in own:
                p.grad = None

    return Op(call, local=True)


def redistribution(nbytes: int, *, dtensor: bool, device: torch.device) -> Op:
    """An all-reduce of `nbytes` (float32) over all ranks: raw, or as DTensor's redistribution
    from Partial to Replicate issues it, waited for."""
    local = torch.ones(nbytes // 4, device=device)
    if not dtensor:
        return Op(lambda: dist.all_reduce(local))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def redistribute() -> None:
        value = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        wait_collective(value.redistribute(mesh, [Replicate()]).to_local())

    return Op(redistribute)

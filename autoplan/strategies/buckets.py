"""Gradient buckets: the gradient all-reduces of many parameters done as one collective, as DDP
buckets them.

On a fast link a small collective costs its latency, and a step of data parallelism would pay
it once per parameter (a bias of 1 KB as much as a weight of 1 MB). So a gradient whose
synchronization is only all-reduces (partial on some axes, stored replicated there) joins a
bucket of gradients with the same axes and dtype. Buckets fill in backward order (the reverse
of the parameters' first use), up to `BUCKET_BYTES`, and are issued in the order they fill.
As in DDP, the first bucket of each axes and dtype is smaller (`FIRST_BUCKET_BYTES`), so that
communication starts early in backward, overlapping the rest of it.

A bucket partial along several mesh axes is all-reduced once over the ranks of all of them
together (their flattened group), as torchtitan reduces data parallelism over a flattened
"dp" mesh, not once per axis: the sum is the same, and one collective waits once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.strategies.placement import Collective

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
GRADIENTS = "gradients"  # the `node` of a bucket's collectives in a plan: no op issues them


@dataclass(frozen=True)
class Bucket:
    params: tuple[str, ...]  # parameter nodes, in the order of the flat buffer
    axes: tuple[int, ...]  # mesh axes it is all-reduced over (together), in mesh order
    nbytes: int  # per device

    @property
    def collective(self) -> Collective:
        return Collective("all_reduce", self.axes, self.nbytes)


@dataclass(frozen=True)
class GradientSync:
    """The synchronization one parameter's gradient needs."""

    param: str
    dtype: str
    collectives: tuple[Collective, ...]

    @property
    def bucket_axes(self) -> tuple[int, ...] | None:
        """The axes to all-reduce along, if all-reduces are all it needs (else None)."""
        if not self.collectives or any(c.kind != "all_reduce" for c in self.collectives):
            return None
        axes = tuple(sorted(a for c in self.collectives for a in c.axes))
        return axes if len(set(axes)) == len(axes) else None


def make_buckets(
    backward_order: Sequence[GradientSync],
    cap: int = BUCKET_BYTES,
    first_cap: int = FIRST_BUCKET_BYTES,
) -> list[Bucket]:
    """Group bucketable gradients (``bucket_axes`` not None), given in the order backward
    produces them, into buckets of at most ``cap`` bytes, the first of each axes and dtype at
    most ``first_cap`` (a larger gradient has one of its own); the buckets come in the order
    backward fills them."""
    open_: dict[tuple[tuple[int, ...], str], tuple[list[str], int]] = {}
    done: list[tuple[int, Bucket]] = []  # (position of the last gradient, bucket)
    closed: set[tuple[tuple[int, ...], str]] = set()

    def close(key: tuple[tuple[int, ...], str], last: int) -> None:
        params, nbytes = open_.pop(key)
        closed.add(key)
        done.append((last, Bucket(tuple(params), key[0], nbytes)))

    last_of: dict[tuple[tuple[int, ...], str], int] = {}
    for position, sync in enumerate(backward_order):
        axes = sync.bucket_axes
        assert axes is not None, f"{sync.param}: not an all-reduce gradient"
        key = (axes, sync.dtype)
        nbytes = sync.collectives[0].nbytes
        limit = cap if key in closed else first_cap
        if key in open_ and open_[key][1] + nbytes > limit:
            close(key, last_of[key])
        params, total = open_.get(key, ([], 0))
        open_[key] = ([*params, sync.param], total + nbytes)
        last_of[key] = position
    for key in list(open_):
        close(key, last_of[key])
    return [bucket for _, bucket in sorted(done, key=lambda d: d[0])]

"""Random ops under a plan: dropout, noise, sampling.

A random op planned replicated must draw the same values on every rank (each holds the whole
tensor); one planned split must draw different values for different shards (one process draws
one mask for the whole tensor, not the same mask once per shard). DTensor sees to the second
only on CUDA (its RNG tracker); on CPU it draws from each rank's default generator. So the
executor keeps a generator of its own, started from rank 0's state on every rank and
advanced alike by every rank of a stage (they run the same ops): a replicated op draws from
it, and a split op from a generator seeded for its shard by a number drawn from it. The
user's generators are left as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from autoplan.execute.placements import split_dim


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node``'s op draws from a random generator (dropout, rand_like, bernoulli ...)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def shard_index(mesh: DeviceMesh, placements: Sequence[Placement]) -> int | None:
    """Which shard of a tensor placed so this rank holds (ranks holding the same shard get
    the same number), or None for a tensor every rank holds whole."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the mesh"
    index, split = 0, False
    for placement, at, size in zip(placements, coordinate, mesh.shape, strict=True):
        if split_dim(placement) is not None:
            index, split = index * size + at, True
    return index if split else None


class Draws:
    """The executor's random generator: the same state on every rank of the job."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.cuda = mesh.device_type == "cuda"
        # rank 0's, on every rank (a tensor of one size everywhere; NCCL sends from the GPU)
        state = self._get().to(mesh.device_type)
        dist.broadcast(state, src=0)
        self.state: torch.Tensor = state.cpu()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.cuda else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def drawing(self, output: Sequence[Placement]) -> Iterator[None]:
        """Run a random op whose output is placed as ``output`` inside this block."""
        devices = [torch.cuda.current_device()] if self.cuda else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            # DTensor's, that it keeps no random state on CPU: this does
            warnings.filterwarnings("ignore", "DTensor random operators may not have")
            self._set(self.state)
            shard = shard_index(self.mesh, output)
            if shard is not None:
                seed = int(torch.randint(2**62, (1,), device=self.mesh.device_type)) + shard
                self.state = self._get()
                if self.cuda:
                    torch.cuda.manual_seed(seed)
                else:
                    torch.random.default_generator.manual_seed(seed)
            yield
            if shard is None:
                self.state = self._get()

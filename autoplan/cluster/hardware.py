"""The parts a cluster is made of: its `Device` (one rank's accelerator) and its `Link`s.

Plain frozen data; `autoplan.cluster.fileio` reads and validates them from a cluster file and
`autoplan.cluster.model.Cluster` puts them together. They live apart from `Cluster` so that the
file reader can build them without importing the cluster, which imports the reader. Units:
bytes, seconds, FLOP/s and bytes/s.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoplan.units import fmt_bytes

__all__ = ["BACKENDS", "DTYPES", "FALLBACK_DTYPE", "REQUIRED_DTYPES", "Device", "Link"]

BACKENDS = ("gloo", "nccl")
# Every cluster file must give peak FLOP/s for these dtypes; more (e.g. "float64") are allowed.
REQUIRED_DTYPES = ("bfloat16", "float16", "float32")
# The dtypes a cluster file may name: torch's, as a traced step names them (any other key is a
# typo, which would leave its dtype priced at the fallback's rate without a word)
DTYPES = (
    *REQUIRED_DTYPES,
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
# The dtype whose peak stands in for any dtype the file does not list (int64 index math, bool
# masks, float64): such ops run on the vector units at roughly the fp32 rate, not the tensor cores.
FALLBACK_DTYPE = "float32"


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU rank's share of a host).

    `peak_flops` maps torch dtype names ("float32", "bfloat16", "float16") to FLOP/s;
    `memory_bandwidth` is bytes/s; the efficiencies are the fractions of those peaks that a
    large matmul and an element-wise op reach (0 < x <= 1). `allocator_margin` is the share
    of the memory the allocator holds that no live tensor does (0 <= x < 1): the step's live
    tensors may hold the rest (`tensor_bytes`).
    """

    kind: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    compute_efficiency: float
    memory_efficiency: float
    allocator_margin: float = 0.0

    def __post_init__(self) -> None:
        # Sorted, read-only copy with float values so equal devices compare, hash and
        # serialize identically whether built from JSON ints or Python floats.
        flops = {str(k): float(v) for k, v in sorted(self.peak_flops.items())}
        object.__setattr__(self, "peak_flops", types.MappingProxyType(flops))
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))
        object.__setattr__(self, "compute_efficiency", float(self.compute_efficiency))
        object.__setattr__(self, "memory_efficiency", float(self.memory_efficiency))
        object.__setattr__(self, "allocator_margin", float(self.allocator_margin))

    def tensor_bytes(self, memory_fraction: float) -> float:
        """The bytes a step's live tensors may hold at once when it may use
        ``memory_fraction`` of the device's memory: that share, less what the allocator
        holds beyond them (`allocator_margin`)."""
        return self.memory_bytes * memory_fraction * (1.0 - self.allocator_margin)

    def tensor_bytes_words(self, memory_fraction: float) -> str:
        """Where `tensor_bytes` comes from, in words: "90% of 80 GiB, less ..."."""
        words = f"{memory_fraction * 100:g}% of {fmt_bytes(self.memory_bytes)}"
        if self.allocator_margin:
            words += f", less the allocator's margin of {self.allocator_margin:.0%}"
        return words

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # mappingproxy cannot be pickled or deep-copied; rebuild from plain values instead.
        return (
            Device,
            (
                self.kind,
                self.memory_bytes,
                dict(self.peak_flops),
                self.memory_bandwidth,
                self.compute_efficiency,
                self.memory_efficiency,
                self.allocator_margin,
            ),
        )

    def __hash__(self) -> int:
        return hash(
            (
                self.kind,
                self.memory_bytes,
                tuple(self.peak_flops.items()),
                self.memory_bandwidth,
                self.compute_efficiency,
                self.memory_efficiency,
                self.allocator_margin,
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """The `device` section of a cluster file."""
        return {
            "kind": self.kind,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            # absent: none (CPU ranks: glibc's allocator, no cache of its own)
            **({"allocator_margin": self.allocator_margin} if self.allocator_margin else {}),
        }


@dataclass(frozen=True)
class Link:
    """A link class between devices: `bandwidth` in bytes/s per device in one direction,
    `latency` in seconds per message (the alpha of the alpha-beta model)."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", float(self.bandwidth))
        object.__setattr__(self, "latency", float(self.latency))

    def to_dict(self) -> dict[str, float]:
        """An `intra_node` or `inter_node` section of a cluster file."""
        return {"bandwidth": self.bandwidth, "latency": self.latency}

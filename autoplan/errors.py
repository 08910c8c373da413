"""Errors raised for bad user input. Every one names the offending value and what to change."""

from __future__ import annotations


class AutoplanError(ValueError):
    """Base class of every error autoplan raises for input the user can fix."""


class TraceError(AutoplanError):
    """The model could not be traced into a graph."""


class UnsupportedOpError(AutoplanError):
    """An operator has no sharding rule and cannot be handled."""


class ClusterFormatError(AutoplanError):
    """A cluster file is missing a field or has a bad value."""


class MeshShapeError(AutoplanError):
    """A logical mesh shape does not match the cluster."""


class InfeasiblePlanError(AutoplanError):
    """No plan fits in device memory."""


class SolverTimeLimitError(AutoplanError):
    """The ILP solver found no plan at all within its time limit."""


class PlanFormatError(AutoplanError):
    """A plan document is malformed, of the wrong version, or made for another model or cluster."""


class UsageError(AutoplanError):
    """A command was given an option without another one it needs."""


class BufferWriteError(AutoplanError):
    """A model that updates buffers in forward was asked to train in a way that cannot update
    them as one process does (pipeline stages, microbatches)."""


class BatchSplitError(AutoplanError):
    """A batch does not split into the number of equal microbatches asked for."""


class CheckpointError(AutoplanError):
    """A checkpoint folder cannot be written, or a checkpoint is missing, damaged or another
    model's."""


class CheckError(AutoplanError):
    """A run checked against one process (``autoplan run --check``) trained otherwise."""


def error_class(name: str) -> type[AutoplanError]:
    """The error class of that name (one rank's error raised again on the others, which
    receive its name), `AutoplanError` for a name it does not know."""
    return {c.__name__: c for c in AutoplanError.__subclasses__()}.get(name, AutoplanError)

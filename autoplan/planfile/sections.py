"""The sections of a plan (`autoplan.planfile.schema.Plan`): its provenance, mesh, stages,
pipeline, parameters, nodes, collectives and predictions, each a plain frozen dataclass.

Placements are keyed by mesh-axis name and written as "R", "P", "S(d)" or "S(d)xk" (strided).
The sections live apart from `Plan` so that the plan file's reader (`autoplan.planfile.io`)
can build them without importing the plan, which imports the reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoplan.modes import Phase
from autoplan.solvers.problem import Unproven

# 2: pipeline stages (Stage, Plan.pipeline); 3: gradient buckets; 4: gradients kept partial;
# 5: a collective's mesh axes (several for a bucket all-reduced over them together)
# (ZeRO-1/2's params.<name>.grad and .state, and solver.unproven, are optional fields of
# version 5)
PLAN_VERSION = 5
# the phases issued once per step, not per microbatch
ONCE_PER_STEP = (Phase.GRAD_SYNC, Phase.UPDATE)

Placements = Mapping[str, str]  # mesh-axis name -> "R" | "P" | "S(d)" | "S(d)xk"


@dataclass(frozen=True)
class Provenance:
    autoplan: str
    torch: str  # the release that traced the graph: for people, and to explain a refusal
    graph_fingerprint: str
    cluster_fingerprint: str
    cluster: str  # the cluster's name, for people

    def graph_refusal(self, fingerprint: str, torch: str) -> str | None:
        """Why this plan cannot run the graph `fingerprint` that torch release `torch` traced,
        None if it can. The graph decides, not the release: a plan made under one torch runs
        under another that traces the model to the same graph."""
        if fingerprint == self.graph_fingerprint:
            return None
        if torch != self.torch:
            return (
                f"the plan was made under torch {self.torch} for graph {self.graph_fingerprint}, "
                f"and under torch {torch} this model traces to graph {fingerprint} (torch.export "
                "traces some models differently from release to release; or the model, its "
                "input shapes or its frozen parameters changed): plan again under this torch"
            )
        return (
            f"the plan was made for another model, input shapes or set of frozen parameters "
            f"(graph fingerprint {self.graph_fingerprint}, this one {fingerprint}); plan again "
            "for this model. If the model did not change, it traces to another graph in each "
            "process: a model that iterates a set of strings while tracing orders its ops by "
            "the string hash; give every process that plans or trains the same PYTHONHASHSEED "
            "(`autoplan run` gives its ranks 0)"
        )


@dataclass(frozen=True)
class Mesh:
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # row-major over the mesh, last axis fastest


@dataclass(frozen=True)
class StagePredicted:
    time_s: float  # one microbatch, forward + backward, with the send to the next stage
    forward_s: float
    backward_s: float
    # per device, with the activations of the microbatches in flight (interleaved: its
    # device group's, all its stages together)
    memory_bytes: float


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a plan without pipelining has one, on every rank). A stage runs
    on the ranks of its row of the mesh's "pp" axis, with the remaining axes as its mesh."""

    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    layers: tuple[str, ...] = ()  # "blocks.3" ...
    received: tuple[str, ...] = ()  # tensors from the stage before (named by their producer)
    sent: tuple[str, ...] = ()  # tensors to the stage after
    boundary: Placements = field(default_factory=dict)  # of every tensor received or sent
    predicted: StagePredicted | None = None


@dataclass(frozen=True)
class Pipeline:
    # a torch.distributed.pipelining schedule: "1F1B" | "GPipe" | "Interleaved1F1B" |
    # "ZeroBubble" (the last two may hold several stages on each row of the "pp" axis:
    # `Plan.virtual_stages`)
    schedule: str
    num_microbatches: int
    bubble_fraction: float  # predicted idle share of the step


@dataclass(frozen=True)
class ParamPlan:
    placements: Placements  # as the first op that reads it needs it
    storage: Placements  # as it is kept between steps (with its gradient and optimizer state)
    shape: tuple[int, ...]
    dtype: str
    # ZeRO-1/2 (`autoplan.strategies.zero_state`): where the optimizer state is kept, split further
    # than the storage, and where the synchronized gradient is kept (the storage, ZeRO-1, or
    # the state's placement, ZeRO-2); empty: as stored (written only when not empty)
    grad: Placements = field(default_factory=dict)
    state: Placements = field(default_factory=dict)

    @property
    def gradient(self) -> Placements:
        """Where the parameter's gradient is synchronized to."""
        return self.grad or self.storage

    @property
    def updated(self) -> Placements:
        """Where the optimizer keeps its state and steps the parameter."""
        return self.state or self.storage


@dataclass(frozen=True)
class NodePlan:
    op: str
    module: str
    output: Placements
    inputs: tuple[Placements, ...]
    rule: str  # where the strategy came from: ours | dtensor | replicated | storage | data | output
    # where a replicated op keeps its output's gradient, when partial ("P" on some axis): its
    # backward then runs on partial sums and passes them on (strategies/space.kept_partial);
    # empty for the output's placement
    grad: Placements = field(default_factory=dict)


@dataclass(frozen=True)
class CollectivePlan:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    bytes: int  # per device: the gathered output for all_gather, else the input
    # the mesh axes whose ranks form the group: one, or several for a gradient bucket
    # all-reduced over them together (their flattened group)
    axes: tuple[str, ...]
    phase: Phase  # update: a ZeRO-1/2 gather after the optimizer step
    node: str  # the op (or output) that needs the redistribution; "gradients" for a bucket
    tensor: str  # the node whose output is redistributed; a bucket's name ("bucket0")
    # issued on that stage's mesh, once per microbatch (grad_sync and update: once per step)
    stage: int = 0
    # a gradient bucket: the parameter nodes whose gradients it all-reduces together, in the
    # order of its flat buffer (strategies/buckets.py); empty for every other collective
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class RecomputedLayer:
    """A layer whose ops run their forward again in backward instead of keeping their outputs
    (`autoplan.graph.recompute`); the executor runs each contiguous run of them under
    ``torch.utils.checkpoint``, selective when some are saved."""

    layer: str  # "blocks.3", or "ops 0-41"
    mode: str  # "full" (its blocks' ops), "selective" (its attention cores') or "ops"
    nodes: tuple[str, ...]  # its recomputed region's ops, in graph order
    # those of its ops whose outputs are kept and not made again (mode "ops"), in graph order
    saved: tuple[str, ...] = ()


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    compute_s: float
    comm_s: float
    peak_memory_bytes: float
    # what the step's live tensors may hold: the device's share, less its allocator's margin
    memory_limit_bytes: float
    # the cluster's `Device.allocator_margin` taken off the limit; written only when set
    allocator_margin: float = 0.0


@dataclass(frozen=True)
class SolverInfo:
    status: str
    objective: float
    solve_time_s: float
    num_variables: int
    num_constraints: int
    num_groups: int
    meshes_tried: tuple[tuple[int, ...], ...]
    # the parts of the search not proven optimal (their ILPs ran into the time limit); written
    # only when some are, so that plans proven optimal read and write as before
    unproven: tuple[Unproven, ...] = ()

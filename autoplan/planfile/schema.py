"""The plan: a versioned, human-readable record of every decision and its predicted cost.

Plans are plain frozen data made of the sections in `autoplan.planfile.sections`. Placements
are keyed by mesh-axis name and written as "R", "P", "S(d)" or "S(d)xk". `Plan.to_json`, `Plan.save`
and `Plan.from_json` turn a plan into canonical JSON and back through `autoplan.planfile.io`,
which validates every field, builds the sections and returns the plan's fields; the reader
never imports this module, so the imports run one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from autoplan.modes import NodeKind
from autoplan.planfile.io import OPTIONAL_PARAM_FIELDS, plan_text, read_plan
from autoplan.planfile.sections import (
    PLAN_VERSION,
    CollectivePlan,
    Mesh,
    NodePlan,
    ParamPlan,
    Pipeline,
    Predicted,
    Provenance,
    RecomputedLayer,
    SolverInfo,
    Stage,
)
from autoplan.schedules import group_stages, stage_group

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    provenance: Provenance
    mesh: Mesh
    stages: tuple[Stage, ...]
    params: Mapping[str, ParamPlan]  # by parameter FQN ("layers.0.weight")
    nodes: Mapping[str, NodePlan]  # by graph node name, in graph order
    collectives: tuple[CollectivePlan, ...]
    predicted: Predicted
    solver: SolverInfo
    pipeline: Pipeline | None = None
    # "bf16" or "fp16" when the step computes in that dtype under autocast (autoplan.precision)
    mixed_precision: str | None = None
    version: int = PLAN_VERSION
    # the layers recomputed in backward; written only when some are, so that plans without
    # recomputation read and write as before
    recompute: tuple[RecomputedLayer, ...] = ()

    def param_stages(self) -> dict[str, int]:
        """The stage holding each parameter and buffer, by FQN."""
        return {
            self.nodes[name].module: s
            for s, stage in enumerate(self.stages)
            for name in stage.nodes
            if self.nodes[name].op == NodeKind.PARAM
        }

    @property
    def virtual_stages(self) -> int:
        """Stages on each device group, a row of the "pp" axis: 2 or more under
        Interleaved1F1B (stage ``s`` on row ``s mod p``), 1 or more under ZeroBubble, 2 under
        ZBV (in a V: `group`), else 1."""
        return len(self.stages) // self.mesh.shape[0] if self.pipeline is not None else 1

    def group(self, s: int) -> int:
        """The row of the "pp" axis that runs stage ``s`` (`autoplan.schedules.stage_group`)."""
        if self.pipeline is None:
            return 0
        return stage_group(self.pipeline.schedule, len(self.stages), self.virtual_stages, s)

    def group_stages(self, group: int) -> tuple[int, ...]:
        """The stages row ``group`` of the "pp" axis runs, in stage order."""
        if self.pipeline is None:
            return tuple(range(len(self.stages)))
        schedule = self.pipeline.schedule
        return group_stages(schedule, len(self.stages), self.virtual_stages, group)

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The axes of each stage's mesh: placements name these ("pp" is not among them)."""
        return self.mesh.axes[1:] if self.pipeline is not None else self.mesh.axes

    def to_json(self) -> str:
        """Canonical JSON: the same plan always gives the same bytes. Optional fields are
        written only when set, so plans without them have the bytes they had before: a plan
        in the model's own dtypes has no mixed_precision key, one without recomputation no
        recompute key, a recomputed layer that saves no ops no ``saved``, one proven optimal
        no ``solver.unproven``, one on a device of no allocator margin no
        ``predicted.allocator_margin``, and a parameter no ZeRO-1/2 ``grad`` or ``state``."""
        data = asdict(self)
        if data["mixed_precision"] is None:
            del data["mixed_precision"]
        if not self.recompute:
            del data["recompute"]
        for layer in data.get("recompute", ()):
            if not layer["saved"]:
                del layer["saved"]
        if not self.solver.unproven:
            del data["solver"]["unproven"]
        if not self.predicted.allocator_margin:
            del data["predicted"]["allocator_margin"]
        for param in data["params"].values():
            for key in OPTIONAL_PARAM_FIELDS:
                if not param[key]:
                    del param[key]
        return plan_text(data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def from_json(
        cls,
        source: str,
        *,
        graph_fingerprint: str | None = None,
        cluster_fingerprint: str | None = None,
    ) -> Plan:
        """Read a plan from JSON text or a file path; refuse a malformed or mismatched one."""
        fields = read_plan(
            source, graph_fingerprint=graph_fingerprint, cluster_fingerprint=cluster_fingerprint
        )
        return cls(**fields)

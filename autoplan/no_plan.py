"""The errors of a search that found no plan: why none fits (the least memory any mesh
would need, and what to do), or which parts of the search ran out of time."""

from __future__ import annotations

from collections.abc import Mapping

from autoplan.cluster.model import Cluster
from autoplan.errors import AutoplanError, InfeasiblePlanError, SolverTimeLimitError
from autoplan.graph.ir import Graph
from autoplan.modes import NodeKind, RecomputeMode
from autoplan.search.pipeline_search import LAYER_TIME_LIMIT_S
from autoplan.solvers.problem import SKIPPED, Unproven
from autoplan.units import fmt_bytes


def no_plan(
    single: InfeasiblePlanError | None,
    weighed: bool,
    unproven: list[Unproven],
    cluster: Cluster,
    memory_limit: float,
) -> AutoplanError:
    """Why the search found no plan: where some ILPs found none within the time limit, that
    (a longer limit may find one); else what does not fit (``single``: the one-stage plans',
    None where no mesh was found too large; pipelines were searched if ``weighed``)."""
    if single is None:
        infeasible = InfeasiblePlanError(
            f"no pipeline fits in {fmt_bytes(memory_limit)} per device on cluster "
            f"{cluster.name!r}: use more devices, more stages or microbatches, or a "
            "lighter optimizer"
        )
    else:
        infeasible = (
            InfeasiblePlanError(f"{single} No pipeline fits either.") if weighed else single
        )
    cut = [part.describe() for part in unproven if part.outcome == SKIPPED]
    if not cut:
        return infeasible
    layers = f"; a pipeline layer's ILP stops at {LAYER_TIME_LIMIT_S:g} s at most" * weighed
    too_large = f" Where it did not: {single}" if single is not None else ""
    return SolverTimeLimitError(
        f"the ILP solver found no plan within the time limit ({'; '.join(cut)}): raise the time "
        f"limit (PlanOptions.time_limit_s, --time-limit{layers}).{too_large}"
    )


def infeasible(
    graph: Graph,
    cluster: Cluster,
    needs: Mapping[tuple[int, ...], float],
    limit: float,
    fraction: float,
    recompute: str,
) -> InfeasiblePlanError:
    """No mesh fits: the one that needs least (``needs``, bytes per device by mesh) against
    the ``limit``, with ``recompute`` mode every layer was tried in, and what to do."""
    mesh, need = min(needs.items(), key=lambda kv: kv[1])
    recomputed = {
        RecomputeMode.FULL: ", every layer recomputed in backward",
        RecomputeMode.SELECTIVE: ", every layer's attention core recomputed in backward",
        RecomputeMode.OPS: ", every layer recomputed in backward but the ops torchtitan saves",
    }.get(RecomputeMode(recompute), "")
    hint = {
        RecomputeMode.NONE: ', activation recomputation (recompute="full")',
        RecomputeMode.SELECTIVE: ', full activation recomputation (recompute="full")',
        RecomputeMode.OPS: ', full activation recomputation (recompute="full")',
    }.get(RecomputeMode(recompute), "")
    param_bytes = sum(n.output.nbytes for n in graph if n.kind == NodeKind.PARAM)
    # just over the limit: the ILP choosing recomputation found no plan (`solve_mesh`)
    amount = fmt_bytes(need) if need > limit * 1.001 else "more than it has"
    return InfeasiblePlanError(
        f"the model does not fit: even sharded as far as mesh {mesh} allows{recomputed}, each "
        f"device needs {amount} (parameters alone are {fmt_bytes(param_bytes)} "
        f"unsharded, plus gradients, optimizer state and activations), but a device of cluster "
        f"{cluster.name!r} offers {fmt_bytes(limit)} "
        f"({cluster.device.tensor_bytes_words(fraction)}). Use more devices (--nodes), a smaller "
        f"batch, lower-precision parameters{hint}, or a lighter optimizer."
    )

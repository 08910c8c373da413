"""Baselines: the conventional hand-written plan of a model, as a `Plan`.

``baseline(model, inputs, cluster, dp=2, tp=4)`` is Megatron-style tensor parallelism over
groups of ``tp`` devices and data parallelism over ``dp`` such groups, optionally with ZeRO
(stage 1, 2 or 3).
Every node's placement is fixed (nothing is searched) and priced by the planner's cost model,
so a baseline is shown, estimated, compared and executed like any plan.

The package is named in the plural so that ``autoplan.baseline`` is only ever the function.
"""

from autoplan.baselines.build import baseline

__all__ = ["baseline"]

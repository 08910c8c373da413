"""`export_aten`: a step exported at the ATen level in one trace, the level
``ExportedProgram.run_decompositions`` retraces an export to. Under autocast the planner
needs that level: autocast's casts are made by the dispatcher below export's default
(pre-dispatch) trace, which keeps the autocast region whole, and only the retrace made them
ops (`autoplan.graph.passes.decomposed`). Traced once so, the casts are ops from the start
and the step costs one trace instead of two (benchmarks/results/trace_speed.md).

Composite ops (``linear``, ``scaled_dot_product_attention`` ...) are kept whole as
``run_decompositions`` keeps them: the same split of torch's decompositions into the
composite ops to decompose and the rest, with an empty table.

Both names are private to torch.export; `ATEN_EXPORT` says whether the torch at hand has
them (else the planner traces twice, as before).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram

try:
    from torch.export._trace import _export
    from torch.export.exported_program import (
        _override_composite_implicit_decomp,
        _split_decomp_table_to_cia_and_python_decomp,
    )
except ImportError:  # a torch release without them: traced twice
    ATEN_EXPORT = False
else:
    ATEN_EXPORT = True


def export_aten(module: torch.nn.Module, args: tuple[Any, ...]) -> ExportedProgram:
    """Non-strict ``torch.export`` of ``module(*args)`` at the ATen level, functional, with
    composite ops kept whole (``run_decompositions({})`` of the default export, in one
    trace)."""
    composite, _ = _split_decomp_table_to_cia_and_python_decomp({})
    with _override_composite_implicit_decomp(composite):
        return _export(module, args, strict=False, pre_dispatch=False)

"""Expert parallelism of index-routed mixtures of experts: the grouped matmul's rule.

transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 (`grouped_mm_experts_forward`, how they
trace) route each token to its top-k experts by ``topk``, order the (token, expert) rows by
expert (``sort``), count the rows per expert (``histc``, then ``cumsum``: the offsets) and
multiply every expert's rows by its weights in one grouped matmul (torch's ``_grouped_mm``
in bfloat16, else transformers' fallback op),
``grouped_mm(x (S, K), w (E, K, N), offs (E,)) -> (S, N)``, row ``i`` by the expert whose
offsets' range holds it. On one mesh axis it runs replicated, or with the experts split:
``w`` split along dim 0 (each rank stores and updates its ``E / n`` experts), the rows and
offsets whole, and the output a partial sum: each rank multiplies the rows routed to its own
experts and leaves the others' rows zero (execute/experts.py), so the sum over the ranks is
the whole result, exactly. The planner prices that split as any other (each rank computes
``1 / n`` of the FLOPs; the partial sums reduced where a reader needs them whole) and weighs
it against replicated experts, ZeRO's and the pipeline's splits.

Inside a routed region (`autoplan.strategies.routing`) the rows may instead be each rank's
own (``S(0)``, offsets ``P``): multiplied by every expert where the experts are whole, or sent
to the ranks of their experts by all-to-all where they split along the same axis (one axis:
`supported`), the tokens never gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.graph.flops import GROUPED_MMS
from autoplan.graph.ir import Node, TensorInfo
from autoplan.strategies.placement import P, R, Spec, shard, shard_dim

AxisRule = tuple[str, ...]


def grouped_mm(node: Node, ins: Sequence[TensorInfo]) -> list[AxisRule]:
    """(output, x, w, offs): the experts (w's dim 0) split, each rank's output a partial sum."""
    return [(P, R, shard(0), R)]


RULES = dict.fromkeys(GROUPED_MMS, grouped_mm)


def supported(inputs: Sequence[Spec]) -> bool:
    """Whether the executor runs a grouped matmul so placed (``inputs``: x, w, offs): rows
    sent to their experts (rows and experts split alike) along one axis at most, and then
    no other axis splitting the experts."""
    x, w = inputs[0], inputs[1]
    sent = [a for a, p in enumerate(w) if shard_dim(p) == 0 == shard_dim(x[a])]
    split = [a for a, p in enumerate(w) if shard_dim(p) == 0]
    return not sent or split == sent == sent[:1]

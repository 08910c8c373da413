"""Planning benchmark for index-routed mixtures of experts: transformers' DeepSeek-V3 at its
published widths (`benchmarks/real_models.py`: 256 routed experts of which 8 are used, one
shared expert, multi-head latent attention; its first 3 layers dense) with fewer layers, on
simulated H100 nodes, planned by autoplan and compared with the conventional plans, all priced
by the same cost model: the batch split as far as it goes (dp), Megatron's tensor parallelism
over the rest (tp), with the experts replicated, stored by ZeRO-3, or split along dp
(`baseline(dp, tp, ep=dp)`: each rank routing its own tokens and sending the rows to their
experts' ranks by all-to-all with uneven counts, `strategies/routing.py`).

Prints, and writes to benchmarks/results/plan_experts.json and .md: planning time, the chosen
mesh and stages, how the routed experts' weights are stored, and each plan's predicted step
time and memory per GPU.

    python benchmarks/plan_experts.py [--gpus 256] [--layers 4] [--batch 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.graph.flops import GROUPED_MMS  # noqa: E402
from autoplan.planfile.show import fmt_bytes  # noqa: E402
from benchmarks.plan_moe import priced, report  # noqa: E402
from benchmarks.real_models import MODELS  # noqa: E402

SEQ_LEN = 2048
EXPERTS = "mlp.experts.gate_up_proj"  # a routed experts' weight (E, 2 x hidden, model)


def workload(layers: int, batch: int) -> autoplan.Workload:
    make_config, make_model = MODELS["deepseek-v3"]
    config = make_config()
    config.num_hidden_layers = layers
    with torch.device("meta"):
        model = make_model(config).to(torch.bfloat16)
        ids = torch.randint(0, config.vocab_size, (batch, SEQ_LEN))
    return autoplan.Workload(model, {"input_ids": ids, "labels": ids})


def routed_rows(plan: autoplan.Plan) -> str:
    """How the routed experts' grouped matmuls get their rows, by mesh axis splitting the
    experts: sent by all-to-all from the ranks that routed them, or gathered whole."""
    ways = set()
    for node in plan.nodes.values():
        if node.op in GROUPED_MMS:
            x, w = node.inputs[0], node.inputs[1]
            for axis, p in w.items():
                if p == "S(0)":
                    ways.add(f"{'all-to-all' if x.get(axis) == 'S(0)' else 'gathered'} on {axis}")
    return ", ".join(sorted(ways)) or "experts whole"


def planned(plan: autoplan.Plan) -> dict[str, object]:
    """`priced`, the experts' column saying how their rows come (`routed_rows`)."""
    row = priced(plan, EXPERTS)
    row["experts"] = f"{row['experts']}; rows {routed_rows(plan)}"
    return row


def run(gpus: int, layers: int, batch: int) -> list[dict[str, object]]:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/h100-sxm-8.json", num_nodes=gpus // 8)
    w = workload(layers, batch)
    options = autoplan.PlanOptions(mixed_precision="bf16")
    rows: list[dict[str, object]] = []
    start = time.perf_counter()
    plan = w.plan(cluster, options)
    rows.append({"plan": "autoplan", "plan_s": round(time.perf_counter() - start, 1)})
    rows[-1].update(planned(plan))
    rows[-1]["limit"] = plan.predicted.memory_limit_bytes
    # the batch split as far as it goes, tensor parallelism over the rest of the GPUs
    dp = min(gpus, batch)
    tp = gpus // dp
    for name, degrees in (
        (f"experts split (dp={dp}, tp={tp}, ep={dp})", {"dp": dp, "tp": tp, "ep": dp}),
        (f"data parallel (dp={dp}, tp={tp})", {"dp": dp, "tp": tp}),
        (f"ZeRO-3 (dp={dp}, tp={tp})", {"dp": dp, "tp": tp, "zero_stage": 3}),
    ):
        row: dict[str, object] = {"plan": name, "plan_s": "-"}
        try:
            row.update(planned(w.baseline(cluster, options=options, **degrees)))
        except AutoplanError as e:
            row.update({"mesh": "-", "stages": "-", "experts": "-", "step_s": None, "memory": None})
            row["error"] = str(e).split(";")[0][:120]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    rows = run(args.gpus, args.layers, args.batch)
    title = (
        f"DeepSeek-V3's widths ({args.layers} layers, 256 experts top-8, batch {args.batch} x "
        f"{SEQ_LEN}, bf16) on {args.gpus} simulated H100s"
    )
    limit = fmt_bytes(float(rows[0]["limit"]))  # type: ignore[arg-type]
    note = "predictions are analytic (published link and peak figures), not measured"
    report("plan_experts", title, args, rows, **{"memory limit per GPU": limit, "note": note})


if __name__ == "__main__":
    main()

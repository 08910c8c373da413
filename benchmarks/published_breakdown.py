"""Where the predicted step of each published configuration goes
(`benchmarks/published.py`'s rows): compute, and the collectives by phase and kind with the
share that backward hides, on the datasheet file, at one sequence per dp rank (a pipeline's:
one microbatch, every stage summed). It shows which terms make a row's error.

    python benchmarks/published_breakdown.py [--configs megatron-gpt-1.7b,...]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoplan.baselines.build import baseline_of_graph  # noqa: E402
from autoplan.baselines.propagate import Layout  # noqa: E402
from autoplan.costmodel.pricer import Pricer  # noqa: E402
from autoplan.estimate import price_stages_ops  # noqa: E402
from benchmarks.published import OPTIONS, UNBOUNDED_BYTES, clusters, trace  # noqa: E402
from benchmarks.published_configs import CONFIGS, Published  # noqa: E402


def breakdown(config: Published) -> dict[str, float]:
    """Seconds of the step by term: "compute", "host", "<phase> <kind> <axes>", "hidden"."""
    cluster = clusters(config)["datasheet"]
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=UNBOUNDED_BYTES))
    layout = Layout(
        config.dp, config.tp, config.zero_stage, config.sequence_parallel, 1, config.recompute
    )
    count = config.num_microbatches if config.pp > 1 else 1
    batch = config.dp * config.micro_batch if config.pp > 1 else config.dp
    graph = trace(config, batch)
    plan = baseline_of_graph(graph, cluster, layout, config.pp, count, OPTIONS)
    steps = price_stages_ops(plan, lambda _: graph, cluster)
    piped = plan.pipeline is not None
    skip = 1 if piped else 0  # a pipeline's stage mesh: the axes after "pp"
    shape, names = tuple(plan.mesh.shape[skip:]), plan.mesh.axes[skip:]
    pricer = Pricer(cluster.stage(math.prod(shape)) if piped else cluster, shape, "adamw")
    terms: dict[str, float] = defaultdict(float)
    for step in steps:
        terms["compute"] += step.compute_s - step.rest.host_s
        terms["host"] += step.rest.host_s
        terms["hidden"] -= step.rest.hidden_s
        terms["waits"] += step.rest.waits_s
        for _, _, p in step.collectives:
            c = p.collective
            axes = "+".join(names[a] for a in c.axes)
            seconds = pricer.phased_s(p) if p.phase == "grad_sync" else pricer.collective_s(c)
            terms[f"{p.phase} {c.kind} {axes}"] += seconds
    terms["step (sum)"] = sum(terms.values())
    terms["plan step_time_s"] = plan.predicted.step_time_s
    return dict(terms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=None)
    args = parser.parse_args()
    chosen = [c for c in CONFIGS if c.comparable]
    if args.configs:
        chosen = [c for c in chosen if c.name in args.configs.split(",")]
    for config in chosen:
        terms = breakdown(config)
        total = terms["step (sum)"]
        print(f"== {config.name}: {total:.3f} s")
        for k, v in sorted(terms.items(), key=lambda kv: -abs(kv[1])):
            print(f"   {k:40s} {v:9.4f} s  {v / total:6.1%}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Predicted against published throughput: each configuration of
`benchmarks/published_configs.py` (torchtitan's Llama 3.1 runs on H100s, Megatron-Core's GPT
table on H100s), priced as its conventional plan (`autoplan.baseline`'s, with the same
dp/tp/pp, FSDP or distributed optimizer, sequence parallelism and recomputation; bf16
parameters with every op in bf16, as FSDP2's param_dtype and Megatron's --bf16 compute, and
float32 gradient reduction) on the cluster file of its hardware, at its full layer count.

The figure is the source's: tokens/s per GPU = global batch x sequence / step / GPUs, or
TFLOP/s per GPU = Megatron's FLOPs of the step / step / GPUs (its own formula,
`published_configs.megatron_flops`), so the ratio predicted / published is the published
step time over the predicted one. Each step is priced with the datasheet file and with the
file profiled on one H100 (`costmodels/h100-sxm-8-profiled.json`), from one trace.

A baseline traces the whole batch of a step at once. Where a run accumulates gradients over
microbatches without a pipeline (Megatron's pp=1 rows), that batch does not fit, so the step
is priced at 1 and 2 sequences per dp rank and extended linearly: step = the step of one
sequence + (n - 1) x per-sequence, where per-sequence is the difference of the two steps
without the gradients' reduction that backward hides, as Megatron reduces them (with
--overlap-grad-reduce) during the last microbatch's backward alone. Pipelines are traced at
one microbatch, as `autoplan.baseline` does.

    python benchmarks/published.py [--configs torchtitan-llama3-8b-fsdp8,...]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan import PlanOptions  # noqa: E402
from autoplan.baselines.build import baseline_of_graph  # noqa: E402
from autoplan.baselines.propagate import Layout  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.graph.capture import capture  # noqa: E402
from autoplan.graph.ir import Graph  # noqa: E402
from autoplan.modes import Precision, ReduceDtype  # noqa: E402
from benchmarks.published_configs import (  # noqa: E402
    CONFIGS,
    GRAND_TETON_BANDWIDTH,
    GRAND_TETON_MEMORY_BYTES,
    Model,
    Published,
    megatron_flops,
)
from benchmarks.results_io import write_results  # noqa: E402

GiB = 2**30
UNBOUNDED_BYTES = 2**60
PROFILED = "h100-sxm-8-profiled.json"
SHOWN = ("config", "published", "predicted", "ratio", "ratio_profiled", "memory_gib")
SHOWN += ("price_s", "error")
OPTIONS = PlanOptions(
    mixed_precision=Precision.BF16_PARAMS, reduce_dtype=ReduceDtype.FP32, memory_fraction=1.0
)


class Logits(nn.Module):
    """A transformers causal LM called on token ids, returning its logits: the loss is taken
    outside, as for examples/gpt.py (its own labels path, shifted and padded, is not split
    along the batch by the baselines' data parallelism)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=ids).logits
        return logits


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


def build(model: Model, batch: int) -> tuple[nn.Module, Any, Any, Any]:
    """The model on the meta device, its inputs, loss function and target at ``batch``."""
    from examples.gpt import GPT, GPTConfig, gpt_loss

    with torch.device("meta"):
        ids = torch.randint(0, model.vocab_size, (batch, model.seq_len))
        target = torch.randint(0, model.vocab_size, (batch, model.seq_len))
    if model.kind == "gpt":
        cfg = GPTConfig(
            model.num_layers, model.dim, model.num_heads, model.vocab_size, model.seq_len
        )
        with torch.device("meta"):
            gpt = GPT(cfg)
        return gpt, (ids,), gpt_loss, target
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # transformers materializes the causal mask while torch.export traces; without a mask its
    # sdpa passes is_causal=True, as torchtitan's Llama calls flash attention
    transformers.AttentionMaskInterface.register("causal_sdpa", _no_mask)
    transformers.AttentionInterface.register("causal_sdpa", sdpa_attention_forward)
    config = transformers.LlamaConfig(
        num_hidden_layers=model.num_layers, hidden_size=model.dim,
        intermediate_size=model.ffn_dim, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads, vocab_size=model.vocab_size,
        max_position_embeddings=model.seq_len, bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "causal_sdpa"
    with torch.device("meta"):
        llama = Logits(transformers.LlamaForCausalLM(config))
    return llama, (ids,), gpt_loss, target


def clusters(config: Published) -> dict[str, autoplan.Cluster]:
    """The datasheet file and the profiled one, at the run's node count (and, for torchtitan's
    Grand Teton H100s, their 96 GB of HBM2e at 2.4 TB/s)."""
    found = {}
    for name, path in (("datasheet", config.cluster_file), ("profiled", PROFILED)):
        cluster = autoplan.Cluster.load(ROOT / "costmodels" / path)
        cluster = cluster.with_nodes(config.num_gpus // cluster.devices_per_node)
        if config.grand_teton:
            device = replace(
                cluster.device,
                memory_bytes=GRAND_TETON_MEMORY_BYTES,
                memory_bandwidth=GRAND_TETON_BANDWIDTH,
            )
            cluster = replace(cluster, device=device)
        found[name] = cluster
    return found


@dataclass(frozen=True)
class Priced:
    step_s: float
    comm_s: float  # the collectives', of which the step shows all but hidden_s
    memory_bytes: float
    hidden_s: float = 0.0  # the gradients' reductions that backward hides

    @property
    def exposed_s(self) -> float:
        """Of the step, the collectives' that no compute hides."""
        return self.comm_s - self.hidden_s


def trace(config: Published, batch: int) -> Graph:
    model, inputs, loss_fn, target = build(config.model, batch)
    return capture(model, inputs, loss_fn, target, OPTIONS.mixed_precision)


def price(config: Published, graph: Graph, cluster: autoplan.Cluster) -> Priced:
    """The baseline's step and peak memory. The published run fitted its GPUs; the step is
    priced whether or not the cost model predicts that it fits (its memory is reported
    beside the published figure), so the device's memory is not a limit here."""
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=UNBOUNDED_BYTES))
    layout = Layout(
        config.dp, config.tp, config.zero_stage, config.sequence_parallel, 1, config.recompute
    )
    count = config.num_microbatches if config.pp > 1 else 1
    plan = baseline_of_graph(graph, cluster, layout, config.pp, count, OPTIONS)
    p = plan.predicted
    hidden = p.compute_s + p.comm_s - p.step_time_s if plan.pipeline is None else 0.0
    return Priced(p.step_time_s, p.comm_s, p.peak_memory_bytes, hidden)


_PRICED: dict[Published, dict[str, Priced]] = {}


def step_prices(config: Published) -> dict[str, Priced]:
    """The predicted step on each cluster file (the linear extension of the module docstring
    where a pp=1 run accumulates gradients); runs that differ only in their published
    figure (bf16 and Float8 of one configuration) are priced once."""
    key = replace(config, name="", source="", published=0.0, published_memory_gib=None,
                  comparable=True, notes="", assumed="")  # fmt: skip
    if key not in _PRICED:
        _PRICED[key] = _step_prices(config)
    return _PRICED[key]


def _step_prices(config: Published) -> dict[str, Priced]:
    found = clusters(config)
    if config.pp > 1 or config.num_microbatches == 1:
        # a pipeline is traced at one microbatch (dp x micro_batch sequences)
        batch = config.dp * config.micro_batch if config.pp > 1 else config.global_batch
        graph = trace(config, batch)
        return {name: price(config, graph, c) for name, c in found.items()}
    one, two = trace(config, config.dp), trace(config, 2 * config.dp)
    per_rank = config.global_batch // config.dp
    priced = {}
    for name, cluster in found.items():
        a, b = price(config, one, cluster), price(config, two, cluster)
        # what each further sequence adds: its compute and collectives, nothing hidden
        step_s, comm_s = ((x + (per_rank - 1) * (y - x)) for x, y in (
            (a.step_s, b.step_s + b.hidden_s - a.hidden_s), (a.comm_s, b.comm_s)))  # fmt: skip
        # memory: one microbatch of micro_batch sequences in flight
        priced[name] = Priced(step_s, comm_s, a.memory_bytes, a.hidden_s)
    return priced


def figure(config: Published, step_s: float) -> float:
    """The published metric were the step to take ``step_s``."""
    if config.metric == "tokens/s/GPU":
        return config.global_batch * config.model.seq_len / step_s / config.num_gpus
    return megatron_flops(config.model, config.global_batch) / step_s / config.num_gpus / 1e12


def layout_text(config: Published) -> str:
    zero = {3: " (FSDP)", 2: " (ZeRO-2)", 1: " (ZeRO-1)"}.get(config.zero_stage, "")
    dp = f"dp{config.dp}{zero}"
    sp = " +SP" if config.sequence_parallel else ""
    batch = f"{config.num_microbatches} x {config.micro_batch} seq/dp rank"
    return f"{dp} tp{config.tp}{sp} pp{config.pp}, {batch}, AC {config.recompute}"


def row_of(config: Published) -> dict[str, object]:
    row: dict[str, object] = {
        "config": config.name,
        "hardware": config.hardware,
        "gpus": config.num_gpus,
        "parallel": layout_text(config),
        "metric": config.metric,
        "published": config.published,
        "comparable": config.comparable,
    }
    start = time.perf_counter()
    memory = {name: c.device.memory_bytes for name, c in clusters(config).items()}
    try:
        priced = step_prices(config)
    except AutoplanError as e:  # a baseline that cannot be placed so: reported, not priced
        row["error"] = str(e)
        return row
    for name, p in priced.items():
        suffix = "" if name == "datasheet" else "_profiled"
        predicted = figure(config, p.step_s)
        row[f"predicted{suffix}"] = round(predicted, 1)
        row[f"ratio{suffix}"] = round(predicted / config.published, 3)
        row[f"step_s{suffix}"] = round(p.step_s, 3)
        row[f"comm_share{suffix}"] = round(p.exposed_s / p.step_s, 2)
        row[f"memory_gib{suffix}"] = round(p.memory_bytes / GiB, 1)
        row[f"fits{suffix}"] = p.memory_bytes <= memory[name]
    row["published_memory_gib"] = config.published_memory_gib
    row["price_s"] = round(time.perf_counter() - start, 1)
    row["source"] = config.source
    row["notes"] = config.notes
    row["assumed"] = config.assumed
    return row


def errors(rows: list[dict[str, object]], key: str) -> dict[str, object]:
    """Median and largest |ratio - 1| over the comparable rows priced."""
    ratios = [float(str(r[key])) for r in rows if r["comparable"] and key in r]
    if not ratios:
        return {}
    errs = [abs(x - 1) for x in ratios]
    return {
        "rows": len(errs),
        "median error": f"{statistics.median(errs):.1%}",
        "max error": f"{max(errs):.1%}",
        "within 15%": sum(e <= 0.15 for e in errs),
        "beyond 30%": sum(e > 0.30 for e in errs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=None, help="comma-separated names (default all)")
    args = parser.parse_args()
    chosen = CONFIGS
    if args.configs:
        names = args.configs.split(",")
        chosen = tuple(c for c in CONFIGS if c.name in names)
    start = time.perf_counter()
    rows = []
    for config in chosen:
        rows.append(row_of(config))
        print({k: rows[-1].get(k) for k in SHOWN}, flush=True)
    meta = {
        "command": "python benchmarks/published.py " + " ".join(sys.argv[1:]),
        "run time": f"{time.perf_counter() - start:.0f} s",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "configurations": "benchmarks/published_configs.py (each row's source, notes, assumed)",
        "predicted": "autoplan.baseline's plan of the same degrees on costmodels/h100-sxm-8.json"
        " (datasheet peaks x assumed efficiencies); _profiled: on h100-sxm-8-profiled.json "
        "(one H100 measured); full layer counts, bf16-params (every op in bf16) with float32 "
        "gradient reduction; "
        "priced whether or not the predicted memory fits (memory_gib; fits: within the "
        "device's memory), since the published run did",
        "torchtitan hardware": "its H100s have 96 GB HBM2e at 2.4 TB/s and 500 W: the files' "
        "memory and bandwidth are replaced so; their peak FLOP/s (unknown, between SXM and NVL "
        "by torchtitan's footnote) stay the files'",
        "gradient accumulation without a pipeline": "step priced at 1 and 2 sequences per dp "
        "rank, extended linearly to the run's sequences per rank",
        "ratio": "predicted / published figure (= published step time / predicted)",
        "comm_share": "the predicted step's collectives that no compute hides (the cost model "
        "hides the gradients' reductions behind backward, as the executor issues them) over "
        "the step, datasheet file",
        "datasheet file": errors(rows, "ratio"),
        "profiled file": errors(rows, "ratio_profiled"),
        "not counted": "rows with comparable=False (Float8 runs priced in bf16)",
    }
    columns = [
        "config", "gpus", "parallel", "metric", "published", "predicted", "ratio",
        "predicted_profiled", "ratio_profiled", "step_s", "comm_share", "memory_gib", "fits",
        "published_memory_gib", "comparable", "price_s", "notes", "error",
    ]  # fmt: skip
    print(meta, flush=True)
    if args.configs is None:
        write_results("published", "Predicted against published throughput", meta, rows, columns)


if __name__ == "__main__":
    main()

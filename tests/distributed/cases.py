"""The plans the distributed tests train: each case is a workload and the plan options that
force one parallel layout (or leave the choice to the planner)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplan import Cluster, Plan, PlanOptions, Workload
from autoplan.strategies.zero_state import state_specs
from tests.models.zoo import SWEPT, SWEPT_IMAGES, TORCHTITAN

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    example: str
    options: dict[str, Any]
    layout: Callable[[Workload], PlanOptions | Plan]  # the planner's options, or a plan
    world: int = 4
    max_grad_norm: float | None = None  # clip gradients to this global norm
    frozen: tuple[str, ...] = ()  # parameters that do not train (requires_grad False)
    # mixed precision ("bf16", "fp16"): planned and trained so, against one process under
    # autocast (and GradScaler from `init_scale` for fp16)
    precision: str | None = None
    init_scale: float = 2.0**16
    reduce_dtype: str | None = None  # "fp32": every gradient reduced in float32
    # the model computes parts in bf16 itself, whatever the plan (torchtitan casts its experts'
    # grouped matmuls): a batch split rounds their partial sums otherwise, so the run is
    # compared as mixed precision is
    model_bf16: bool = False
    # What the run must show besides training like one process, each asserted by the test:
    pipelined: bool = False  # the plan has 2 or more stages, and they send to each other
    recompute: tuple[str, ...] = ()  # the modes of its recomputed layers; () recomputes none
    recomputed: tuple[str, ...] | None = None  # exactly these layers recompute (the planner's)
    recompute_collectives: bool = False  # forward collectives issued again in backward
    context_parallel: bool = False  # attention split along the sequence (the plan says)
    # each rank runs its planned step on fake tensors before training (execute/dry_run.py;
    # on by default for users; here in a few of the zoo's planned cases, for the suite's time)
    check_step: bool = False

    def plan_layout(self, w: Workload) -> PlanOptions | Plan:
        """The layout, in the case's precision (and gradient reductions')."""
        layout = self.layout(w)
        if isinstance(layout, PlanOptions):
            return dataclasses.replace(
                layout, mixed_precision=self.precision, reduce_dtype=self.reduce_dtype
            )
        assert layout.mixed_precision == self.precision, "a plan made in another precision"
        return layout


def _params(w: Workload) -> list[str]:
    return [n for n, _ in w.model.named_parameters()]


Mesh = tuple[int, ...] | None


def data_parallel(w: Workload, mesh: Mesh = None) -> PlanOptions:
    pins = {"input:0": "S(0)", "target": "S(0)", **dict.fromkeys(_params(w), "R")}
    return PlanOptions(mesh_shape=mesh, pin=pins)


def dp_2x2(w: Workload) -> PlanOptions:
    """Data parallel along both axes of a (2, 2) mesh."""
    split, whole = ("S(0)", "S(0)"), ("R", "R")
    params = dict.fromkeys(_params(w), whole)
    return PlanOptions(mesh_shape=(2, 2), pin={"input:0": split, "target": split, **params})


def zero3(w: Workload, mesh: Mesh = None) -> PlanOptions:
    sharded = {n: {"storage": "S(0)", "use": "R"} for n in _params(w)}
    return PlanOptions(mesh_shape=mesh, pin={"input:0": "S(0)", "target": "S(0)", **sharded})


def zero12(stage: int, devices: int = 4) -> Callable[[Workload], PlanOptions]:
    """Data parallel on (devices,), each trained parameter's optimizer state split (ZeRO-1),
    and its gradient with it (ZeRO-2), where a dim divides by the devices."""

    def options(w: Workload) -> PlanOptions:
        pins: dict[str, Any] = {"input:0": "S(0)", "target": "S(0)"}
        for name, param in w.model.named_parameters():
            pins[name] = {"storage": "R", "use": "R"}
            for state in state_specs(("R",), tuple(param.shape), (devices,))[:1]:
                pins[name] |= {"state": state, **({"grad": state} if stage == 2 else {})}
        return PlanOptions(mesh_shape=(devices,), pin=pins)

    return options


def mlp_megatron(w: Workload, mesh: Mesh = None) -> PlanOptions:
    pins: dict[str, Any] = {}
    for n in _params(w):
        column = int(n.split(".")[1]) % 2 == 0
        if column:
            pins[n] = "S(0)"  # weight rows and bias: output features
        else:
            pins[n] = "S(1)" if n.endswith("weight") else {"storage": "R"}
    return PlanOptions(mesh_shape=mesh, pin=pins)


def gpt_megatron(w: Workload, mesh: Mesh = None) -> PlanOptions:
    pins: dict[str, Any] = {}
    for n in _params(w):
        if ".qkv." in n:
            pins[n] = "S(0)x3"  # fused q|k|v: each rank's heads of each, strided
        elif any(f".{m}." in n for m in ("q", "k", "v", "fc")):
            pins[n] = "S(0)"  # column split: heads / hidden features
        elif ".proj." in n:
            pins[n] = "S(1)" if n.endswith("weight") else {"storage": "R"}  # row split
        else:
            pins[n] = "R"
    return PlanOptions(mesh_shape=mesh, pin=pins)


def gpt_vocab_parallel(w: Workload, mesh: Mesh = None) -> PlanOptions:
    """`gpt_megatron` with the token embedding and the head split along the vocabulary: the
    planner then computes the loss on the logits' shards (Megatron's parallel cross-entropy)."""
    options = gpt_megatron(w, mesh)
    vocab = dict.fromkeys(("tok_emb.weight", "head.weight"), "S(0)")
    return dataclasses.replace(options, pin={**options.pin, **vocab})


def expert_parallel(w: Workload) -> PlanOptions:
    """Data parallel, the experts split across the ranks (GShard): tokens go to their
    experts' ranks and back by all-to-all."""
    experts = {n: "S(0)" for n in _params(w) if n.endswith(("w_in", "w_out"))}
    return PlanOptions(mesh_shape=(4,), pin={"input:0": "S(0)", "target": "S(0)", **experts})


def head_stored_split(w: Workload) -> Plan:
    """The planner's data-parallel plan with the head's weight stored split, edited as a person
    would: in its params entry alone, the nodes and collectives left as planned."""
    plan = w.plan(cluster(4), data_parallel(w, (4,)))
    head = plan.params["head.weight"]
    params = {**plan.params, "head.weight": dataclasses.replace(head, storage={"dp": "S(0)"})}
    return dataclasses.replace(plan, params=params)


def cluster(world: int) -> Cluster:
    """The cluster every case is planned for: the 4-CPU gloo profile with ``world`` devices."""
    base = Cluster.load(ROOT / "costmodels" / "cpu-gloo-4.json")
    return dataclasses.replace(base, devices_per_node=world, name=f"cpu-gloo-{world}")


def baseline_plan(dp: int, tp: int, pp: int = 1, **options: Any) -> Callable[[Workload], Plan]:
    """`autoplan.baseline`'s plan (Megatron tp, dp, ZeRO) with these degrees, on 4 devices."""
    return lambda w: w.baseline(cluster(4), dp=dp, tp=tp, pp=pp, **options)


def own(mesh: Mesh = None) -> Callable[[Workload], PlanOptions]:
    # the planner's one-stage plan (its pipelines are the cases of `pipeline`)
    return lambda w: PlanOptions(mesh_shape=mesh, pipeline=False)


def pipeline(
    stages: int,
    microbatches: int,
    schedule: str = "1F1B",
    mesh: Mesh = None,
    virtual_stages: int | None = None,
) -> Callable[[Workload], PlanOptions]:
    options = PlanOptions(
        num_stages=stages,
        num_microbatches=microbatches,
        schedule=schedule,
        mesh_shape=mesh,
        virtual_stages=virtual_stages,
    )
    return lambda w: options


def recomputed(
    layout: Callable[[Workload], PlanOptions | Plan], mode: str = "full"
) -> Callable[[Workload], PlanOptions | Plan]:
    """``layout``'s options with every layer recomputed in backward in ``mode``."""

    def options(w: Workload) -> PlanOptions | Plan:
        found = layout(w)
        assert isinstance(found, PlanOptions)
        return dataclasses.replace(found, recompute=mode)

    return options


MLP_SMALL_BATCH = {"batch_size": 8, "hidden": 64}
MLP_LARGE_BATCH = {"batch_size": 64, "hidden": 32}
# the zoo's models trained as planned; mistral, gemma2, gemma3, deepseek-v3 and the sweep's
# (tests/models/zoo.py: SWEPT) with the cache they build in forward (use_cache at its default);
# torchtitan's Llama 3 and DeepSeek-V3, its mixture of experts counting tokens in forward
ZOO = (
    *("gpt2", "llama", "bert", "bart", "vit", "cnn", "mistral", "gemma2", "gemma3", "deepseek-v3"),
    *SWEPT,
    *SWEPT_IMAGES,
    *TORCHTITAN,
)
# their planned step checked on fake tensors first: the models whose first step used to fail
# inside the executor (a cache built in forward, a functional copy's derivative, a buffer
# written in forward); tests/test_dry_run.py checks the others' layouts alone
CHECKED = ("mistral", "gemma3", "deepseek-v3", "torchtitan-deepseek-v3")
# torchtitan's MoE computes its experts in bf16: one process and the split batch of the
# planner's plan (experts replicated, each rank's tokens routed) differ in their gradients by
# 2-4e-3 of their norm, as one process differs from itself summing the batch's quarters' (2.3e-3)
BF16_INSIDE = ("torchtitan-deepseek-v3",)
# Swin's windowed blocks make the 2-D mesh's ILP a minute's solve: planned on one axis
PINNED: dict[str, Mesh] = {"swin": (4,)}
GPT = {"size": "small", "num_layers": 2, "batch_size": 4, "seq_len": 64}
GPT_FUSED = {**GPT, "qkv": "fused"}  # one qkv projection, split strided
GPT_CP = {"size": "tiny", "num_layers": 2, "batch_size": 1, "seq_len": 512, "num_heads": 1}
BF16 = PlanOptions(mixed_precision="bf16")
BF16_FP32 = PlanOptions(mixed_precision="bf16", reduce_dtype="fp32")

# mlp-own's seed: with seed 0, one ReLU input at the third step is 1.8e-8 in one process,
# within float32 rounding of zero. The parallel run, summing in another order, finds it
# negative; that unit's gradients then differ by their whole value, and Adam makes of it a
# step of ~lr (1.2e-4, past the tolerance) under the fused kernel; by luck not under foreach.
# A tie, not an error: seeds 1-3, and seed 0 at four other learning rates, end within 4e-7.
CASES = [
    Case("mlp-own", "mlp", {"batch_size": 4, "hidden": 1024, "seed": 1}, own((4,))),
    Case("mlp-dp", "mlp", MLP_LARGE_BATCH, lambda w: data_parallel(w, (4,))),
    Case("mlp-tp", "mlp", MLP_SMALL_BATCH, lambda w: mlp_megatron(w, (4,))),
    Case("mlp-2x2", "mlp", {"batch_size": 256, "hidden": 256}, own((2, 2))),
    Case("mlp-zero3", "mlp", MLP_LARGE_BATCH, lambda w: zero3(w, (4,))),
    # data parallel on both axes: each gradient bucket is all-reduced along both
    Case("mlp-dp-2x2", "mlp", MLP_LARGE_BATCH, dp_2x2),
    # frozen before planning: no gradient, no bucket slot, no update
    Case(
        "mlp-dp-frozen",
        "mlp",
        MLP_LARGE_BATCH,
        lambda w: data_parallel(w, (4,)),
        frozen=("layers.0.weight",),
    ),
    # clipping reads the gradients that buckets (data parallel) and local leaves (column
    # splits) give back, and DTensor's (row splits)
    Case(
        "mlp-dp-clip",
        "mlp",
        MLP_LARGE_BATCH,
        lambda w: data_parallel(w, (4,)),
        4,
        0.05,
    ),
    Case(
        "mlp-tp-clip",
        "mlp",
        MLP_SMALL_BATCH,
        lambda w: mlp_megatron(w, (4,)),
        4,
        0.05,
    ),
    Case("gpt-own", "gpt", {**GPT, "batch_size": 2, "seq_len": 256}, own()),
    Case("gpt-dp", "gpt", GPT, lambda w: data_parallel(w, (4,))),
    Case("gpt-tp", "gpt", GPT, lambda w: gpt_megatron(w, (4,))),
    Case("gpt-fused-tp", "gpt", GPT_FUSED, lambda w: gpt_megatron(w, (4,))),
    # the embedding, the head and the loss split along the vocabulary (Megatron's); at a
    # vocabulary of 8192 the loss on the logits' shards beats gathering them
    Case(
        "gpt-vocab-tp",
        "gpt",
        {**GPT, "vocab_size": 8192},
        lambda w: gpt_vocab_parallel(w, (4,)),
    ),
    Case("gpt-2x2", "gpt", {**GPT, "batch_size": 8}, own((2, 2))),
    Case("gpt-zero3", "gpt", GPT, lambda w: zero3(w, (4,))),
    # one head, one sequence of 512 tokens: the planner splits attention along the sequence
    # (context parallelism), each rank's causal block of queries against the gathered keys
    Case("gpt-cp-own", "gpt", GPT_CP, own(), context_parallel=True),
    # the conventional context parallelism: every op split along the sequence on cp, alone,
    # beside data parallelism, and beside Megatron's heads split on tp
    *[
        Case(
            f"gpt-baseline-{name}", "gpt", GPT, baseline_plan(dp, tp, cp=cp), context_parallel=True
        )
        for name, dp, tp, cp in (("cp", 1, 1, 4), ("cp-dp", 2, 1, 2), ("cp-tp", 1, 2, 2))
    ],
    # two sequences on 4 cp ranks: the flattened tokens' loss cannot follow the sequence's
    # split; the logits move to a split of the vocabulary, the targets gathered
    Case(
        "gpt-baseline-cp-2-sequences",
        "gpt",
        {**GPT, "batch_size": 2},
        baseline_plan(1, 1, cp=4),
        context_parallel=True,
    ),
    # a hand edit: its gather, reduce-scatter and bucket derived from the placements
    Case("gpt-dp-edited", "gpt", GPT, head_stored_split),
    Case("mlp-dp-2", "mlp", MLP_LARGE_BATCH, lambda w: data_parallel(w, (2,)), 2),
    Case("mlp-tp-2", "mlp", MLP_SMALL_BATCH, lambda w: mlp_megatron(w, (2,)), 2),
    Case("gpt-tp-2", "gpt", GPT, lambda w: gpt_megatron(w, (2,)), 2),
    Case("gpt-baseline-2x2", "gpt", {**GPT, "batch_size": 8}, baseline_plan(dp=2, tp=2)),
    Case("gpt-baseline-tp", "gpt", GPT, baseline_plan(dp=1, tp=4)),
    Case("gpt-baseline-sp", "gpt", GPT, baseline_plan(dp=1, tp=4, sequence_parallel=True)),
    Case("gpt-fused-baseline-tp", "gpt", GPT_FUSED, baseline_plan(dp=1, tp=4)),
    Case(
        "gpt-fused-baseline-sp-2x2",
        "gpt",
        GPT_FUSED,
        baseline_plan(dp=2, tp=2, sequence_parallel=True),
    ),
    # ZeRO-3 on dp beside the strided split on tp: the qkv weight stored (S(1), S(0)x3)
    Case("gpt-fused-baseline-zero3-2x2", "gpt", GPT_FUSED, baseline_plan(dp=2, tp=2, zero_stage=3)),
    Case("gpt-baseline-sp-2x2", "gpt", GPT, baseline_plan(dp=2, tp=2, sequence_parallel=True)),
    Case("mlp-baseline-zero3", "mlp", MLP_LARGE_BATCH, baseline_plan(dp=4, tp=1, zero_stage=3)),
    Case(
        "gpt-pipeline-2x2",
        "gpt",
        GPT,
        pipeline(stages=2, microbatches=2, mesh=(2,)),
        pipelined=True,
    ),
    Case(
        "mlp-pipeline-2x2",
        "mlp",
        MLP_LARGE_BATCH,
        pipeline(stages=2, microbatches=4, mesh=(2,)),
        pipelined=True,
    ),
    # middle stages: they receive and send, and pass the target through untouched
    Case(
        "mlp-pipeline-4", "mlp", MLP_LARGE_BATCH, pipeline(stages=4, microbatches=4), pipelined=True
    ),
    Case(
        "gpt-gpipe-2",
        "gpt",
        GPT,
        pipeline(stages=2, microbatches=2, schedule="GPipe"),
        2,
        pipelined=True,
    ),
    # one microbatch: the stages take turns (what the planner picks on ranks sharing cores)
    Case(
        "mlp-gpipe-1-2x2",
        "mlp",
        MLP_LARGE_BATCH,
        pipeline(stages=2, microbatches=1, schedule="GPipe", mesh=(2,)),
        pipelined=True,
    ),
    Case("gpt-1f1b-2", "gpt", GPT, pipeline(stages=2, microbatches=4), 2, pipelined=True),
    Case(
        "gpt-1f1b-2-clip", "gpt", GPT, pipeline(stages=2, microbatches=4), 2, 0.05, pipelined=True
    ),
    # dtype casts, a lifted constant and an op without a sharding rule (tests/models/casts.py)
    Case("casts-dp", "casts", {}, lambda w: data_parallel(w, (4,))),
    # mixtures of experts (examples/moe.py): top-1 and top-2 routing, einsums, cumsum
    Case("moe-own", "moe", {"batch_size": 64}, own()),
    Case("moe-top2-ep", "moe", {"size": "tiny-top2", "batch_size": 16}, expert_parallel),
    Case("moe-baseline-ep", "moe", {"batch_size": 16}, baseline_plan(dp=4, tp=1, ep=4)),
    # 2 stages of (2,): the first sends on its layer's load-balancing loss, a scalar, whole
    Case(
        "moe-pipeline-2x2",
        "moe",
        {"batch_size": 16},
        pipeline(stages=2, microbatches=2, mesh=(2,)),
        pipelined=True,
    ),
    # 4 stages: the layers' load-balancing losses cross every boundary after their own, and
    # the stages of one structure share their ILP (received scalars copies of each other)
    Case(
        "moe-pipeline-4", "moe", {"batch_size": 8, "num_layers": 4}, pipeline(4, 4), pipelined=True
    ),
    Case("moe-top2-2x2", "moe", {"size": "tiny-top2", "batch_size": 64}, own((2, 2))),
    # a mean-square loss by hand (aten.mean over the split batch: a partial sum)
    Case("mean-dp", "dropout", {"p": 0.0}, lambda w: data_parallel(w, (4,))),
    Case("mean-own", "dropout", {"p": 0.0}, own()),
    # no_grad and autocast(enabled=False) regions, inlined (tests/models/regions.py)
    Case("regions-dp", "regions", {}, lambda w: data_parallel(w, (4,))),
    # models nobody here wrote (tests/models/zoo.py), each with its own loss, as planned
    *[
        Case(
            f"zoo-{model}",
            "zoo",
            {"model": model, "batch_size": 64, "seq_len": 32},
            own(PINNED.get(model)),
            check_step=model in CHECKED,
            model_bf16=model in BF16_INSIDE,
        )
        for model in ZOO
    ],
    # the data-parallel baseline of models nobody here wrote: DDP's split of the batch
    *[
        Case(
            f"zoo-{model}-baseline-dp",
            "zoo",
            {"model": model, "batch_size": 64, "seq_len": 32},
            baseline_plan(dp=4, tp=1),
        )
        for model in ("gpt2", "llama", "mixtral")
    ],
    # Megatron's tensor parallelism of models nobody here wrote: the vocabulary split in the
    # embedding, the head and the loss (its targets shifted, the last ignored: -100); Gemma's
    # head tied to its embedding, the one weight split alike for both; attention split by
    # heads (their 2 key-value heads on tp=2, as Megatron's query groups; on tp=4 whole, as
    # Megatron and vLLM replicate them); GPT-2's fused Conv1D qkv strided; with sequence
    # parallelism, reduce-scatters and all-gathers
    *[
        Case(
            f"zoo-{model}-baseline-{name}",
            "zoo",
            {"model": model, "batch_size": 64, "seq_len": 32},
            baseline_plan(dp=dp, tp=tp, sequence_parallel=name.endswith("sp")),
        )
        for model, name, dp, tp in (
            ("llama", "2x2", 2, 2),
            ("llama", "2x2-sp", 2, 2),
            ("llama-gqa", "2x2", 2, 2),  # its 2 key-value heads unrepeated: one a rank
            # fewer key-value heads (2) than ranks: k and v computed whole, each rank reading
            # the head its query head needs (test_baseline counts the repeated heads' plan)
            ("llama-gqa", "tp", 1, 4),
            # Phi-3's one q|k|v linear sliced into unequal pieces (8 query heads, 2
            # key-value heads): stored "S(0)x4:1:1", each rank's share of each piece
            ("phi3-gqa", "2x2", 2, 2),
            ("gemma3", "2x2", 2, 2),
            ("gpt2", "tp", 1, 4),
            ("gpt2", "2x2-sp", 2, 2),
        )
    ],
    # expert parallelism of index-routed mixtures of experts nobody here wrote (Mixtral's and
    # Qwen3-MoE's 4 experts, one a rank; DeepSeek-V3's 8, two a rank, DeepSeek-V3's shared
    # expert a dense MLP beside them): each rank stores, updates and multiplies only its
    # experts, its grouped matmul's other rows zero, the partial sums reduced
    *[
        Case(
            f"zoo-{model}-baseline-ep",
            "zoo",
            {"model": model, "batch_size": 16, "seq_len": 16},
            baseline_plan(dp=4, tp=1, ep=4),
        )
        # torchtitan's own: its experts' offsets counted outside the routing (the routing map
        # summed over the tokens, partial), its products scatter-added into the tokens
        for model in ("mixtral", "qwen3-moe", "deepseek-v3", "torchtitan-deepseek-v3")
    ],
    # the experts split over 2 ranks (dp of a (2, 2) mesh), attention split by heads on tp
    Case(
        "zoo-mixtral-baseline-ep-2x2",
        "zoo",
        {"model": "mixtral", "batch_size": 16, "seq_len": 16},
        baseline_plan(dp=2, tp=2, ep=2),
    ),
    # torchtitan's Llama plan: Megatron's tensor parallelism with sequence parallelism and
    # the loss on the vocabulary's shards, FSDP over dp (parameters gathered, gradients
    # reduce-scattered)
    Case(
        "zoo-llama-baseline-torchtitan",
        "zoo",
        {"model": "llama", "batch_size": 64, "seq_len": 32},
        baseline_plan(dp=2, tp=2, style="torchtitan"),
    ),
    # the same plan of GPT-2: its fused qkv's bias, strided on tp, kept whole on dp
    Case(
        "zoo-gpt2-baseline-torchtitan",
        "zoo",
        {"model": "gpt2", "batch_size": 64, "seq_len": 32},
        baseline_plan(dp=2, tp=2, style="torchtitan"),
    ),
    # context parallelism of a model nobody here wrote: its causal mask split with the
    # queries, its keys joined to an empty cache
    Case(
        "zoo-llama-baseline-cp",
        "zoo",
        {"model": "llama", "batch_size": 64, "seq_len": 32},
        baseline_plan(dp=1, tp=1, cp=4),
        context_parallel=True,
    ),
    # the planner keeps ViT and the CNN on the flat mesh: forced onto (2, 2), as the others chose
    *[
        Case(
            f"zoo-{model}-2x2",
            "zoo",
            {"model": model, "batch_size": 64, "seq_len": 32},
            own((2, 2)),
        )
        for model in ("vit", "cnn")
    ],
    # batch norm in training: its statistics the whole batch's (all-reduced where the batch
    # is split, SyncBatchNorm's), its running statistics written back after forward; the
    # parameters compared include every buffer (running statistics, counters)
    Case("zoo-cnn-train", "zoo", {"model": "cnn-train", "batch_size": 64, "seq_len": 32}, own()),
    Case(
        "zoo-cnn-train-baseline-dp",
        "zoo",
        {"model": "cnn-train", "batch_size": 64, "seq_len": 32},
        baseline_plan(dp=4, tp=1),
    ),
    # counters written in forward (tests/models/counters.py): tokens per expert counted over
    # the split batch, each rank's count a partial sum all-reduced before it is written
    Case("counters-dp", "counters", {}, lambda w: data_parallel(w, (4,))),
    Case("counters-dp-2x2", "counters", {}, dp_2x2),
    # interleaved 1F1B: 2 device groups of (2,), each holding 2 stages (blocks 0 and 2, 1 and 3)
    Case(
        "gpt-interleaved-2x2",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 16},
        pipeline(2, 2, "Interleaved1F1B", (2,), virtual_stages=2),
        pipelined=True,
    ),
    # one microbatch: the planner prices and may choose such interleaved pipelines
    Case(
        "gpt-interleaved-1-microbatch",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 4},
        pipeline(2, 1, "Interleaved1F1B", (2,), virtual_stages=2),
        pipelined=True,
    ),
    # Llama of 4 layers: 2 device groups of (2,), 2 stages each, 4 microbatches
    Case(
        "zoo-llama-interleaved-2x2",
        "zoo",
        {"model": "llama", "num_layers": 4, "batch_size": 64, "seq_len": 32},
        pipeline(2, 4, "Interleaved1F1B", (2,), virtual_stages=2),
        pipelined=True,
    ),
    # zero bubble (torch's split backward: input gradients, then weight gradients): 4 stages
    # of one rank; 2 stages of (2,) (local leaves and DTensor parameters); and 2 stages on
    # each of 2 device groups
    Case(
        "gpt-zb-4",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 8},
        pipeline(4, 4, "ZeroBubble"),
        pipelined=True,
    ),
    Case(
        "gpt-zb-2x2",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 8},
        pipeline(2, 4, "ZeroBubble", (2,)),
        pipelined=True,
    ),
    Case(
        "gpt-zb-interleaved-2x2",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 8},
        pipeline(2, 2, "ZeroBubble", (2,), virtual_stages=2),
        pipelined=True,
    ),
    # ZBV (torch's ScheduleZBVZeroBubble): 2 stages on each device group in a V, the first
    # group holding the first and the last stage: 4 groups of one rank (8 stages; stages 3
    # and 4 pass on in place on rank 3), and 2 groups of (2,)
    Case(
        "gpt-zbv-4",
        "gpt",
        {"size": "tiny", "num_layers": 8, "batch_size": 8},
        pipeline(4, 4, "ZBV", virtual_stages=2),
        pipelined=True,
    ),
    Case(
        "gpt-zbv-2x2",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 8},
        pipeline(2, 4, "ZBV", (2,), virtual_stages=2),
        pipelined=True,
    ),
    # DualPipeV (torch's ScheduleDualPipeV): the same V, a microbatch or more a stage, one
    # microbatch's forward paired with another's whole backward
    Case(
        "gpt-dualpipev-4",
        "gpt",
        {"size": "tiny", "num_layers": 8, "batch_size": 8},
        pipeline(4, 8, "DualPipeV", virtual_stages=2),
        pipelined=True,
    ),
    Case(
        "gpt-dualpipev-2x2",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 8},
        pipeline(2, 4, "DualPipeV", (2,), virtual_stages=2),
        pipelined=True,
        check_step=True,  # its stages, in a V with the backward split, on fake tensors first
    ),
    # Megatron's interleaved split: blocks 0 and 2 on ranks 0-1, 1 and 3 on ranks 2-3
    Case(
        "gpt-baseline-interleaved-tp",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 4},
        baseline_plan(dp=1, tp=2, pp=2, virtual_stages=2),
        pipelined=True,
    ),
    # ZeRO-1 and ZeRO-2: the optimizer state (and gradient) split, the parameters whole
    Case("mlp-zero1", "mlp", MLP_LARGE_BATCH, zero12(1)),
    Case("mlp-zero2", "mlp", MLP_LARGE_BATCH, zero12(2)),
    # clipping reads the shards' gradients
    Case("mlp-zero1-clip", "mlp", MLP_LARGE_BATCH, zero12(1), 4, 0.05),
    Case("gpt-zero1", "gpt", GPT, zero12(1)),
    Case("gpt-zero2", "gpt", GPT, zero12(2)),
    # on (dp, tp): states split along dp beside tp's splits (a column weight's along dim 1)
    Case("gpt-baseline-zero1-2x2", "gpt", GPT, baseline_plan(dp=2, tp=2, zero_stage=1)),
    Case("gpt-baseline-zero2-2x2", "gpt", GPT, baseline_plan(dp=2, tp=2, zero_stage=2)),
    # a pipeline's stages update their shards and gather them after the step
    Case(
        "mlp-baseline-pipeline-zero2",
        "mlp",
        MLP_LARGE_BATCH,
        baseline_plan(dp=2, tp=1, pp=2, zero_stage=2, options=PlanOptions(num_microbatches=2)),
        pipelined=True,
        check_step=True,  # its stages (1F1B, ZeRO-2's shards) on fake tensors first
    ),
    # the same under ZeroBubble: the split backward's weight gradients go to ZeRO's wholes
    Case(
        "mlp-baseline-zb-zero2",
        "mlp",
        MLP_LARGE_BATCH,
        baseline_plan(
            dp=2,
            tp=1,
            pp=2,
            zero_stage=2,
            options=PlanOptions(num_microbatches=2, schedule="ZeroBubble"),
        ),
        pipelined=True,
    ),
    *[
        Case(
            f"zoo-llama-zero{stage}",
            "zoo",
            {"model": "llama", "batch_size": 64, "seq_len": 32},
            zero12(stage),
        )
        for stage in (1, 2)
    ],
    # every layer recomputed in backward (torch.utils.checkpoint): its forward collectives
    # issued again, as the plan lists them
    Case(
        "gpt-dp-recompute",
        "gpt",
        GPT,
        recomputed(lambda w: data_parallel(w, (4,))),
        recompute=("full",),
    ),
    Case(
        "gpt-tp-recompute",
        "gpt",
        GPT,
        recomputed(lambda w: gpt_megatron(w, (4,))),
        recompute=("full",),
        recompute_collectives=True,
    ),
    Case(
        "gpt-2x2-recompute",
        "gpt",
        {**GPT, "batch_size": 8},
        recomputed(own((2, 2))),
        recompute=("full",),
    ),
    # ZeRO-3 under torchtitan's op-level recomputation: a block's gathers issued ahead at its
    # region's start, in forward and again in backward (`checkpointed.gathers_ahead`)
    Case(
        "gpt-zero3-recompute-ops",
        "gpt",
        GPT,
        recomputed(lambda w: zero3(w, (4,)), "ops"),
        recompute=("ops",),
        recompute_collectives=True,
    ),
    Case(
        "mlp-tp-recompute",
        "mlp",
        MLP_SMALL_BATCH,
        recomputed(lambda w: mlp_megatron(w, (4,))),
        recompute=("full",),
        recompute_collectives=True,
    ),
    Case(
        "gpt-baseline-2x2-recompute",
        "gpt",
        {**GPT, "batch_size": 8},
        baseline_plan(dp=2, tp=2, recompute="full"),
        recompute=("full",),
    ),
    Case(
        "gpt-1f1b-2-recompute",
        "gpt",
        GPT,
        recomputed(pipeline(stages=2, microbatches=4)),
        2,
        recompute=("full",),
        pipelined=True,
    ),
    # recomputation chosen stage by stage: in 0.22% of a device's memory the first stage (2
    # microbatches in flight) recomputes its block, the last (1) does not
    Case(
        "gpt-1f1b-mixed-recompute",
        "gpt",
        GPT,
        lambda w: PlanOptions(num_stages=2, num_microbatches=4, memory_fraction=0.0022),
        recomputed=("blocks.0",),
        recompute=("full",),
        pipelined=True,
    ),
    # chosen by the one-stage ILP, layer by layer: in 0.7% of a device's memory neither
    # every attention core recomputed nor every layer fits (as the ILPs of those modes count
    # it), a mix of the two does
    Case(
        "gpt-eager-chosen-recompute",
        "gpt",
        {"size": "small", "num_layers": 3, "batch_size": 8, "seq_len": 128, "attention": "eager"},
        # 0.55% of a CPU rank's memory: every block recomputes, some fully, some selectively
        # (at 0.7%, since memory is counted as autograd saves it, none needs to)
        lambda w: PlanOptions(mesh_shape=(4,), memory_fraction=0.0055, pipeline=False),
        recomputed=("blocks.0", "blocks.1", "blocks.2"),
        recompute=("full", "selective"),
    ),
    *[
        Case(
            f"zoo-{model}-recompute",
            "zoo",
            {"model": model, "batch_size": 64, "seq_len": 32},
            recomputed(own()),
            recompute=("full",),
        )
        for model in ("llama", "bert")
    ],
    # torchtitan's op-level selective checkpointing: each block's ops but the attention and
    # every other linear recomputed, a block in one region under selective checkpointing
    Case(
        "zoo-llama-ops-recompute",
        "zoo",
        {"model": "llama", "batch_size": 64, "seq_len": 32},
        recomputed(own(), "ops"),
        recompute=("ops",),
    ),
    # only the attention cores recomputed: eager attention's ops from Q K^T to the product
    # with V (GPT's with its causal mask made between the scores and the softmax), or the
    # fused scaled_dot_product_attention (with its heads split under tp)
    Case(
        "zoo-gpt2-eager-selective-recompute",
        "zoo",
        {"model": "gpt2-eager", "batch_size": 64, "seq_len": 32},
        recomputed(own(), "selective"),
        recompute=("selective",),
    ),
    Case(
        "gpt-eager-tp-selective-recompute",
        "gpt",
        {**GPT, "attention": "eager"},
        recomputed(lambda w: gpt_megatron(w, (4,)), "selective"),
        recompute=("selective",),
    ),
    Case(
        "gpt-tp-selective-recompute",
        "gpt",
        GPT,
        recomputed(lambda w: gpt_megatron(w, (4,)), "selective"),
        recompute=("selective",),
    ),
    # two blocks per stage
    Case(
        "gpt-baseline-pipeline-tp",
        "gpt",
        {"size": "tiny", "num_layers": 4, "batch_size": 4},
        baseline_plan(dp=1, tp=2, pp=2),
        pipelined=True,
    ),
    # mixed precision (autoplan/precision.py), against one process under autocast: bf16
    # compute, float32 parameters and gradient reductions
    Case("mlp-dp-bf16", "mlp", MLP_LARGE_BATCH, lambda w: data_parallel(w, (4,)), precision="bf16"),
    Case("mlp-tp-bf16", "mlp", MLP_SMALL_BATCH, lambda w: mlp_megatron(w, (4,)), precision="bf16"),
    Case("gpt-tp-bf16", "gpt", GPT, lambda w: gpt_megatron(w, (4,)), precision="bf16"),
    Case("gpt-zero3-bf16", "gpt", GPT, lambda w: zero3(w, (4,)), precision="bf16"),
    # the weights gathered in bf16 after each update, waited for where forward reads them
    Case("gpt-zero1-bf16", "gpt", GPT, zero12(1), precision="bf16"),
    Case("gpt-2x2-bf16", "gpt", {**GPT, "batch_size": 8}, own((2, 2)), precision="bf16"),
    # the parameters cast to bf16 and every op in bf16 (FSDP2's param_dtype, Megatron's --bf16)
    Case(
        "gpt-2x2-bf16-params",
        "gpt",
        {**GPT, "batch_size": 8},
        own((2, 2)),
        precision="bf16-params",
    ),
    Case(
        "gpt-pipeline-2x2-bf16-params",
        "gpt",
        GPT,
        pipeline(stages=2, microbatches=2, mesh=(2,)),
        precision="bf16-params",
        pipelined=True,
    ),
    Case(
        "zoo-llama-zero3-bf16-params",
        "zoo",
        {"model": "llama", "batch_size": 64, "seq_len": 32},
        lambda w: zero3(w, (4,)),
        precision="bf16-params",
    ),
    Case(
        "gpt-baseline-sp-2x2-bf16",
        "gpt",
        GPT,
        baseline_plan(dp=2, tp=2, sequence_parallel=True, options=BF16),
        precision="bf16",
    ),
    Case(
        "gpt-pipeline-2x2-bf16",
        "gpt",
        GPT,
        pipeline(stages=2, microbatches=2, mesh=(2,)),
        precision="bf16",
        pipelined=True,
    ),
    *[
        Case(
            f"zoo-{model}-bf16",
            "zoo",
            {"model": model, "batch_size": 64, "seq_len": 32},
            own(),
            precision="bf16",
        )
        for model in ("llama", "vit")
    ],
    # every gradient reduced in float32 (PlanOptions.reduce_dtype): the weight copies
    # replicated, their gradients kept partial into the float32 buckets; Megatron's split
    # copies with their gradients partial along dp; a pipeline's stages
    Case(
        "gpt-2x2-bf16-fp32",
        "gpt",
        {**GPT, "batch_size": 8},
        own((2, 2)),
        precision="bf16",
        reduce_dtype="fp32",
    ),
    Case(
        "tied-dp-bf16-fp32",
        "tied",
        {"batch_size": 128, "seq_len": 16, "hidden": 128, "vocab": 512},
        lambda w: data_parallel(w, (4,)),
        precision="bf16",
        reduce_dtype="fp32",
    ),
    Case(
        "gpt-baseline-2x2-bf16-fp32",
        "gpt",
        GPT,
        baseline_plan(dp=2, tp=2, options=BF16_FP32),
        precision="bf16",
    ),
    Case(
        "gpt-pipeline-2x2-bf16-fp32",
        "gpt",
        GPT,
        pipeline(stages=2, microbatches=2, mesh=(2,)),
        precision="bf16",
        reduce_dtype="fp32",
        pipelined=True,
    ),
    # fp16 with loss scaling; from 2**22 the first step's gradients overflow: it is skipped
    # (no optimizer step) and the scale halved, as GradScaler does in one process
    Case("mlp-dp-fp16", "mlp", MLP_LARGE_BATCH, lambda w: data_parallel(w, (4,)), precision="fp16"),
    Case(
        "mlp-tp-fp16-overflow",
        "mlp",
        MLP_SMALL_BATCH,
        lambda w: mlp_megatron(w, (4,)),
        precision="fp16",
        init_scale=2.0**22,
    ),
    Case(
        "gpt-pipeline-2x2-fp16-overflow",
        "gpt",
        GPT,
        pipeline(stages=2, microbatches=2, mesh=(2,)),
        precision="fp16",
        init_scale=2.0**22,
        pipelined=True,
    ),
]

"""Training configurations whose throughput was published on named hardware, as data: the
model's dimensions, the batch, the parallel degrees, recomputation, the hardware and the
published figure, each with the file and the row it was read from. `benchmarks/published.py`
prices them.

Only what the source states is written as its figure; what a row had to assume (a
microbatch size the source leaves out) is said in its ``assumed``. Rows whose run used what
the cost model does not price (Float8 matmuls) keep ``comparable=False``: they are shown, not
counted in the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autoplan.modes import RecomputeMode

TORCHTITAN_2412 = (
    "https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
    "benchmarks/llama3_h100_202412_torchtitan.md"
)
TORCHTITAN_ASYNC_TP = (
    "https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
    "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
)
MEGATRON_H100 = (
    "https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c/README.md and images/model_table.png"
    " (Megatron-Core r0.8.0, 2024-07)"
)
# torchtitan's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s, 500 W (its "Hardware" section);
# their peak FLOP/s is "between SXM and NVL" and not known (its footnote 2)
GRAND_TETON = "H100 96GB HBM2e, 500 W (Grand Teton), 400 Gb/s RDMA per GPU"
GRAND_TETON_MEMORY_BYTES = 96 * 10**9
GRAND_TETON_BANDWIDTH = 2.4e12
# torchtitan's and Megatron's TP shard the norms along the sequence (sequence parallelism);
# autoplan's baseline cannot place it with fused attention (F.scaled_dot_product_attention):
# an AutoplanError that the attention splits its batch on both mesh axes. These rows are
# priced without it (the same bytes: one all-reduce in place of a reduce-scatter and an
# all-gather; the norms computed whole on each tp rank)
NO_SP = "TP without sequence parallelism, which the run had (the baseline cannot place it)"
# Megatron's distributed optimizer reduce-scatters the gradients (its contiguous buffer, after
# backward; with --overlap-grad-reduce bucket by bucket during it) and all-gathers the updated
# parameters (https://github.com/NVIDIA/Megatron-LM/blob/main/docs/source/api-guide/
# dist_optimizer.md, "Key steps"): the collectives of autoplan's ZeRO-2, which reduce-scatters
# each gradient as backward makes it. autoplan's ZeRO-1 all-reduces them whole instead (twice
# the bytes). Megatron keeps the whole gradient buffer, so its memory is ZeRO-1's: the memory
# column counts ZeRO-2's shard of the gradients, less than the run held
MEGATRON_ZERO = 2
DGX_H100 = "H100 SXM (NVIDIA's clusters, unnamed in the README)"


@dataclass(frozen=True)
class Model:
    """A decoder's dimensions. ``kind`` "llama": transformers' LlamaForCausalLM (RMSNorm,
    SwiGLU, rotary, grouped-query attention); "gpt": examples/gpt.py (LayerNorm, GELU MLP,
    learned positions), as Megatron's GPT."""

    kind: Literal["llama", "gpt"]
    num_layers: int
    dim: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int


@dataclass(frozen=True)
class Published:
    """One published run and the figure read for it."""

    name: str
    source: str  # the file, the table and the row
    hardware: str
    cluster_file: str  # under costmodels/
    model: Model
    global_batch: int  # sequences per step
    micro_batch: int  # sequences per dp rank in one forward (the local batch unless pipelined)
    dp: int
    tp: int
    pp: int
    # 3: FSDP; 2: Megatron's distributed optimizer, whose collectives are ZeRO-2's (below)
    zero_stage: int
    sequence_parallel: bool
    recompute: RecomputeMode
    metric: Literal["tokens/s/GPU", "TFLOP/s/GPU"]
    published: float
    published_memory_gib: float | None = None
    grand_teton: bool = False  # price with torchtitan's hardware's memory and bandwidth
    comparable: bool = True  # False: the run used what the cost model does not price
    notes: str = ""  # what the run did that the baseline does not (torch.compile, overlap)
    assumed: str = ""  # what the source leaves out and this row had to choose

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        """Forward passes per step on each dp rank (gradient accumulation or pipelining)."""
        return self.global_batch // (self.dp * self.micro_batch)


def llama3_ffn_dim(dim: int, multiplier: float, multiple_of: int) -> int:
    """torchtitan's FeedForward hidden size (torchtitan/models/llama/model.py at 9dec370)."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# torchtitan/models/llama/__init__.py at 9dec370 (the commit the 2024-12 benchmark names);
# vocabulary: Llama 3's tokenizer (128,000 + 256 special tokens); seq_len 8192: its
# train_configs/llama3_*.toml
LLAMA3_8B = Model("llama", 32, 4096, 32, 8, llama3_ffn_dim(4096, 1.3, 1024), 128256, 8192)
LLAMA3_70B = Model("llama", 80, 8192, 64, 8, llama3_ffn_dim(8192, 1.3, 4096), 128256, 8192)
LLAMA3_405B = Model("llama", 126, 16384, 128, 8, llama3_ffn_dim(16384, 1.2, 4096), 128256, 8192)


def _megatron_gpt(layers: int, dim: int, heads: int) -> Model:
    # README: vocabulary 131,072, sequence 4,096; ffn 4 x hidden is Megatron's default
    # (megatron/training/arguments.py: ffn_hidden_size = 4 * hidden_size without --swiglu)
    return Model("gpt", layers, dim, heads, heads, 4 * dim, 131072, 4096)


def _megatron_row(
    size: str, heads: int, dim: int, layers: int, tp: int, pp: int, batch: int, tflops: float
) -> Published:
    return Published(
        name=f"megatron-gpt-{size.lower()}",
        source=f"{MEGATRON_H100}: row {size}",
        hardware=DGX_H100,
        cluster_file="h100-sxm-8.json",
        model=_megatron_gpt(layers, dim, heads),
        global_batch=batch,
        micro_batch=1,
        dp=48,
        tp=tp,
        pp=pp,
        zero_stage=MEGATRON_ZERO,
        sequence_parallel=False,
        recompute=RecomputeMode.NONE,
        metric="TFLOP/s/GPU",
        published=tflops,
        notes="overlaps DP, TP (--tp-comm-overlap) and PP communication with compute",
        assumed="microbatch 1, 1F1B without interleaving, no recomputation (not stated); "
        "distributed optimizer, which --overlap-param-gather requires, as ZeRO-2 (its "
        "collectives; MEGATRON_ZERO); bf16 (MFU is "
        "against the bf16 dense peak)" + f"; {NO_SP}" * (tp > 1),
    )


CONFIGS: tuple[Published, ...] = (
    Published(
        name="torchtitan-llama3-8b-fsdp8",
        source=f"{TORCHTITAN_2412}: table 1, row FSDP",
        hardware=GRAND_TETON,
        cluster_file="h100-sxm-8.json",
        model=LLAMA3_8B,
        global_batch=16,
        micro_batch=2,
        dp=8,
        tp=1,
        pp=1,
        zero_stage=3,
        sequence_parallel=False,
        recompute=RecomputeMode.OPS,
        metric="tokens/s/GPU",
        published=5762,
        published_memory_gib=82.4,
        grand_teton=True,
        notes="op-level AC (torch's selective checkpointing, one region a block)",
    ),
    Published(
        name="torchtitan-llama3-8b-fsdp128",
        source=f"{TORCHTITAN_2412}: table 3, row FSDP",
        hardware=GRAND_TETON,
        cluster_file="h100-sxm-8.json",
        model=LLAMA3_8B,
        global_batch=256,
        micro_batch=2,
        dp=128,
        tp=1,
        pp=1,
        zero_stage=3,
        sequence_parallel=False,
        recompute=RecomputeMode.OPS,
        metric="tokens/s/GPU",
        published=5605,
        published_memory_gib=67.0,
        grand_teton=True,
        notes="op-level AC (torch's selective checkpointing, one region a block)",
    ),
    Published(
        name="torchtitan-llama3-8b-fsdp8-tp8",
        source=f"{TORCHTITAN_ASYNC_TP}: Llama3 8b on 64 H100s, row None (bfloat16), "
        "column Vanilla TP",
        hardware=GRAND_TETON,
        cluster_file="h100-sxm-8.json",
        model=LLAMA3_8B,
        global_batch=96,
        micro_batch=12,
        dp=8,
        tp=8,
        pp=1,
        zero_stage=3,
        sequence_parallel=False,
        recompute=RecomputeMode.OPS,
        metric="tokens/s/GPU",
        published=4378,
        grand_teton=True,
        notes="torch.compile; op-level AC (one region a block)",
        assumed=f"the table's 'tokens/sec' read per GPU (torchtitan logs TPS per GPU); {NO_SP}",
    ),
    Published(
        name="torchtitan-llama3-70b-fsdp32-tp8",
        source=f"{TORCHTITAN_ASYNC_TP}: Llama3 70b on 256 H100s, row None (bfloat16), "
        "column Vanilla TP",
        hardware=GRAND_TETON,
        cluster_file="h100-sxm-8.json",
        model=LLAMA3_70B,
        global_batch=512,
        micro_batch=16,
        dp=32,
        tp=8,
        pp=1,
        zero_stage=3,
        sequence_parallel=False,
        recompute=RecomputeMode.FULL,
        metric="tokens/s/GPU",
        published=597.3,
        grand_teton=True,
        notes="torch.compile",
        assumed=f"the table's 'tokens/sec' read per GPU (torchtitan logs TPS per GPU); {NO_SP}",
    ),
    Published(
        name="torchtitan-llama3-70b-fsdp32-tp8-float8",
        source=f"{TORCHTITAN_2412}: table 4, row 2D",
        hardware=GRAND_TETON,
        cluster_file="h100-sxm-8.json",
        model=LLAMA3_70B,
        global_batch=512,
        micro_batch=16,
        dp=32,
        tp=8,
        pp=1,
        zero_stage=3,
        sequence_parallel=False,
        recompute=RecomputeMode.FULL,
        metric="tokens/s/GPU",
        published=829,
        published_memory_gib=71.9,
        grand_teton=True,
        comparable=False,
        notes="Float8 linears and torch.compile; priced in bf16",
        assumed=NO_SP,
    ),
    Published(
        name="torchtitan-llama3-405b-3d-1f1b-float8",
        source=f"{TORCHTITAN_2412}: table 5, row 1F1B",
        hardware=GRAND_TETON,
        cluster_file="h100-sxm-8.json",
        model=LLAMA3_405B,
        global_batch=256,
        micro_batch=4,
        dp=8,
        tp=8,
        pp=8,
        zero_stage=3,
        sequence_parallel=False,
        recompute=RecomputeMode.FULL,
        metric="tokens/s/GPU",
        published=100,
        published_memory_gib=82.5,
        grand_teton=True,
        comparable=False,
        notes="Float8 linears, torch.compile and async TP; priced in bf16",
        assumed="8 microbatches of 4 (torchtitan's default: as many microbatches as stages); "
        + NO_SP,
    ),
    _megatron_row("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
    _megatron_row("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
    _megatron_row("16B", 48, 6144, 32, 4, 1, 192, 489.1),
    _megatron_row("32B", 56, 7168, 48, 8, 1, 192, 459.6),
    _megatron_row("70B", 64, 8192, 84, 8, 2, 384, 419.7),
    _megatron_row("119B", 80, 10240, 92, 8, 4, 768, 420.5),
    _megatron_row("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    _megatron_row("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
    _megatron_row("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
)


def megatron_flops(model: Model, batch: int) -> float:
    """FLOPs of one step as Megatron counts them for its TFLOP/s per GPU
    (megatron/training/training.py ``num_floating_point_operations`` at f2e5db402c: forward
    and backward, no recomputation, attention's full s x s; grouped-query attention and
    SwiGLU as it counts them)."""
    gated = 1.5 if model.kind == "llama" else 1.0
    h, s = model.dim, model.seq_len
    attention = 1 + model.num_kv_heads / model.num_heads + s / h
    mlp = model.ffn_dim / h * gated
    logits = model.vocab_size / (2 * model.num_layers * h)
    return 12 * batch * s * model.num_layers * h * h * (attention + mlp + logits)

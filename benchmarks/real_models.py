"""Models at their published sizes, from transformers' own classes, for planning on the meta
device (nothing is downloaded; weights are never materialised):

- llama3-8b, llama3-70b, llama3-405b: Llama 3 / 3.1 (grouped-query attention, 128K vocabulary).
- qwen2.5-7b: Qwen2.5-7B (28 layers, biased q/k/v projections, 152K vocabulary).
- mixtral-8x7b: Mixtral 8x7B (8 experts, top 2, in every layer).
- deepseek-v3: DeepSeek-V3's sizes (61 layers, the first 3 dense, 256 routed experts of which
  8 are used and one shared expert, multi-head latent attention; no multi-token prediction).

The dimensions are those of each model's published config.json. Called as users call a
causal LM: ``model(input_ids=ids, labels=ids)``.

    autoplan plan benchmarks/real_models.py --cluster costmodels/dgx-a100-80gb.json \\
        --nodes 8 --set model=qwen2.5-7b --set batch_size=64 --mixed-precision bf16
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoplan import Workload
from autoplan.errors import AutoplanError

try:
    import transformers
except ImportError as e:  # an optional dependency of these benchmarks alone
    raise AutoplanError("benchmarks/real_models.py needs transformers") from e


def _llama(layers: int, dim: int, ffn: int, heads: int) -> Callable[[], Any]:
    def config() -> Any:
        return transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=dim, intermediate_size=ffn,
            num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
            rope_theta=500000.0, max_position_embeddings=8192,
        )  # fmt: skip

    return config


def _qwen() -> Any:
    return transformers.Qwen2Config(
        num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        rope_theta=1000000.0,
    )  # fmt: skip


def _mixtral() -> Any:
    return transformers.MixtralConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1000000.0,
    )  # fmt: skip


def _deepseek_v3() -> Any:
    return transformers.DeepseekV3Config(
        num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        max_position_embeddings=4096,
    )  # fmt: skip


MODELS: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.nn.Module]]] = {
    "llama3-8b": (_llama(32, 4096, 14336, 32), transformers.LlamaForCausalLM),
    "llama3-70b": (_llama(80, 8192, 28672, 64), transformers.LlamaForCausalLM),
    "llama3-405b": (_llama(126, 16384, 53248, 128), transformers.LlamaForCausalLM),
    "qwen2.5-7b": (_qwen, transformers.Qwen2ForCausalLM),
    "mixtral-8x7b": (_mixtral, transformers.MixtralForCausalLM),
    "deepseek-v3": (_deepseek_v3, transformers.DeepseekV3ForCausalLM),
}


def workload(
    model: str = "llama3-8b",
    batch_size: int = 64,
    seq_len: int = 2048,
    dtype: str = "float32",
    device: str = "meta",
) -> Workload:
    if model not in MODELS:
        raise AutoplanError(f"model {model!r} is not known; use one of {', '.join(MODELS)}")
    make_config, make_model = MODELS[model]
    config = make_config()
    with torch.device(device):
        built = make_model(config).to(getattr(torch, dtype))
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
    return Workload(built, {"input_ids": ids, "labels": ids})

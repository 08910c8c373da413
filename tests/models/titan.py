"""torchtitan's models (torchtitan 0.3.0, the test extra's pin), nobody here wrote them: its
language-model families built by torchtitan's own layer builders with its initializations,
at tiny widths, on the CPU.

- llama3: torchtitan's debug flavor's layout (fused q|k|v projection, complex rotary
  embeddings with Llama 3's frequency scaling, SwiGLU widths rounded as torchtitan rounds
  them), with grouped-query attention (2 key-value heads) as its larger flavors.
- deepseek-v3: its debug flavor's layout: multi-head latent attention (queries without a
  low-rank step, YaRN rotary scaling), one dense layer and then a mixture of experts (softmax
  router, top 3 of 8 experts, 2 shared, experts computed in bfloat16 by ``torch._grouped_mm``
  as torchtitan computes them) that counts its tokens per expert in forward (a buffer).
  Its load-balancing bias stays 0: torchtitan moves it in an optimizer hook of its trainer
  (``register_moe_load_balancing_hook``), which is no part of the model.
- qwen3: its debug flavor's layout: grouped-query attention with RMS-normed queries and keys
  (``qk_norm``), cosine-sine rotary embeddings, the output head tied to the embedding.
- qwen3-moe: its MoE debug flavor's: the same attention, every layer a mixture of experts
  (softmax router over 8 experts, top 2, renormalized; no shared expert).
Not built here: gpt-oss, whose attention sinks rescale attention by the log-sum-exp that
only FlexAttention (with block masks the trainer makes) or varlen attention (GPUs) return
(FlexAttention's log-sum-exp is planned; gpt-oss is not yet built); Kimi K2.5's, Muse
Glimmer's and Qwen3.5's, multimodal (their decoders beside vision encoders; Kimi's decoder
is DeepSeek-V3's); Flux, a diffusion model.

Attention is scaled dot-product attention, torchtitan's causal ``ScaledDotProductAttention``,
or, for a model named with "-flex" after it, torchtitan's default: its ``FlexAttention``
(compiled in torchtitan; traced and run uncompiled here, autoplan/torch_private/flex_op.py)
with the causal document mask its trainer makes (`WithMasks`). Every other module is
torchtitan's. The loss is torchtitan's:
cross-entropy over the flattened logits, in float32, averaged over the tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models import deepseek_v3, llama3, qwen3
from torchtitan.models.common import (
    ComplexRoPE,
    CosSinRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.attention import ScaledDotProductAttention

from autoplan import Workload

VOCAB, DIM, HEADS = 128, 64, 4


def _attention(layers: list[Any], flex: bool) -> list[Any]:
    """The layers' configs with scaled dot-product attention for FlexAttention, unless
    ``flex``."""
    for layer in layers if not flex else ():
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


class WithMasks(nn.Module):
    """torchtitan's model with FlexAttention, called as its trainer calls it: the block mask
    made by the model's ``get_attention_masks`` from the tokens' positions (causal within a
    document; one document a sequence, positions 0, 1, ...), then ``model(tokens,
    attention_masks=...)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        masks = self.model.get_attention_masks(positions)  # type: ignore[operator]
        return self.model(tokens, attention_masks=masks)  # type: ignore[no-any-return]


def _head(config: type, init: Any, dim: int = DIM, **fields: Any) -> Any:
    """A model config of ``config``'s class: embedding, final norm and output head as
    torchtitan's flavors make them (``init``: the flavor's module of initializations; its
    output head's, or its linears' where it has none of its own)."""
    output = getattr(init, "_output_linear_init", None)
    return config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=init._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=init._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim,
            out_features=VOCAB,
            param_init=output(dim) if output else init._LINEAR_INIT,
        ),
        **fields,
    )


def llama3_model(seq: int, layers: int, flex: bool = False) -> nn.Module:
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=seq, theta=500000, scaling="llama")
    blocks = llama3._build_llama3_layers(
        n_layers=layers, dim=DIM, n_heads=HEADS, n_kv_heads=2, rope=rope, attn_backend="flex",
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
    )  # fmt: skip
    return _build(_head(llama3.Llama3Model.Config, llama3, layers=_attention(blocks, flex)))


def deepseek_v3_model(seq: int, layers: int, flex: bool = False) -> nn.Module:
    rope_dim = 8
    rope = ComplexRoPE.Config(
        dim=rope_dim, max_seq_len=seq, theta=10000.0, scaling="yarn", rope_factor=40.0,
        beta_fast=32.0, beta_slow=1.0, original_seq_len=seq // 4,
    )  # fmt: skip
    blocks = deepseek_v3._build_dsv3_layers(
        n_layers=layers, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16,
        mscale=0.70, dense_hidden_dim=128, moe_hidden_dim=32, num_experts=8,
        num_shared_experts=2, router_top_k=3, router_score_func="softmax", rope=rope,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
    )  # fmt: skip
    config = _head(deepseek_v3.DeepSeekV3Model.Config, deepseek_v3, layers=_attention(blocks, flex))
    return _build(config)


def _qwen3_rope(seq: int, dim: int = DIM) -> Any:
    return CosSinRoPE.Config(dim=dim // HEADS, max_seq_len=seq, theta=1000000.0)


def qwen3_model(seq: int, layers: int, flex: bool = False) -> nn.Module:
    blocks = qwen3._build_qwen3_layers(
        n_layers=layers, dim=DIM, n_heads=HEADS, n_kv_heads=2, head_dim=DIM // HEADS,
        hidden_dim=128, attn_backend="flex", rope=_qwen3_rope(seq),
    )  # fmt: skip
    config = _head(
        qwen3.Qwen3Model.Config, qwen3, layers=_attention(blocks, flex), enable_weight_tying=True
    )
    return _build(config)


def qwen3_moe_model(
    seq: int, layers: int, flex: bool = False, *, dim: int = DIM, experts: int = 8,
    width: int = 32, top_k: int = 2,
) -> nn.Module:  # fmt: skip
    """torchtitan's Qwen3-MoE: ``experts`` of hidden ``width``, the top ``top_k`` a token."""
    blocks = qwen3._build_qwen3_moe_layers(
        n_layers=layers, dim=dim, n_heads=HEADS, n_kv_heads=2, head_dim=dim // HEADS,
        moe_hidden_dim=width, num_experts=experts, top_k=top_k, attn_backend="flex",
        moe_comm_backend="standard", rope=_qwen3_rope(seq, dim),
    )  # fmt: skip
    config = _head(qwen3.Qwen3Model.Config, qwen3, dim, layers=_attention(blocks, flex))
    return _build(config)


def _build(config: Any) -> nn.Module:
    """The model, its weights and buffers initialized as torchtitan's trainer does."""
    model: nn.Module = config.build()
    model.init_weights(buffer_device=None)  # type: ignore[operator]
    return model


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


MODELS = {
    "llama3": llama3_model,
    "deepseek-v3": deepseek_v3_model,
    "qwen3": qwen3_model,
    "qwen3-moe": qwen3_moe_model,
}


def workload(model: str, batch_size: int, seq_len: int, num_layers: int = 2) -> Workload:
    """torchtitan's ``model``, drawn from torch's generator as it stands, on token ids; the
    targets are the next tokens (the inputs shifted by one, as torchtitan's data loader).
    ``model`` with "-flex" after it: with torchtitan's own FlexAttention (`WithMasks`)."""
    name, flex = model.removesuffix("-flex"), model.endswith("-flex")
    if name not in MODELS:
        raise ValueError(f"torchtitan model {model!r} is not built here; use one of {list(MODELS)}")
    built: nn.Module = MODELS[name](seq_len, num_layers, flex)
    if flex:
        built = WithMasks(built)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return Workload(built, (tokens[:, :-1].clone(),), loss, tokens[:, 1:].clone())

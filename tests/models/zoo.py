"""Models nobody here wrote: Hugging Face transformers built from small configs with random
weights (nothing is downloaded), each computing its own loss as users call it. Dropout is off,
so that training can be compared with one process exactly.

- gpt2: tied embedding and head, Conv1D projections (addmm), labels shifted by padding.
- gpt2-eager: gpt2 with eager attention (softmax(Q K^T) V as separate ops, which selective
  recomputation recomputes), not scaled_dot_product_attention.
- gpt2-dropout: gpt2-eager with dropout (p 0.1) on its embeddings, residual branches and
  attention probabilities, to compare two parallel runs that draw alike (recomputation's),
  not one process.
- llama: grouped-query attention, rotary embeddings, RMSNorm, SwiGLU.
- llama-gqa: llama attending without a mask (``is_causal``, as torchtitan's Llama and
  training without padding do): transformers' sdpa then passes its 2 key-value heads to
  ``scaled_dot_product_attention`` unrepeated, ``enable_gqa=True``.
- phi3-gqa: Phi-3 (its q|k|v one linear, sliced into pieces of unequal widths) with 8
  query heads and 2 key-value heads.
- mistral: llama's blocks with sliding-window attention (window 8, shorter than the
  sequences).
- gemma2: sliding-window and global layers alternating, attention logits soft-capped, norms
  before and after each sublayer, embeddings scaled.
- gemma3: gemma2's layout with query and key norms and a local rotary base of its own.
- deepseek-v3: multi-head latent attention (low-rank queries and keys, rotary dims apart) and a
  mixture of experts (grouped top-k routing, one shared expert) after one dense layer.
  These four build a ``DynamicCache`` in forward (``use_cache`` left at its default, as users
  train them).
- qwen2, qwen3, gpt-neox, phi3, opt, mixtral, qwen3-moe, falcon, convnext, swin: the model
  sweep's tiny configs (benchmarks/model_sweep.py's `tiny_config`: depth, widths, heads,
  vocabulary and experts made small, dropout off, every other setting the model's default,
  ``use_cache`` included), with its inputs (token ids as labels, or 32-pixel images).
  mixtral and qwen3-moe are mixtures of 4 experts (top 2), routed by index: ``topk``,
  ``sort``, ``histc`` and transformers' grouped matmul of the experts' 3-dim weights.
- torchtitan-llama3, torchtitan-deepseek-v3: torchtitan's own models (tests/models/titan.py),
  called as torchtitan calls them: ``model(tokens)``, then its loss on the logits.
- bert: masked language model with an attention mask and token types.
- bart: encoder-decoder with cross-attention, decoder inputs shifted from the labels.
- vit: image classification from patches (a strided convolution).
- cnn: a plain convolutional classifier (convolutions, batch norm, pooling), not from
  transformers; its batch norms run in eval mode.
- cnn-train: the same, its batch norms in training mode: they normalize by the batch's
  statistics and update their running statistics (buffers written in forward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from autoplan import Workload
from benchmarks import model_sweep

VOCAB = 128
NO_DROPOUT = {"attention_dropout": 0.0}


def _gpt2(
    batch: int, seq: int, layers: int, dropout: float = 0.0, attention: str = "sdpa"
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=seq, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        attn_implementation=attention,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (batch, seq))
    return transformers.GPT2LMHeadModel(config), ("input_ids", "labels"), (ids, ids)


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


def _llama(
    batch: int, seq: int, layers: int, masked: bool = True
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=seq,
        bos_token_id=0, eos_token_id=0, **NO_DROPOUT,
    )  # fmt: skip
    if not masked:  # attention told is_causal, no mask: key-value heads passed unrepeated
        transformers.AttentionMaskInterface.register("unmasked_sdpa", _no_mask)
        transformers.AttentionInterface.register("unmasked_sdpa", sdpa_attention_forward)
        config._attn_implementation = "unmasked_sdpa"
    ids = torch.randint(0, VOCAB, (batch, seq))
    return transformers.LlamaForCausalLM(config), ("input_ids", "labels"), (ids, ids)


def _phi3(batch: int, seq: int, layers: int) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.Phi3Config(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=seq,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, **NO_DROPOUT,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (batch, seq))
    return transformers.Phi3ForCausalLM(config), ("input_ids", "labels"), (ids, ids)


def _causal(
    config: transformers.PretrainedConfig, model: type[nn.Module], batch: int, seq: int
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    ids = torch.randint(0, VOCAB, (batch, seq))
    return model(config), ("input_ids", "labels"), (ids, ids)


def _mistral(
    batch: int, seq: int, layers: int
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.MistralConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=seq, sliding_window=8,
        bos_token_id=0, eos_token_id=0, **NO_DROPOUT,
    )  # fmt: skip
    return _causal(config, transformers.MistralForCausalLM, batch, seq)


def _gemma2(
    batch: int, seq: int, layers: int
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.Gemma2Config(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=seq,
        sliding_window=8, bos_token_id=0, eos_token_id=0, pad_token_id=0, **NO_DROPOUT,
    )  # fmt: skip
    return _causal(config, transformers.Gemma2ForCausalLM, batch, seq)


def _gemma3(
    batch: int, seq: int, layers: int
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=seq,
        sliding_window=8, bos_token_id=0, eos_token_id=0, pad_token_id=0, **NO_DROPOUT,
    )  # fmt: skip
    return _causal(config, transformers.Gemma3ForCausalLM, batch, seq)


def _deepseek_v3(
    batch: int, seq: int, layers: int
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.DeepseekV3Config(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        vocab_size=VOCAB, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
        **NO_DROPOUT,
    )  # fmt: skip
    return _causal(config, transformers.DeepseekV3ForCausalLM, batch, seq)


def _bert(batch: int, seq: int, layers: int) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=seq, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (batch, seq))
    types = torch.randint(0, 2, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[:, -seq // 4 :] = 0  # padding at the end of every sequence
    labels = torch.where(torch.rand(batch, seq) < 0.25, ids, -100)  # masked positions only
    names = ("input_ids", "token_type_ids", "attention_mask", "labels")
    return transformers.BertForMaskedLM(config), names, (ids, types, mask, labels)


def _bart(batch: int, seq: int, layers: int) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.BartConfig(
        encoder_layers=layers, decoder_layers=layers, d_model=64, encoder_ffn_dim=128,
        decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=seq, dropout=0.0, activation_dropout=0.0,
        bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2,
        forced_eos_token_id=None, **NO_DROPOUT,
    )  # fmt: skip
    ids = torch.randint(3, VOCAB, (batch, seq))
    labels = torch.randint(3, VOCAB, (batch, seq))
    model = transformers.BartForConditionalGeneration(config)
    return model, ("input_ids", "labels"), (ids, labels)


def _vit(batch: int, seq: int, layers: int) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    config = transformers.ViTConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        image_size=32, patch_size=8, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    pixels = torch.randn(batch, 3, 32, 32)
    labels = torch.randint(0, 10, (batch,))
    model = transformers.ViTForImageClassification(config)
    return model, ("pixel_values", "labels"), (pixels, labels)


def _swept(
    model_type: str,
) -> Callable[[int, int, int], tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]]:
    """The model sweep's tiny model of ``model_type`` and its inputs."""

    def build(
        batch: int, seq: int, layers: int
    ) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
        if layers != 2:
            raise ValueError(f"the sweep's tiny {model_type} has 2 layers, not {layers}")
        w = model_sweep.tiny_workload(model_type, batch, seq)
        return w.model, tuple(w.example_inputs), tuple(w.example_inputs.values())

    return build


SWEPT = ("qwen2", "qwen3", "gpt-neox", "phi3", "opt", "mixtral", "qwen3-moe", "falcon")
SWEPT_IMAGES = ("convnext", "swin")


class SmallCNN(nn.Module):
    def __init__(self, classes: int, bias: bool = True) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.BatchNorm2d(8)
        self.conv2, self.norm2 = nn.Conv2d(8, 16, 3, padding=1, bias=bias), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(pixel_values))), 2)
        x = F.relu(self.norm2(self.conv2(x)))
        logits = self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _cnn(
    batch: int, seq: int, layers: int, train: bool = False
) -> tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]:
    """The CNN, its batch norms in eval mode, or in training mode (``train``: normalizing by
    the batch's statistics and updating their running averages)."""
    if layers != 2:
        raise ValueError(f"the CNN has its 2 convolutions, not {layers}")
    # in training a convolution's bias before batch norm cancels out: its gradient is 0 up
    # to rounding, which Adam would scale up to full steps (so CNNs leave it out)
    model = SmallCNN(classes=10, bias=not train)
    model.norm1.train(train)
    model.norm2.train(train)
    pixels = torch.randn(batch, 3, seq, seq)
    labels = torch.randint(0, 10, (batch,))
    return model, ("pixel_values", "labels"), (pixels, labels)


MODELS: dict[str, Callable[[int, int, int], tuple[nn.Module, tuple[str, ...], tuple[Any, ...]]]] = {
    "gpt2": _gpt2,
    "gpt2-eager": functools.partial(_gpt2, attention="eager"),
    "gpt2-dropout": functools.partial(_gpt2, dropout=0.1, attention="eager"),
    "llama": _llama,
    "llama-gqa": functools.partial(_llama, masked=False),
    "phi3-gqa": _phi3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "deepseek-v3": _deepseek_v3,
    "bert": _bert,
    "bart": _bart,
    "vit": _vit,
    "cnn": _cnn,
    "cnn-train": functools.partial(_cnn, train=True),
    **{name: _swept(name.replace("-", "_")) for name in SWEPT + SWEPT_IMAGES},
}


TORCHTITAN = ("torchtitan-llama3", "torchtitan-deepseek-v3")
NAMES = (*MODELS, *TORCHTITAN)


def workload(
    model: str = "gpt2", batch_size: int = 8, seq_len: int = 16, seed: int = 0, num_layers: int = 2
) -> Workload:
    if model not in NAMES:
        raise ValueError(f"model {model!r} is not in the zoo; use one of {sorted(NAMES)}")
    torch.manual_seed(seed)
    if model in TORCHTITAN:
        # imported here: torchtitan takes seconds to import, which every other model spares
        from tests.models import titan

        return titan.workload(model.removeprefix("torchtitan-"), batch_size, seq_len, num_layers)
    module, names, batch = MODELS[model](batch_size, seq_len, num_layers)
    # called as users call them, ``model(input_ids=..., labels=...)``: a ``ModelOutput`` whose
    # ``loss`` autoplan trains (no ``loss_fn``)
    return Workload(module, dict(zip(names, batch, strict=True)))

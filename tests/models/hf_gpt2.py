"""A GPT-2 from Hugging Face transformers, randomly initialised (nothing is downloaded), that
computes its own loss: tied embedding and head, Conv1D projections (addmm), a causal mask
made in forward, ``ignore_index=-100`` in the model's own cross-entropy. Dropout is off, so
that training can be compared with one process exactly."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from autoplan import Workload


class GPT2WithLoss(nn.Module):
    """``forward(ids)`` is the model's own language-modelling loss, as users write it."""

    def __init__(self, config: transformers.GPT2Config) -> None:
        super().__init__()
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def workload(
    batch_size: int = 8, seq_len: int = 16, num_layers: int = 2, dim: int = 64, seed: int = 0
) -> Workload:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=num_layers,
        n_embd=dim,
        n_head=4,
        vocab_size=128,
        n_positions=seq_len,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return Workload(GPT2WithLoss(config), (ids,))

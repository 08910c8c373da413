"""Vocabulary parallelism's local pieces (execute/vocab.py) against torch's own ops: the
embedding's shards sum to the lookup and their gradients are the weight's rows; the parallel
cross-entropy's arithmetic, on one piece of the vocabulary, is torch's. Across ranks (its
all-reduces) it is checked by the distributed case ``gpt-vocab-tp`` and the tp baselines."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoplan.execute.vocab import VocabShard, masked_embedding, vocab_parallel_cross_entropy


def test_masked_lookups_of_the_row_shards_sum_to_the_lookup() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([[0, 5, 7, 2], [5, 5, 3, 6]])
    whole = F.embedding(indices, weight, padding_idx=5)
    whole.backward(torch.ones_like(whole))
    shards = [weight.detach()[4 * i : 4 * i + 4].clone().requires_grad_() for i in range(2)]
    parts = [masked_embedding(w, indices, 5, VocabShard(4 * i, ())) for i, w in enumerate(shards)]
    assert torch.allclose(parts[0] + parts[1], whole)
    for part in parts:
        part.backward(torch.ones_like(part))
    assert weight.grad is not None
    grads = [s.grad for s in shards]
    assert grads[0] is not None and grads[1] is not None
    assert torch.allclose(torch.cat([grads[0], grads[1]]), weight.grad)
    assert grads[1][1].abs().sum() == 0  # the padding row (5) gets no gradient


def test_parallel_cross_entropy_on_one_piece_is_torchs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, 9, -100, 0, 4, 4])
    weight = torch.rand(10, dtype=torch.float64)
    expected = F.cross_entropy(logits, target, weight, reduction="none")
    found = vocab_parallel_cross_entropy(logits, target, weight, -100, VocabShard(0, ()))
    assert torch.allclose(found, expected)
    (grad,) = torch.autograd.grad(found.sum(), logits)
    (want,) = torch.autograd.grad(expected.sum(), logits)
    assert torch.allclose(grad, want)

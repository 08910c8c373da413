"""FlexAttention planned as attention: traced (torch_private/flex_op.py lets torch's check pass
while tracing), split by batch or heads like scaled dot-product attention and priced alike,
and run by the executor's local path on each rank's shards with its score_mod and mask_mod
given one process's indices (execute/flex_shards.py): the shards of the whole result and of its
gradients, for a score_mod that reads the head and a mask that reads the batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import autoplan
from autoplan.execute.flex_shards import local_flex_attention
from autoplan.graph.capture import capture
from autoplan.strategies.attention import flex_offsets
from autoplan.strategies.placement import R, shard
from autoplan.strategies.rules import own_rule
from autoplan.torch_private.flex_op import FLEX_ATTENTION, traced_flex_attention
from tests.models import flex_lm

B, H, S, E = 4, 4, 8, 8


def _alibi(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
           k: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return score - (h + 1) * 0.25 * (q - k)


def _written_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor
) -> torch.Tensor:
    """The attention of `_call` written out in float64 ops, none of them FlexAttention's."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    i, j = torch.arange(S).view(1, 1, S, 1), torch.arange(S).view(1, 1, 1, S)
    scores = scores - (h + 1) * 0.25 * (i - j)
    same = documents[:, None, :, None] == documents[:, None, None, :]
    return scores.masked_fill(~((i >= j) & same), -math.inf).softmax(-1) @ v


def _traced_call(documents: torch.Tensor) -> tuple[object, ...]:
    """The arguments of the operator a traced FlexAttention calls (its score_mod and the
    block mask's mask_mod, which reads ``documents`` of every sequence)."""

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return (q >= k) & (documents[b, q] == documents[b, k])

    mask = create_block_mask(same_document, B, None, S, S, device="cpu")
    return (_alibi, mask.as_tuple(), 1 / math.sqrt(E), {"OUTPUT_MAX": False}, (), ())


def test_torch_runs_flex_attention_with_gradients_on_the_cpu_only_as_we_let_it() -> None:
    """torch's limit: its function refuses a gradient on the CPU; its operator's dense
    implementation computes forward and backward exactly (against the attention written
    out, float64), and the function does too once its check lets it."""
    torch.manual_seed(0)
    q = torch.randn(B, H, S, E, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, S, E, dtype=torch.float64, requires_grad=True) for _ in "kv")
    documents = (torch.arange(S) >= torch.randint(1, S, (B, 1))).long()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, k, v, enable_gqa=True)
    want = _written_out(q, k, v, documents)
    grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    score_mod, mask, *rest = _traced_call(documents)
    got = FLEX_ATTENTION(q, k, v, score_mod, mask, *rest)[0]
    assert torch.allclose(got, want, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), torch.ones_like(got)), grads, strict=True):
        assert torch.allclose(g, w, atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1])  # the batch, the heads
def test_shards_make_the_whole_attention_and_its_gradients(dim: int) -> None:
    """Each of two ranks' shards through the executor's local call, its score_mod (reading
    the head) and mask_mod (reading the batch into whole document ids) given one process's
    indices: the shards of the whole output, and of each input's gradient."""
    torch.manual_seed(0)
    q = torch.randn(B, H, S, E, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, S, E, dtype=torch.float64, requires_grad=True) for _ in "kv")
    documents = (torch.arange(S) >= torch.randint(1, S, (B, 1))).long()
    whole = FLEX_ATTENTION(q, k, v, *_traced_call(documents))[0]
    grad_out = torch.randn_like(whole)
    grads = torch.autograd.grad(whole, (q, k, v), grad_out)
    spec = (shard(dim),)
    for rank in range(2):
        start = flex_offsets([spec], tuple(q.shape), [rank], [2])
        assert start == ((rank * B // 2, 0) if dim == 0 else (0, rank * H // 2))
        local = [t.detach().chunk(2, dim)[rank].requires_grad_() for t in (q, k, v)]
        out = local_flex_attention((*local, *_traced_call(documents)), start)[0]
        assert torch.allclose(out, whole.chunk(2, dim)[rank], atol=1e-12)
        got = torch.autograd.grad(out, local, grad_out.chunk(2, dim)[rank])
        for g, w in zip(got, grads, strict=True):
            assert torch.allclose(g, w.chunk(2, dim)[rank], atol=1e-12)


def test_the_traced_step_holds_flex_attention_split_like_attention() -> None:
    """Traced (torch's check let pass), the step holds torch's operator, priced as scaled
    dot-product attention's FLOPs, with our rule: the batch or the heads split in q, k, v
    and the outputs alike, the block mask's tensors whole; with a single key-value head (no
    axis splits it), the batch alone."""
    w = flex_lm.workload()
    graph = capture(w.model, w.example_inputs, w.loss_fn, w.example_target)
    (node, *_) = [n for n in graph.nodes if n.op == "flex_attention"]
    q, k = node.refs[0], node.refs[1]
    assert graph.node(q.name).outputs[q.index].shape == (8, 4, 16, 8)
    assert graph.node(k.name).outputs[k.index].shape == (8, 2, 16, 8)
    assert node.flops == 2.0 * 8 * 4 * 16 * 16 * (8 + 8)
    rule = own_rule(node.op)
    assert rule is not None
    ins = [graph.node(r.name).outputs[r.index] for r in node.refs]
    rest = [R] * (len(ins) - 3)
    assert rule(node, ins) == [
        (shard(0), shard(0), shard(0), shard(0), *rest),
        (shard(1), shard(1), shard(1), shard(1), *rest),
    ]
    # multi-query attention: one key-value head, split by no axis of the heads
    mqa = flex_lm.workload(kv_heads=1)
    graph = capture(mqa.model, mqa.example_inputs, mqa.loss_fn, mqa.example_target)
    (node, *_) = [n for n in graph.nodes if n.op == "flex_attention"]
    ins = [graph.node(r.name).outputs[r.index] for r in node.refs]
    assert rule(node, ins) == [(shard(0), shard(0), shard(0), shard(0), *rest)]


def test_the_check_is_torchs_again_outside_a_trace() -> None:
    q = torch.randn(1, 1, 4, 4, requires_grad=True)
    with traced_flex_attention():
        flex_attention(q, q, q).sum().backward()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)


def test_a_plan_splits_flex_attention(cpu4: autoplan.Cluster) -> None:
    w = flex_lm.workload(batch_size=16, seq_len=32)
    plan = w.baseline(cpu4, dp=4, tp=1)
    placed = [p for name, p in plan.nodes.items() if p.op == "flex_attention"]
    assert placed and all(p.output == {"dp": "S(0)"} for p in placed), placed


def test_transformers_flex_attention_is_planned_as_attention(cpu4: autoplan.Cluster) -> None:
    """transformers' ``attn_implementation="flex_attention"`` (its block mask made in forward
    and FlexAttention compiled, which the trace calls uncompiled): the data-parallel baseline
    splits its attention by the batch. That it trains so like one process is measured in
    docs/status.md (``autoplan run ... --check``)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, attn_implementation="flex_attention",
    )  # fmt: skip
    ids = torch.randint(0, 64, (4, 16))
    w = autoplan.Workload(transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids})
    plan = w.baseline(cpu4, dp=4, tp=1)
    placed = [p.output for p in plan.nodes.values() if p.op == "flex_attention"]
    assert placed == [{"dp": "S(0)"}]

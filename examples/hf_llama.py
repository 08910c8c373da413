"""A Llama from Hugging Face transformers (grouped-query attention, rotary embeddings, RMSNorm,
SwiGLU), random weights, called as users call it, ``model(input_ids=ids, labels=ids)``: the
inputs are a dict (passed by keyword) and there is no loss_fn (the model's output carries it).

    pip install transformers
    autoplan run examples/hf_llama.py --cluster costmodels/cpu-gloo-4.json --steps 3 --check

Large sizes are built on the meta device, for planning:

    autoplan plan examples/hf_llama.py --cluster costmodels/dgx-a100-80gb.json --nodes 4 \\
        --set size=8b --set device=meta --set batch_size=32 --set seq_len=2048
"""

from __future__ import annotations

import torch

from autoplan import Workload
from autoplan.errors import AutoplanError

try:
    import transformers
except ImportError as e:  # an optional dependency of this example alone
    raise AutoplanError("examples/hf_llama.py needs transformers: pip install transformers") from e

# (layers, hidden, intermediate, heads, key-value heads, vocabulary); 8b as Llama 3 8B
SIZES = {
    "tiny": (2, 64, 128, 4, 2, 128),
    "small": (4, 256, 688, 8, 4, 1024),
    "8b": (32, 4096, 14336, 32, 8, 128256),
}


def workload(
    size: str = "tiny", batch_size: int = 16, seq_len: int = 32, device: str = "cpu", seed: int = 0
) -> Workload:
    if size not in SIZES:
        raise AutoplanError(f"size {size!r} is not known; use one of {', '.join(SIZES)}")
    layers, hidden, inner, heads, kv_heads, vocab = SIZES[size]
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inner,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=seq_len, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    return Workload(model, {"input_ids": ids, "labels": ids})

"""A sweep over the installed transformers' architectures: every model type with a causal-LM,
masked-LM, seq2seq-LM or image-classification head whose config can be made tiny, planned
with the defaults and trained 3 steps on 4 gloo ranks against one process
(``autoplan run --check``), each in a fresh process.

A config is made tiny by setting, where the model's default config has them, its depth,
widths, heads, vocabulary, positions and experts to small values (`TINY`), and its dropout,
drop-path and layer-drop probabilities to 0 so that one process and four train alike; a
hybrid whose first layers lack a kind its default has (attention every few linear-attention
layers) gets one layer of each kind instead, and an encoder-decoder whose config names no
decoder start or pad token (T5's is in its generation config) starts from token 0; everything
else is the model's default (``use_cache`` included). A text model whose class cannot take the
multimodal config its model type names (Llama 4's causal LM) is built as its head's auto class
builds it, from the text config. Weights are random; nothing
is downloaded. This module is also the sweep's workload: ``autoplan run
benchmarks/model_sweep.py --set model=llama ...``.

Each architecture ends as one of: exact (trained, and matched one process), differs (trained,
did not match), refused (stopped before training with an error that says what to do),
unchecked (stopped before training with an error autoplan did not check for), failed (after
training started), not tiny (no tiny config could be built, or the tiny model did not run in
one process), over time.

    python benchmarks/model_sweep.py [--models llama,gpt2,...] [--limit N] [--timeout 300]
        [--keep] [--skip-done] [--torchtitan]

``--torchtitan`` sweeps torchtitan's language-model families instead (rows
``torchtitan/llama3``, ``torchtitan/deepseek-v3``, ``torchtitan/qwen3``,
``torchtitan/qwen3-moe``: tests/models/titan.py, torchtitan's modules at tiny widths, with
scaled dot-product attention; each again with "-flex" after it, with torchtitan's default
FlexAttention; with ``--models``, those named).

Writes benchmarks/results/model_sweep.json and .md; with ``--keep`` the rows already there for
model types not swept now are kept, so a sweep can run in parts (``--skip-done`` sweeps only
the model types without a row).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import platform
import re
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoplan import Workload  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.torch_private.flex_op import eager_flex_attention  # noqa: E402
from benchmarks.results_io import RESULTS, write_results  # noqa: E402

try:
    import transformers
    from transformers.models.auto import modeling_auto
except ImportError as e:  # an optional dependency of this benchmark alone
    raise AutoplanError("benchmarks/model_sweep.py needs transformers") from e

# the heads swept, in the order an architecture is taken by (its first head found)
HEADS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
AUTO = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}
VOCAB, SEQ, IMAGE, CLASSES = 128, 16, 32, 10
# a config attribute -> its tiny value, set where the default config has the attribute
TINY: dict[str, Any] = {
    **dict.fromkeys(
        ["num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers"], 2
    ),
    **dict.fromkeys(["num_decoder_layers", "n_layers"], 2),
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "dim", "embed_dim"], 64),
    **dict.fromkeys(["intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim"], 128),
    **dict.fromkeys(["encoder_ffn_dim", "decoder_ffn_dim"], 128),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "n_heads"], 4),
    **dict.fromkeys(["encoder_attention_heads", "decoder_attention_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "n_kv_heads"], 2),
    **dict.fromkeys(["head_dim", "d_kv", "kv_channels"], 16),
    "vocab_size": VOCAB,
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx"], 64),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "top_k"], 2),
    **dict.fromkeys(["moe_intermediate_size", "expert_intermediate_size"], 32),
    # latent attention (DeepSeek) and partial rotary widths, within a 16-wide head
    **dict.fromkeys(["qk_rope_head_dim", "rotary_dim"], 8),
    **dict.fromkeys(["qk_nope_head_dim"], 8),
    **dict.fromkeys(["v_head_dim"], 16),
    **dict.fromkeys(["kv_lora_rank", "q_lora_rank"], 32),
    "first_k_dense_replace": 1,  # DeepSeek's dense layers before the experts: one of the two
    "image_size": IMAGE,
    "patch_size": 8,
}
# per-stage lists or tuples (vision backbones): every stage gets the tiny value (their widths
# stay: a width also sets a group norm's channels, which BiT divides into 32 groups)
TINY_STAGES: dict[str, int] = {"depths": 1, "num_heads": 4, "embed_dims": 64}
# the probabilities of random drops: of activations (dropout), of residual branches per sample
# (stochastic depth: ``drop_path_rate``, per stage a list in CvT; EfficientNet's
# ``drop_connect_rate``) and of whole layers (``layerdrop``)
_DROPOUT = re.compile(
    r"(dropout|_pdrop|dropout_prob|dropout_rate|drop_rate|drop_path_rate|drop_connect_rate|layerdrop)$"
)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
# torchtitan's language-model families, swept with ``--torchtitan`` (tests/models/titan.py:
# torchtitan 0.3.0's own modules at tiny widths, with scaled dot-product attention or its
# FlexAttention)
TORCHTITAN = tuple(
    f"torchtitan/{m}{a}"
    for a in ("", "-flex")  # scaled dot-product attention; torchtitan's default FlexAttention
    for m in ("llama3", "deepseek-v3", "qwen3", "qwen3-moe")
)


def architectures() -> dict[str, tuple[str, str]]:
    """Each model type swept -> (its head, the model class's name), its first head of `HEADS`."""
    found: dict[str, tuple[str, str]] = {}
    for head, mapping in HEADS.items():
        for model_type, cls in getattr(modeling_auto, mapping).items():
            if model_type not in found and isinstance(cls, str):
                found[model_type] = (head, cls)
    return dict(sorted(found.items()))


def tiny_config(model_type: str) -> Any:
    """The model type's default config made tiny (`TINY`), dropout off, sub-configs (a
    multimodal model's text and vision configs) alike."""
    config = _tiny(transformers.CONFIG_MAPPING[model_type]())
    # a property of every config (the size of its id2label), taken as an argument by none
    config.num_labels = CLASSES
    if getattr(config, "is_encoder_decoder", False):
        # the decoder's first input: where the config names no start or pad token (T5 starts
        # from its pad token, named in its generation config), token 0
        for name in ("decoder_start_token_id", "pad_token_id"):
            if not isinstance(getattr(config, name, None), int):
                setattr(config, name, 0)
    return config


def _tiny(config: Any) -> Any:
    """``config`` rebuilt by its own class with the tiny values it takes as arguments, so
    that what the class derives from them (a head width from the rotary one, per-layer lists)
    follows; where the class refuses them, set on the default config instead."""
    changes: dict[str, Any] = {}
    for name, value in TINY.items():
        if isinstance(getattr(config, name, None), int):
            changes[name] = value
    changes.update(_kept_ratios(config, changes))
    for name, value in TINY_STAGES.items():
        stages = getattr(config, name, None)
        if isinstance(stages, list | tuple) and stages and all(isinstance(v, int) for v in stages):
            changes[name] = type(stages)([value] * len(stages))
    if "depths" in changes:
        # a backbone of stages halves the image after each: from 32 pixels the sweep's 8-pixel
        # patches leave its fourth stage none, its own (ConvNeXt's 4) one pixel. A windowed one
        # (Swin) takes patches and windows of 2, so that each stage holds whole windows
        # (transformers' Swin sizes its position bias for the configured window, not for one
        # shrunk to a smaller stage), and 2 blocks a stage: the second shifts its windows
        changes.pop("patch_size", None)
        if isinstance(getattr(config, "window_size", None), int):
            depths = changes["depths"]
            changes |= {
                "patch_size": 2,
                "window_size": 2,
                "depths": type(depths)([2] * len(depths)),
            }
    for name, current in vars(config).items():
        if _DROPOUT.search(name) and isinstance(current, float):
            changes[name] = 0.0
        elif _DROPOUT.search(name) and isinstance(current, list | tuple):
            changes[name] = type(current)(0.0 if isinstance(v, float) else v for v in current)
        if name in _TOKEN_IDS and isinstance(current, int):
            changes[name] = 0
        if isinstance(current, transformers.PretrainedConfig):
            changes[name] = _tiny(current)
    taken = inspect.signature(type(config).__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in taken.values())
    if not takes_any:
        # an attribute the class does not take is derived from those it takes
        changes = {k: v for k, v in changes.items() if k in taken}
    try:
        tiny = type(config)(**changes)
    except Exception:  # a class that refuses its own attributes as arguments
        for name, value in changes.items():
            with contextlib.suppress(AttributeError, ValueError, TypeError):
                setattr(config, name, value)
        return config
    kinds = _every_kind(config, tiny)
    if kinds and ("layer_types" in taken or takes_any):
        with contextlib.suppress(Exception):  # the class derives its kinds from elsewhere
            return type(config)(**changes | kinds)
    return tiny


def _every_kind(default: Any, tiny: Any) -> dict[str, Any]:
    """The first layer of each kind (``layer_types``) of the default config, in order, where
    the tiny depth lost a kind: a hybrid's attention layers come every few linear-attention or
    convolution layers, and its first two may have none (nor may the cache it makes, which
    then cannot say how long it is)."""
    kinds, depth = getattr(default, "layer_types", None), getattr(tiny, "num_hidden_layers", None)
    if not isinstance(kinds, list) or not isinstance(depth, int):
        return {}
    every = list(dict.fromkeys(kinds))
    if set(every) <= set(getattr(tiny, "layer_types", None) or ()):
        return {}
    return {"num_hidden_layers": len(every), "layer_types": every}


def _kept_ratios(config: Any, changes: dict[str, Any]) -> dict[str, int]:
    """Counts that must divide others, kept consistent at the tiny sizes: as many key and
    value heads as heads where the default has as many (multi-head and latent attention;
    grouped-query attention keeps `TINY`'s 2), and routing groups to experts and chosen groups
    to groups in the default's ratios (DeepSeek's grouped top-k)."""
    found = {}
    heads, kv = (
        getattr(config, "num_attention_heads", None),
        getattr(config, "num_key_value_heads", None),
    )
    if isinstance(heads, int) and heads == kv and "num_attention_heads" in changes:
        found["num_key_value_heads"] = changes["num_attention_heads"]
    groups, experts = getattr(config, "n_group", None), getattr(config, "n_routed_experts", None)
    if isinstance(groups, int) and isinstance(experts, int) and "n_routed_experts" in changes:
        found["n_group"] = max(1, changes["n_routed_experts"] * groups // max(experts, 1))
        chosen = getattr(config, "topk_group", None)
        if isinstance(chosen, int):
            found["topk_group"] = max(1, found["n_group"] * chosen // max(groups, 1))
    return found


def workload(model: str = "llama", batch_size: int = 8, seq_len: int = SEQ) -> Workload:
    """The tiny model of type ``model``, called as users call its head, with labels, drawn
    from seed 0; or torchtitan's (`TORCHTITAN`), with its loss."""
    torch.manual_seed(0)
    if model in TORCHTITAN:
        # imported here: torchtitan takes seconds to import, which the other rows spare
        from tests.models import titan

        return titan.workload(model.removeprefix("torchtitan/"), batch_size, seq_len)
    return tiny_workload(model, batch_size, seq_len)


def tiny_workload(model: str, batch_size: int, seq_len: int) -> Workload:
    """`workload`, its weights and inputs drawn from torch's generator as it stands."""
    known = architectures()
    if model not in known:
        raise AutoplanError(f"model type {model!r} is not swept; use one of {', '.join(known)}")
    head, cls_name = known[model]
    config = tiny_config(model)
    try:
        built = getattr(transformers, cls_name)(config)
    except AttributeError:
        # a text model's class given its multimodal config (Llama 4's): built as the head's
        # auto class builds it, from the text config
        built = getattr(transformers, AUTO[head]).from_config(config)
    if head == "image-classification":
        channels = getattr(config, "num_channels", 3)
        pixels = torch.randn(batch_size, channels, IMAGE, IMAGE)
        labels = torch.randint(0, CLASSES, (batch_size,))
        return Workload(built, {"pixel_values": pixels, "labels": labels})
    ids = torch.randint(1, VOCAB, (batch_size, seq_len))
    return Workload(built, {"input_ids": ids, "labels": ids})


def classify(returncode: int, output: str) -> tuple[str, str]:
    """(result, reason) of an ``autoplan run --check`` from its exit code and output."""
    check = re.search(r"check against one process: (.*): (OK|FAILED)", output)
    if check and check.group(2) == "FAILED":  # trained; its error block says the same
        return "differs", check.group(1)[:160]
    if returncode == 0 and check:
        return "exact", ""
    lines = output.strip().splitlines()
    error = next((i for i, line in enumerate(lines) if line.startswith("autoplan: error")), None)
    if error is None:
        return "failed", (lines[-1] if lines else f"exit code {returncode}")[:160]
    head = lines[error]
    # the error whole (a refusal's module, op and what to do), a package's files from their
    # package's folder on
    detail = " ".join(line.strip() for line in lines[error : error + 2])
    detail = re.sub(r"\S*/site-packages/", "", detail)[:1000]
    if re.search(r"at step \d+|after step \d+|without an error from any rank", head):
        return "failed", detail
    unchecked = any("did not check for this error" in line for line in lines[error:])
    return ("unchecked" if unchecked else "refused"), detail


PROBE_BYTES = 4 * 2**30  # the address space a tiny model may take in one process


def probe(model: str) -> None:
    """Build the tiny ``model`` and compute its loss once, as one process trains it (the
    reference of ``--check``: FlexAttention uncompiled, which torch refuses on the CPU)."""
    w = workload(model)
    with eager_flex_attention():
        w.loss(w.model).backward()


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (PROBE_BYTES, PROBE_BYTES))


def sweep_one(model: str, timeout_s: float) -> dict[str, object]:
    """Plan and train ``model`` (`workload`) on 4 gloo ranks against one process, once its
    tiny model has run in one process (`probe`, in a process of its own: a config that stays
    large is not swept)."""
    head = "causal-lm" if model in TORCHTITAN else architectures()[model][0]
    row: dict[str, object] = {"model": model, "head": head}
    try:
        probed = subprocess.run(
            [sys.executable, __file__, "--probe", model],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            preexec_fn=_capped,
        )
    except subprocess.TimeoutExpired:
        return row | {"result": "not tiny", "reason": f"one step took over {timeout_s:g} s"}
    if probed.returncode != 0:
        last = (probed.stderr.strip().splitlines() or [f"exit code {probed.returncode}"])[-1]
        return row | {"result": "not tiny", "reason": last[:160]}
    command = [
        *(str(Path(sys.executable).parent / "autoplan"), "run", str(Path(__file__))),
        *("--set", f"model={model}", "--cluster", str(ROOT / "costmodels/cpu-gloo-4.json")),
        *("--steps", "3", "--check"),
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return row | {"result": f"over {timeout_s:g} s"}
    output = done.stdout + done.stderr
    result, reason = classify(done.returncode, output)
    mesh = re.search(r"^mesh: (.*?)\s*(\(|$)", output, re.MULTILINE)
    return row | {
        "result": result,
        "mesh": mesh.group(1) if mesh else "",
        "run_s": round(time.perf_counter() - start, 1),
        "reason": reason,
    }


def counts(rows: Iterable[dict[str, object]]) -> str:
    """``"exact 40, refused 3, ..."``."""
    found = Counter(str(r["result"]) for r in rows)
    return ", ".join(f"{k} {n}" for k, n in found.most_common())


def exact_share(rows: Iterable[dict[str, object]]) -> str:
    """``"88 of 94 (93.6%)"``: the rows that trained exactly, of those whose model was made
    tiny (every row but "not tiny")."""
    results = [str(r["result"]) for r in rows if r["result"] != "not tiny"]
    exact = results.count("exact")
    return f"{exact} of {len(results)} ({100 * exact / max(len(results), 1):.1f}%)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", help="model types, comma-separated (default: every one)")
    parser.add_argument("--limit", type=int, help="the first N model types only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a model may take")
    parser.add_argument("--keep", action="store_true", help="keep the other rows already written")
    parser.add_argument("--skip-done", action="store_true", help="sweep model types with no row")
    parser.add_argument("--torchtitan", action="store_true", help="torchtitan's models instead")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # `probe`, in this process
    args = parser.parse_args()
    if args.probe:
        probe(args.probe)
        return
    every = list(TORCHTITAN) if args.torchtitan else list(architectures())
    models = args.models.split(",") if args.models else every
    kept = _written() if args.keep or args.skip_done else {}
    if args.skip_done:
        models = [m for m in models if m not in kept]
    models = models[: args.limit]
    for model in models:
        kept[model] = sweep_one(model, args.timeout)
        print(kept[model], flush=True)
        # written after each model: a long sweep cut short keeps what it found
        _write([kept[m] for m in sorted(kept)], len(models))


def _written() -> dict[str, dict[str, object]]:
    """The rows of the results file, by model type (none if there is no file)."""
    path = RESULTS / "model_sweep.json"
    if not path.exists():
        return {}
    return {str(r["model"]): r for r in json.loads(path.read_text())["rows"]}


def _write(rows: list[dict[str, object]], planned: int) -> None:
    meta = {
        "command": "python benchmarks/model_sweep.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "swept": f"{sum(r['model'] not in TORCHTITAN for r in rows)} of the "
        f"{len(architectures())} model types with a head swept, and "
        f"{sum(r['model'] in TORCHTITAN for r in rows)} of torchtitan's {len(TORCHTITAN)} "
        f"models ({planned} in this run)",
        "counts": counts(rows),
        "exact of those made tiny": exact_share(rows),
        "run": "autoplan run benchmarks/model_sweep.py --set model=M --cluster "
        "costmodels/cpu-gloo-4.json --steps 3 --check (4 gloo ranks against one process)",
    }
    columns = ["model", "head", "result", "mesh", "run_s", "reason"]
    write_results("model_sweep", "Model sweep: transformers architectures", meta, rows, columns)


if __name__ == "__main__":
    main()

"""The model sweep's own logic (`benchmarks/model_sweep.py`): which configs it makes tiny and
how it reads an ``autoplan run --check`` (the sweep itself runs by hand: it takes hours)."""

from __future__ import annotations

from benchmarks.model_sweep import architectures, classify, tiny_config, tiny_workload


def test_architectures_cover_the_four_heads_and_the_models_users_bring() -> None:
    found = architectures()
    assert {head for head, _ in found.values()} == {
        "causal-lm",
        "masked-lm",
        "seq2seq-lm",
        "image-classification",
    }
    for model in ("llama", "mistral", "gemma2", "deepseek_v3", "gpt2", "bert", "bart", "vit"):
        assert model in found


def test_a_tiny_config_keeps_the_defaults_it_does_not_shrink() -> None:
    config = tiny_config("mistral")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 64, 128)
    assert config.attention_dropout == 0.0
    assert config.use_cache is True  # the model's default, as users train it
    assert config.sliding_window == 4096  # not shrunk: mistral's own
    # random drops of whole residual branches or layers are off too (they draw otherwise on
    # four ranks than in one process)
    assert tiny_config("focalnet").drop_path_rate == 0.0
    assert tiny_config("efficientnet").drop_connect_rate == 0.0
    assert tiny_config("m2m_100").encoder_layerdrop == 0.0


def test_a_tiny_config_turns_stochastic_depth_off_too() -> None:
    # CvT's drop path, a rate per stage: random per sample, as dropout is
    config = tiny_config("cvt")
    assert tuple(config.drop_path_rate) == (0.0, 0.0, 0.0)
    assert tuple(config.drop_rate) == (0.0, 0.0, 0.0)


def test_a_run_is_read_as_exact_refused_unchecked_or_failed() -> None:
    ok = "step 3/3 ...\ncheck against one process: losses 1e-7, parameters 2e-7: OK\n"
    assert classify(0, ok) == ("exact", "")
    bad = "check against one process: losses 3e-2, parameters 1e-1: FAILED\n"
    assert classify(2, bad + "autoplan: error on rank 0 after step 3 ...\n")[0] == "differs"
    refused = (
        "autoplan: error: model.layers.0.mlp (aten.bincount) has no sharding rule\n"
        "  pin it or use ...\n"
    )
    assert classify(2, refused)[0] == "refused"
    # told whole, a package's path from the package on
    at = "at /v/lib/site-packages/transformers/models/x.py:3 (`if m.any():`) in model (aten.f): "
    long = f"autoplan: error: could not trace X {at}{'what to do ' * 30}\n"
    assert classify(2, long)[1] == long.strip().replace("/v/lib/site-packages/", "")
    unchecked = (
        "autoplan: error on ranks 0-3 before the first step (tracing, planning, ...):\n"
        "  NotImplementedError: Operator aten.foo ...\n"
        "  autoplan did not check for this error: if the model and inputs train in one ...\n"
    )
    assert classify(1, unchecked)[0] == "unchecked"
    lost = "autoplan: error: the job failed without an error from any rank: local rank 0 ...\n"
    assert classify(1, lost)[0] == "failed"  # a rank that died unexplained is no refusal
    during = "autoplan: error on rank 1 at step 2 (backward):\n  RuntimeError: boom\n"
    result, reason = classify(1, during)
    assert result == "failed" and "at step 2" in reason and "RuntimeError: boom" in reason


def test_a_tiny_config_is_built_by_its_class_so_derived_widths_follow() -> None:
    latent = tiny_config("deepseek_v3")  # its head width is derived from the rotary width
    assert latent.head_dim == latent.qk_rope_head_dim == 8
    # latent attention has as many key/value heads as heads; routing groups divide the
    # experts; one dense layer, then experts
    assert latent.num_key_value_heads == latent.num_attention_heads == 4
    assert latent.n_routed_experts % latent.n_group == 0 and latent.topk_group <= latent.n_group
    assert latent.first_k_dense_replace < latent.num_hidden_layers
    assert tiny_config("mistral").num_key_value_heads == 2  # grouped-query attention stays
    nested = tiny_config("gemma3")  # a multimodal config: its text and vision configs shrink
    assert (nested.text_config.hidden_size, nested.text_config.num_hidden_layers) == (64, 2)
    assert nested.vision_config.hidden_size == 64


def test_a_tiny_image_classifier_has_the_sweeps_classes() -> None:
    assert tiny_config("cvt").num_labels == 10  # its labels are drawn from 10 classes


def test_a_tiny_backbone_of_stages_keeps_an_image_for_each_stage() -> None:
    # its per-stage tuples shrink as lists do; from 32 pixels, its own 4-pixel patches leave
    # the fourth stage one pixel (the sweep's 8 would leave none)
    convnext = tiny_config("convnext")
    assert (convnext.depths, convnext.patch_size, convnext.image_size) == ((1, 1, 1, 1), 4, 32)
    # a windowed one: patches and windows of 2, its fourth stage one whole window (2 x 2), 2
    # blocks a stage (the second's windows shifted)
    swin = tiny_config("swin")
    assert (swin.depths, swin.num_heads) == ((2, 2, 2, 2), (4, 4, 4, 4))
    assert (swin.patch_size, swin.window_size, swin.embed_dim) == (2, 2, 64)
    assert 32 // swin.patch_size // 2**3 == swin.window_size


def test_a_tiny_hybrid_keeps_a_layer_of_each_kind() -> None:
    # Kimi Linear's full attention comes every few linear-attention layers: its first two
    # have none (and its cache could not say how long it is), so one layer of each kind
    hybrid = tiny_config("kimi_linear")
    assert sorted(hybrid.layer_types) == ["full_attention", "linear_attention"]
    assert hybrid.num_hidden_layers == 2
    lfm3 = tiny_config("lfm3")  # convolutions, full and sliding attention: three layers
    assert lfm3.layer_types == ["conv", "full_attention", "sliding_attention"]
    gemma2 = tiny_config("gemma2")  # its first two layers have both kinds: as they were
    assert gemma2.layer_types == ["sliding_attention", "full_attention"]


def test_a_tiny_encoder_decoder_names_its_decoders_first_token() -> None:
    # T5 names its start token in its generation config alone; without one, the model cannot
    # shift its labels into the decoder's inputs
    assert tiny_config("longt5").decoder_start_token_id == 0
    # a decoder-only speech model under a seq2seq head keeps its config as it is
    assert getattr(tiny_config("granite_speech"), "decoder_start_token_id", None) is None


def test_a_text_model_given_its_multimodal_config_is_built_from_the_text_config() -> None:
    # Llama 4's causal LM is its text model, which its class cannot build from the
    # multimodal config the model type names; the auto class takes the text config
    model = tiny_workload("llama4", batch_size=2, seq_len=4).model
    assert type(model).__name__ == "Llama4ForCausalLM"
    assert type(model.config).__name__ == "Llama4TextConfig"
    assert model.config.hidden_size == 64

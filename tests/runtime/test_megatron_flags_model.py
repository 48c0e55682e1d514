"""Megatron-LM's generated TransformerConfig flags reach the model (one in-process rank): the built
TransformerConfig's fields, what the layers hold, initialisation by global name following them, and
megatron-core's refusals naming the generated flags."""
from __future__ import annotations

import pytest
import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import parse_run_config
from megatron_ext.runtime.model import build_model, check_config, unwrap
from tests.runtime import trainer_helpers

BASE = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def one_rank():
    yield from trainer_helpers.one_rank(parse_run_config(BASE).flat())


def build(one_rank, *flags):
    cfg = parse_run_config(BASE + list(flags))
    return cfg, build_model(cfg, one_rank, vocab_size=100, wrap_ddp=False)


def test_generated_flags_reach_the_transformer_config_and_the_layers(one_rank):
    cfg, bundle = build(one_rank, "--kv-channels", "32", "--norm-epsilon", "1e-6", "--apply-layernorm-1p",
                        "--add-qkv-bias", "--disable-bias-linear", "--recompute-granularity", "full",
                        "--recompute-method", "uniform", "--recompute-num-layers", "1", "--cross-entropy-loss-fusion",
                        "--attention-softmax-in-fp32", "--embedding-init-method-std", "0.5",
                        "--no-clone-scatter-output-in-embedding")
    tc = bundle.config
    assert (tc.kv_channels, tc.layernorm_epsilon, tc.layernorm_zero_centered_gamma, tc.add_qkv_bias,
            tc.add_bias_linear) == (32, 1e-6, True, True, False)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    assert (tc.cross_entropy_loss_fusion, tc.attention_softmax_in_fp32, tc.embedding_init_method_std,
            tc.clone_scatter_output_in_embedding) == (True, True, 0.5, False)
    model = unwrap(bundle.chunks[0])
    layer = model.decoder.layers[0]
    # 4 heads of 32 channels: q, k and v of 128 each from a 64-wide hidden state, with their bias only.
    assert layer.self_attention.linear_qkv.weight.shape == (3 * 4 * 32, 64)
    assert layer.self_attention.linear_qkv.bias.shape == (3 * 4 * 32,)
    assert layer.self_attention.linear_proj.bias is None
    assert layer.input_layernorm.eps == 1e-6
    # Initialisation by global name follows them: zero-centered gains start at zero, the embedding
    # is drawn with its own std.
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(not p.any() for p in norms)
    assert abs(float(model.embedding.word_embeddings.weight.std()) - 0.5) < 0.05
    tokens = torch.randint(0, 100, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
    loss.float().mean().backward()
    assert torch.isfinite(layer.self_attention.linear_qkv.weight.grad).all()


def test_a_run_without_them_builds_the_config_it_always_did(one_rank):
    _, bundle = build(one_rank)
    tc = bundle.config
    assert (tc.kv_channels, tc.layernorm_epsilon, tc.layernorm_zero_centered_gamma, tc.recompute_granularity,
            tc.cross_entropy_loss_fusion) == (16, 1e-5, False, None, False)
    # Megatron-LM's default: the softmax in the model's precision.
    assert tc.attention_softmax_in_fp32 is False


def test_kernel_switches_only_turn_off_what_the_device_runs(one_rank):
    _, bundle = build(one_rank, "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion")
    tc = bundle.config
    assert not (tc.masked_softmax_fusion or tc.bias_dropout_fusion or tc.bias_activation_fusion)
    from megatron_ext.runtime.model import build_transformer_config

    on_gpu = build_transformer_config(parse_run_config(BASE + ["--no-bias-dropout-fusion"]), on_gpu=True)
    assert on_gpu.bias_activation_fusion and not on_gpu.bias_dropout_fusion


def test_megatron_cores_refusal_names_the_generated_flag():
    with pytest.raises(ConfigError) as err:
        check_config(parse_run_config(BASE + ["--recompute-granularity", "full"]))
    assert str(err.value) == ("--recompute-granularity full: megatron-core refuses it (TransformerConfig): Using "
                              'recompute_granularity: full so recompute_method must be "block" or "uniform"')


# --- the vocabulary padding (Megatron-LM's rule) ---------------------------------------------------

@pytest.mark.parametrize("vocab, tp, divisible_by, padded", [
    (50257, 1, 128, 50304), (50257, 2, 128, 50432), (50257, 8, 128, 51200), (4096, 8, 128, 4096),
    (100, 2, 128, 256), (100, 2, 64, 128), (128256, 1, 128, 128256),
])
def test_the_vocabulary_is_padded_to_divisible_by_times_tp(vocab, tp, divisible_by, padded):
    from megatron_ext.runtime.model import padded_vocab_size, pads_vocabulary

    assert padded_vocab_size(vocab, tp, divisible_by) == padded
    assert pads_vocabulary(padded, vocab)
    assert not pads_vocabulary(padded + 64 * 1024, vocab) and not pads_vocabulary(vocab - 1, vocab)


def test_the_model_keeps_the_launch_padding_or_its_checkpoints(tmp_path):
    import json

    from megatron_ext.runtime import checkpoint as ckpt
    from megatron_ext.runtime.model import model_vocab_size

    cfg = parse_run_config(BASE + ["--tensor-model-parallel-size", "2"])
    assert model_vocab_size(cfg, 50257) == 50432
    # A layout change to TP4 keeps the launch's padding, which it divides; TP3 cannot take it.
    assert model_vocab_size(cfg, 50257, tp=4) == 50432
    with pytest.raises(ValueError, match="padded to 50432 rows, which --tensor-model-parallel-size 3 does not divide"):
        model_vocab_size(cfg, 50257, tp=3)
    # A checkpoint saved at TP1 (50304 rows) resumed at TP2 keeps its rows.
    step = tmp_path / "iter_0000010"
    step.mkdir()
    (tmp_path / "latest").write_text("iter_0000010")
    (step / "meta.json").write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION, "shards": [
        {"key": "embedding.word_embeddings.weight", "global_shape": [50304, 64]}]}))
    assert ckpt.embedding_rows(str(tmp_path)) == 50304
    assert ckpt.embedding_rows(str(tmp_path / "nothing")) is None and ckpt.embedding_rows(None) is None
    assert model_vocab_size(cfg, 50257, tp=2, saved_rows=ckpt.embedding_rows(str(tmp_path))) == 50304


def test_padded_vocab_size_is_the_rows_as_given():
    from megatron_ext.runtime.model import model_vocab_size

    cfg = parse_run_config(BASE + ["--tensor-model-parallel-size", "2", "--padded-vocab-size", "50304"])
    assert model_vocab_size(cfg, 50257, tp=2) == 50304          # not 50432, the 128 x TP2 padding
    with pytest.raises(ValueError, match=r"^--padded-vocab-size 50304 is smaller than the tokenizer's 50400 tokens$"):
        model_vocab_size(cfg, 50400)
    with pytest.raises(ValueError, match="padded to 50304 rows, which --tensor-model-parallel-size 5 does not divide"):
        model_vocab_size(cfg, 50257, tp=5)

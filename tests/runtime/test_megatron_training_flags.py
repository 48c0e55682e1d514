"""Megatron-LM's training flags implemented here (one in-process rank): the rotary options reaching
GPTModel, --fp16 with megatron's loss scaling, --decoupled-lr, --calculate-per-token-loss and
--grad-reduce-in-bf16 doing what Megatron-LM's do."""
from __future__ import annotations

import pytest
import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.config.run import config_from_values, parse_run_config
from megatron_ext.runtime.model import build_model, unwrap
from tests.runtime.trainer_helpers import one_rank, watched_run

VALUES = {**FORMER_DEFAULTS, "eval_iters": 0, "progress": False, "num_layers": 2, "hidden_size": 32,
          "num_attention_heads": 2, "seq_length": 32, "global_batch_size": 4, "micro_batch_size": 2,
          "train_iters": 2, "lr_decay_style": "constant"}


@pytest.fixture(scope="module")
def ctx():
    yield from one_rank(VALUES)


def run(ctx, **values):
    return watched_run(ctx, {**VALUES, **values})


def test_the_rotary_options_reach_gptmodel(ctx):
    base = {**VALUES, "position_embedding_type": "rope"}
    plain = unwrap(build_model(config_from_values(base), ctx, 100, wrap_ddp=False).chunks[0]).rotary_pos_emb
    half = unwrap(build_model(config_from_values({**base, "rotary_percent": 0.5}), ctx, 100,
                              wrap_ddp=False).chunks[0]).rotary_pos_emb
    assert plain.inv_freq.numel() == 8 and half.inv_freq.numel() == 4   # 16 channels a head, half of them
    scaled = unwrap(build_model(config_from_values({**base, "use_rope_scaling": True, "rope_scaling_factor": 4.0}),
                                ctx, 100, wrap_ddp=False).chunks[0]).rotary_pos_emb
    # LLaMA-3.x scaling divides the low frequencies by the factor and keeps the high ones.
    assert torch.allclose(scaled.inv_freq[0], plain.inv_freq[0])
    assert torch.allclose(scaled.inv_freq[-1], plain.inv_freq[-1] / 4)
    interpolated = unwrap(build_model(config_from_values({**base, "rotary_seq_len_interpolation_factor": 2}), ctx,
                                      100, wrap_ddp=False).chunks[0]).rotary_pos_emb
    assert interpolated.seq_len_interpolation_factor == 2


@pytest.mark.parametrize("argv, message", [
    (["--rotary-percent", "0.5"], "--rotary-percent needs --position-embedding-type rope"),
    (["--use-rope-scaling", "--rope-scaling-factor", "4"], "--use-rope-scaling, --rope-scaling-factor need "
     "--position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 each set the model's precision: give one"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16 (gradients are reduced in the model's "
     "precision)"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--fp16", "--engine", "deepspeed"], "--engine deepspeed trains in fp32 or bf16 (the config's bf16 section, or "
     "--bf16): drop --fp16 or use --engine megatron"),
])
def test_bad_training_flags_are_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        cfg = parse_run_config(["--device", "cpu"] + argv)
        if cfg.parallel.engine == "deepspeed":
            from deepspeed_patches.trainer import check_config

            check_config(cfg)
    assert str(err.value) == message


def test_fp16_trains_with_megatrons_dynamic_loss_scaling(ctx):
    # A loss scale no fp16 gradient survives: every such iteration is skipped and, with hysteresis 1,
    # halves the scale, as megatron's DynamicGradScaler does -- until the gradients fit.
    trainer, seen = run(ctx, fp16=True, initial_loss_scale=2.0 ** 40, hysteresis=1, train_iters=30)
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())
    scales = [m.loss_scale for m in seen]
    skipped = [m.skipped for m in seen]
    assert skipped[0] and not skipped[-1]
    assert scales[0] == 2.0 ** 39 and scales[-1] < 2.0 ** 30
    assert all(b == a / 2 for a, b, s in zip(scales, scales[1:], skipped[1:]) if s)
    assert all(torch.isfinite(torch.tensor(m.loss)) for m in seen)


def test_decoupled_lr_sets_the_input_and_output_layers_rate(ctx):
    trainer, _ = run(ctx, lr=1e-3, decoupled_lr=5e-4, decoupled_min_lr=1e-5)
    rates = {}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            rates[bool(getattr(p, "is_embedding_or_output_parameter", False))] = group["lr"]
    assert rates == {True: 5e-4, False: 1e-3}
    # megatron's optimizer (--bf16) takes the same groups from its own config.
    trainer, _ = run(ctx, lr=1e-3, decoupled_lr=5e-4, bf16=True)
    lrs = {g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs == {5e-4, 1e-3}


def test_per_token_loss_is_the_token_mean(ctx):
    _, plain = run(ctx)
    trainer, per_token = run(ctx, calculate_per_token_loss=True)
    assert trainer.model.config.calculate_per_token_loss
    # Every micro-batch holds the same number of tokens here, so the two means are the same curve.
    assert [m.loss for m in per_token] == pytest.approx([m.loss for m in plain], rel=1e-6)


def test_grad_reduce_in_bf16_reduces_in_the_models_precision(ctx):
    trainer, seen = run(ctx, bf16=True, grad_reduce_in_bf16=True)
    chunk = trainer.model.chunks[0]
    assert chunk.ddp_config.grad_reduce_in_fp32 is False
    assert all(p.main_grad.dtype == torch.bfloat16 for p in chunk.parameters() if hasattr(p, "main_grad"))
    assert all(torch.isfinite(torch.tensor(m.loss)) for m in seen)


def test_the_hf_export_refuses_a_flag_no_adapter_maps():
    from megatron_ext.convert.hf import ConversionError, model_config_of

    flat = config_from_values({**VALUES, "position_embedding_type": "rope", "rotary_percent": 0.5,
                               "kv_channels": 32}).flat()
    with pytest.raises(ConversionError) as err:
        model_config_of({"config": flat}, "ckpt")
    assert str(err.value) == ("ckpt: --rotary-percent 0.5, --kv-channels 32: no Hugging Face architecture here maps "
                              "them, so the export would not compute what the model does")
    # kv-channels equal to hidden / heads is the plain model.
    same = config_from_values({**VALUES, "kv_channels": 16}).flat()
    assert model_config_of({"config": same}, "ckpt").hidden_size == 32


def test_squared_relu_is_the_mlps_activation(ctx):
    from megatron.core.activations import squared_relu

    bundle = build_model(config_from_values({**VALUES, "squared_relu": True}), ctx, 100, wrap_ddp=False)
    assert bundle.config.activation_func is squared_relu and not bundle.config.gated_linear_unit
    with pytest.raises(ConfigError, match="--squared-relu and --swiglu each choose the MLP's activation: give one"):
        parse_run_config(["--squared-relu", "--swiglu"])

"""Megatron-LM's checkpoint format (``--ckpt-format torch_dist``, the default) on one in-process rank:
its layout, resume, integrity with a fallback, interrupted saves and bad input. Across layouts and to
and from Megatron-LM's own model: test_dist_ckpt_megatron.py."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.config.run import config_from_values, parse_run_config
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import dist_ckpt
from megatron_ext.runtime.loop import Trainer
from megatron_ext.runtime.rundir import check_outputs
from tests.runtime.trainer_helpers import one_rank

VALUES = {**FORMER_DEFAULTS, "train_iters": 4, "save_interval": 2, "eval_iters": 0, "progress": False,
          "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32, "global_batch_size": 2,
          "micro_batch_size": 1, "lr_decay_style": "constant"}


@pytest.fixture(scope="module")
def ctx():
    yield from one_rank(VALUES)


def trainer(ctx, **values) -> Trainer:
    return Trainer(config_from_values({**VALUES, **values}), ctx).setup()


def params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


def losses(t: Trainer) -> list[float]:
    return [h["loss"] for h in t.history if h["kind"] == "train"]


@pytest.fixture(scope="module")
def saved(ctx, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist"))
    t = trainer(ctx, save=root)
    t.run()
    return root, params(t), losses(t)


def copy_of(saved, tmp_path) -> str:
    root = str(tmp_path / "copy")
    shutil.copytree(saved[0], root)
    return root


def test_layout_is_megatron_lms(saved):
    root, _, _ = saved
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "4"
    assert sorted(d for d in os.listdir(root) if d.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    files = set(os.listdir(os.path.join(root, "iter_0000004")))
    assert {"metadata.json", ".metadata", "common.pt", dist_ckpt.FILES} <= files
    assert any(f.endswith(".distcp") for f in files)
    common = dist_ckpt.read_common(os.path.join(root, "iter_0000004"))
    assert common["iteration"] == 4 and common["checkpoint_version"] == 3.0
    assert common["args"].consumed_train_samples == 8 and common["args"].num_layers == 2
    assert common["args"].padded_vocab_size == dist_ckpt.tensor_shapes(os.path.join(root, "iter_0000004"))[
        "embedding.word_embeddings.weight"][0]
    assert common["opt_param_scheduler"]["num_steps"] == 8  # Megatron-LM's scheduler counts samples: 4 x 2
    shapes = dist_ckpt.tensor_shapes(os.path.join(root, "iter_0000004"))
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (2, 96, 32)  # layers stacked, as megatron


def test_resume_continues_the_straight_run(ctx, saved, tmp_path):
    root, _, straight = saved
    run = copy_of(saved, tmp_path)
    first = trainer(ctx, load=run, ckpt_step=2, save=str(tmp_path / "again"))  # --ckpt-step: an older one
    assert (first.iteration, first.scheduler.num_steps) == (2, 2)  # saved as Megatron-LM's 4 samples
    first.run()
    assert losses(first) == pytest.approx(straight[2:], rel=1e-6, abs=0)


def _truncate(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _flip(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, why", [
    (_truncate, "is truncated or altered"),
    (_flip, "is corrupt (sha256 mismatch)"),
    (os.remove, "is missing"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(ctx, saved, tmp_path, caplog, damage, why):
    root, _, _ = saved
    run = copy_of(saved, tmp_path)
    newest = os.path.join(run, "iter_0000004")
    victim = sorted(f for f in os.listdir(newest) if f.endswith(".distcp"))[0]
    damage(os.path.join(newest, victim))
    with caplog.at_level(logging.WARNING, logger="megatron_ext.runtime.dist_ckpt"):
        t = trainer(ctx, load=run)
    assert t.iteration == 2
    line = [r.getMessage() for r in caplog.records if "newest complete" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith(f"{newest}: {victim} {why}")
    assert line[0].endswith(f"; loading the newest complete checkpoint before it, {os.path.join(run, 'iter_0000002')}")
    # Named explicitly, the damaged one is refused, and the model is left as it was.
    before = trainer(ctx)
    weights = params(before)
    with pytest.raises(ckpt.CheckpointError, match=f"--ckpt-step 4: {newest}: {victim} "):
        ckpt.load(run, model=before.model, optimizer=before.optimizer, layout=before.layout_dict(), step=4)
    with pytest.raises(ckpt.CheckpointError, match=f"^{newest}: {victim} "):
        ckpt.load(newest, model=before.model, optimizer=before.optimizer, layout=before.layout_dict())
    assert all(torch.equal(a, b) for a, b in zip(params(before), weights))


def test_a_save_killed_before_the_tracker_leaves_the_previous_one_newest(ctx, saved, tmp_path):
    root, expected, _ = saved
    run = copy_of(saved, tmp_path)
    t = trainer(ctx, load=run, save=run, train_iters=6)

    class Killed(Exception):
        pass

    def die(point, iteration=None):
        if point == "save":
            raise Killed  # after this rank's files are written, before the file list, rename and tracker

    t.fault_point = die
    with pytest.raises(Killed):
        t.run()
    assert open(os.path.join(run, "latest_checkpointed_iteration.txt")).read() == "4"
    assert os.path.isdir(os.path.join(run, "iter_0000006.partial"))
    assert not os.path.exists(os.path.join(run, "iter_0000006"))
    again = trainer(ctx, load=run)
    assert again.iteration == 4 and all(torch.equal(a, b) for a, b in zip(params(again), expected))


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 64},
     "embedding.word_embeddings.weight has shape [{rows}, 32] in the checkpoint, [{rows}, 64] in this model"),
    ({"num_layers": 3},
     "decoder.layers.self_attention.linear_qkv.layer_norm_weight holds 2 layers in the checkpoint; this model "
     "needs index 2 (more layers than the saved run)"),
])
def test_a_checkpoint_of_another_model_names_the_first_mismatch(ctx, saved, change, message):
    root, _, _ = saved
    rows = dist_ckpt.tensor_shapes(os.path.join(root, "iter_0000004"))["embedding.word_embeddings.weight"][0]
    other = trainer(ctx, **change)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(root, model=other.model, optimizer=other.optimizer, layout=other.layout_dict())
    assert str(err.value) == f"{os.path.join(root, 'iter_0000004')}: {message.format(rows=rows)}"


def test_a_deepspeed_directory_says_what_it_is(tmp_path):
    os.makedirs(tmp_path / "global_step10")
    (tmp_path / "latest").write_text("global_step10")
    with pytest.raises(ckpt.CheckpointError, match=r"a DeepSpeed checkpoint \(global_step10/: DeepSpeed's own layout"):
        ckpt.format_of(str(tmp_path))


def test_a_save_directory_of_the_other_format_is_refused(saved, tmp_path):
    root, _, _ = saved
    with pytest.raises(ConfigError) as err:
        check_outputs(save=root, load=root, metrics_file=None, tensorboard_dir=None, ckpt_format="megatron_ext")
    assert str(err.value) == (f"--save {root} holds torch_dist checkpoints and this run writes --ckpt-format "
                              "megatron_ext: give --ckpt-format torch_dist to keep one format there, or save elsewhere")


def test_formats_megatron_ext_does_not_write_are_refused():
    with pytest.raises(ConfigError, match=r"^--ckpt-format torch \(Megatron-LM's legacy per-rank files\) is not "
                                          r"written here: use torch_dist"):
        parse_run_config(["--ckpt-format", "torch"])
    assert parse_run_config([]).checkpoint.ckpt_format == "torch_dist"


def test_use_checkpoint_args_takes_the_models_flags_from_the_checkpoint(saved):
    root, _, _ = saved
    # Megatron-LM's rule: the shape where the line does not give it, the rest always.
    cfg = parse_run_config(["--use-checkpoint-args", "--load", root, "--num-attention-heads", "4",
                            "--swiglu", "--normalization", "RMSNorm"], saved_config=ckpt.saved_config)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (2, 32, 4)  # heads given: kept
    assert (m.swiglu, m.normalization) == (False, "LayerNorm")                 # always the checkpoint's
    assert cfg.notes[0] == (f"--use-checkpoint-args: from {root}'s checkpoint: num_layers 2, hidden_size 32, "
                            "seq_length 32, max_position_embeddings 32, swiglu False, normalization LayerNorm, "
                            "attention_dropout 0.0, "
                            "hidden_dropout 0.0")


def test_a_megatron_lm_args_name_is_read_under_ours():
    from megatron_ext.config.checkpoint_args import saved_value

    assert saved_value({"add_bias_linear": False}, "disable_bias_linear") is True
    assert saved_value({"apply_layernorm_1p": True}, "layernorm_zero_centered_gamma") is True


def test_rng_states_under_the_former_names_still_restore(ctx):
    import random

    import numpy as np

    former = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
              "tracker": {}}
    expected = (torch.rand(3), np.random.rand(), random.random())
    dist_ckpt.set_megatron_rng(former)
    again = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]

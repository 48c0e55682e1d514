"""Checkpoint atomicity and integrity of the project's own format (``--ckpt-format megatron_ext``) on one
in-process rank (resharding is in test_training.py; Megatron-LM's torch_dist in test_dist_ckpt.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.config.run import config_from_values
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime.loop import Trainer
from tests.runtime.trainer_helpers import one_rank

VALUES = {**FORMER_DEFAULTS, "ckpt_format": "megatron_ext", "train_iters": 2, "eval_iters": 0, "progress": False,
          "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32, "global_batch_size": 2, "micro_batch_size": 1}


@pytest.fixture(scope="module")
def ctx():
    yield from one_rank(VALUES)


def trainer(ctx, **values) -> Trainer:
    cfg = config_from_values({**VALUES, **values})
    return Trainer(cfg, ctx).setup()


def params(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


@pytest.fixture(scope="module")
def saved(ctx, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    t = trainer(ctx, save=root)
    t.run()
    return root, params(t)


def test_layout_of_a_save(saved):
    root, _ = saved
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000002"
    meta = ckpt.read_meta(os.path.join(root, "iter_0000002"))
    assert meta["iteration"] == 2 and meta["consumed_samples"] == 4
    assert set(meta["files"]) == {"shards_rank00000.pt", "rng_rank00000.pt"}
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}


def test_load_restores_weights_and_position(ctx, saved):
    root, expected = saved
    t = trainer(ctx, load=root)
    assert t.iteration == 2 and t.train_stream.consumed_samples == 4
    assert all(torch.equal(a, b) for a, b in zip(params(t), expected))
    inner = t.optimizer.optimizer
    assert all(float(inner.state[p]["step"]) == 2 for p in t.model.parameters())


@pytest.mark.parametrize("flags, iteration, consumed", [
    ({"finetune": True}, 0, 0),          # Megatron-LM's --finetune: the weights only
    ({"load_optim": False}, 2, 4),       # --no-load-optim: the position, a fresh optimizer and schedule
])
def test_finetune_and_no_load_optim_take_the_weights_and_leave_the_optimizer_fresh(ctx, saved, flags, iteration,
                                                                                    consumed):
    root, expected = saved
    t = trainer(ctx, load=root, **flags)
    assert (t.iteration, t.train_stream.consumed_samples, t.scheduler.num_steps) == (iteration, consumed, 0)
    assert all(torch.equal(a, b) for a, b in zip(params(t), expected))
    assert not t.optimizer.optimizer.state   # no Adam moments, no step counts


def test_pretrained_checkpoint_starts_where_load_holds_none(ctx, saved, tmp_path):
    root, expected = saved
    new = str(tmp_path / "run")   # --save X --load X, X empty: the fine-tuning start, as in Megatron-LM
    t = trainer(ctx, save=new, load=new, pretrained_checkpoint=root)
    assert (t.iteration, t.train_stream.consumed_samples) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(params(t), expected))
    t.run()
    # The next launch of the same line resumes from its own checkpoint, not the pretrained one.
    again = trainer(ctx, save=new, load=new, pretrained_checkpoint=root, train_iters=3)
    assert again.iteration == 2 and again.checkpoint_to_load() == (new, False)
    with pytest.raises(Exception, match="--pretrained-checkpoint .*nowhere: no such directory"):
        config_from_values({**VALUES, "pretrained_checkpoint": str(tmp_path / "nowhere")}).validate(1)


def copy_ckpt(root, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(root, dst)
    return str(dst)


@pytest.mark.parametrize("damage,message", [
    ("truncate", "shards_rank00000.pt is truncated or altered"),
    ("flip", "shards_rank00000.pt is corrupt (sha256 mismatch)"),
    ("delete", "shards_rank00000.pt is missing"),
    ("meta", "meta.json is corrupt"),
])
def test_damaged_checkpoint_is_refused_and_model_untouched(ctx, saved, tmp_path, damage, message):
    root = copy_ckpt(saved[0], tmp_path)
    d = os.path.join(root, "iter_0000002")
    shard = os.path.join(d, "shards_rank00000.pt")
    if damage == "truncate":
        with open(shard, "r+b") as fh:
            fh.truncate(os.path.getsize(shard) // 2)
    elif damage == "flip":
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    elif damage == "delete":
        os.remove(shard)
    else:
        open(os.path.join(d, "meta.json"), "w").write('{"format_version": 1, "iter')
    fresh = trainer(ctx)
    before = params(fresh)
    with pytest.raises(ckpt.CheckpointError) as err:
        fresh.load_checkpoint(root)
    assert message in str(err.value) and d in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), before)), "model half-loaded"


def test_crash_during_save_keeps_previous_checkpoint(ctx, saved, tmp_path, monkeypatch):
    root = copy_ckpt(saved[0], tmp_path)
    t = trainer(ctx, load=root, train_iters=3, save=root)
    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # after the shard file, before the rng file and meta.json
            raise OSError("disk full (simulated)")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(OSError, match="simulated"):
        t.run()
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000002"
    assert os.path.isdir(os.path.join(root, "iter_0000003.partial"))
    assert not os.path.exists(os.path.join(root, "iter_0000003"))
    again = trainer(ctx, load=root)
    assert again.iteration == 2
    assert all(torch.equal(a, b) for a, b in zip(params(again), saved[1]))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint directory \\(no latest_checkpointed_iteration.txt, no 'latest' file, no meta.json\\)"):
        ckpt.resolve(str(tmp_path))
    (tmp_path / "latest").write_text("iter_0000009\n")
    with pytest.raises(ckpt.CheckpointError, match="'latest' names iter_0000009, which does not exist"):
        ckpt.resolve(str(tmp_path))


def test_shape_mismatch_is_refused(ctx, saved):
    bigger = trainer(ctx, hidden_size=64, num_attention_heads=2)
    with pytest.raises(ckpt.CheckpointError, match="has shape .* in the checkpoint"):
        bigger.load_checkpoint(saved[0])


def test_keep_last_prunes_old_checkpoints(ctx, tmp_path):
    root = str(tmp_path / "k")
    trainer(ctx, train_iters=3, save=root, save_interval=1, keep_last=2).run()
    assert sorted(d for d in os.listdir(root) if d.startswith("iter_")) == ["iter_0000002", "iter_0000003"]
    assert json.loads(open(os.path.join(root, "iter_0000003", "meta.json")).read())["iteration"] == 3

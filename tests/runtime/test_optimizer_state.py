"""Optimizer state in checkpoints under megatron's mixed-precision optimizer (bf16 on CPU, one rank).

``--bf16`` builds megatron's ``Float16OptimizerWithFloat16Params`` (under the CPU shims): bf16 model
weights, fp32 master weights and fp32 Adam moments. A checkpoint must carry the masters, moments and
step count, and loading must put them back — else the next step overwrites the loaded weights with
the optimizer's stale masters and restarts Adam. Resharding and the distributed optimizer across
ranks are in test_optimizer_state_multirank.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.config.run import config_from_values
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import distributed
from megatron_ext.runtime.loop import Trainer
from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.runtime.optimizer import MegatronOptimizerOnCPU, _chunks, collect_param_states

VALUES = {**FORMER_DEFAULTS, "eval_iters": 0, "progress": False, "num_layers": 2, "hidden_size": 32,
          "num_attention_heads": 2, "seq_length": 32, "global_batch_size": 4, "micro_batch_size": 2,
          "lr_decay_style": "constant", "lr": 3e-3}


@pytest.fixture(scope="module")
def ctx():
    cfg = config_from_values({**VALUES, "train_iters": 1})
    context = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    yield context
    distributed.teardown()


def trainer(ctx, **values) -> Trainer:
    return Trainer(config_from_values({**VALUES, **values}), ctx).setup()


def losses(t: Trainer) -> list[float]:
    return [h["loss"] for h in t.history if h["kind"] == "train"]


def masters(t: Trainer) -> list[torch.Tensor]:
    return [s["main"] for s in collect_param_states(t.optimizer, list(t.model.parameters()))]


@pytest.fixture(scope="module")
def runs(ctx, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bf16"))
    straight = trainer(ctx, bf16=True, train_iters=20)
    straight.run()
    first = trainer(ctx, bf16=True, train_iters=10, save=root)
    first.run()
    first_masters = masters(first)
    resumed = trainer(ctx, bf16=True, train_iters=20, load=root)
    loaded_masters = masters(resumed)
    resumed.run()
    return {"root": root, "straight": straight, "first": first, "resumed": resumed,
            "first_masters": first_masters, "loaded_masters": loaded_masters}


def test_bf16_uses_megatron_mixed_precision_optimizer(runs):
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    t = runs["straight"]
    assert isinstance(t.optimizer, MegatronOptimizerOnCPU)
    parts = t.optimizer.chained_optimizers
    assert parts and all(isinstance(p, Float16OptimizerWithFloat16Params) for p in parts)
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert losses(t)[-1] < losses(t)[0] - 0.5, "the bf16 run did not learn"


def test_checkpoint_carries_fp32_masters_moments_and_step(runs):
    """The default format (torch_dist): every weight is bf16 beside its fp32 master and moments under
    megatron's optimizer keys, and the step counts are in the common state."""
    from megatron_ext.runtime import dist_ckpt

    path = os.path.join(runs["root"], "iter_0000010")
    shapes = dist_ckpt.tensor_shapes(path)
    weights = [k for k in shapes if not k.startswith("optimizer.")]
    assert weights and len(shapes) == 4 * len(weights)
    dtypes = dist_ckpt.tensor_dtypes(path)
    whole = {k: torch.empty(v, dtype=dtypes[k]) for k, v in shapes.items()}
    dist_ckpt.read_slices(path, {k: [((0,) * t.dim(), t)] for k, t in whole.items()})
    finer = 0
    for key in weights:
        weight, main = whole[key], whole[dist_ckpt.optimizer_key("main", key)]
        assert weight.dtype == torch.bfloat16 and main.dtype == torch.float32
        assert torch.equal(main.to(torch.bfloat16), weight)  # the weight is the rounded master
        finer += int(not torch.equal(main, weight.float()))
        for kind in ("exp_avg", "exp_avg_sq"):
            assert whole[dist_ckpt.optimizer_key(kind, key)].dtype == torch.float32
    steps = dist_ckpt.read_common(path)["megatron_ext"]["optimizer_steps"]
    assert len(steps) == len(runs["first_masters"]) and set(steps.values()) == {10.0}
    # After 10 steps the masters hold precision the bf16 weights do not (else the test proves nothing).
    assert finer == len(weights)


def test_load_puts_masters_back_exactly(runs):
    for saved, loaded in zip(runs["first_masters"], runs["loaded_masters"]):
        assert torch.equal(saved, loaded)
    resumed = runs["resumed"].optimizer
    inner = resumed.chained_optimizers[0].optimizer
    # After 10 more steps each parameter's step count continues from the checkpoint's.
    assert {float(s["step"]) for s in inner.state.values()} == {20.0}


def test_resume_continues_the_same_curve(runs):
    straight = losses(runs["straight"])
    resumed = losses(runs["first"]) + losses(runs["resumed"])
    assert len(resumed) == len(straight) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, straight)) < 1e-6
    for a, b in zip(masters(runs["resumed"]), masters(runs["straight"])):
        assert torch.allclose(a, b, rtol=1e-6, atol=0.0)


def test_fp32_checkpoint_seeds_bf16_masters_at_full_precision(ctx, tmp_path):
    fp32 = trainer(ctx, train_iters=3, save=str(tmp_path))
    fp32.run()
    weights = [p.detach().clone() for p in fp32.model.parameters()]
    bf16 = trainer(ctx, bf16=True, train_iters=3, load=str(tmp_path))
    for w, m, p in zip(weights, masters(bf16), bf16.model.parameters()):
        assert torch.equal(m, w)  # not w rounded through bf16
        assert torch.equal(p.detach(), w.to(torch.bfloat16))
    # The fp32 run's AdamW moments and steps carried over as well.
    inner = bf16.optimizer.chained_optimizers[0].optimizer
    assert len(inner.state) == len(weights) and {float(s["step"]) for s in inner.state.values()} == {3.0}


def test_bf16_checkpoint_gives_fp32_run_the_masters(ctx, runs):
    fp32 = trainer(ctx, train_iters=10, load=runs["root"])
    for m, p in zip(runs["first_masters"], fp32.model.parameters()):
        assert torch.equal(p.detach(), m)


def test_loading_weights_only_still_resets_masters(ctx, runs):
    # --load without optimizer state (load_optim=False): the masters must still follow the loaded
    # weights, or the first step would write the fresh model's masters back over them.
    t = trainer(ctx, bf16=True, train_iters=1)
    ckpt.load(runs["root"], model=t.model, optimizer=t.optimizer, layout=t.layout_dict(), load_optim=False)
    for saved, now in zip(runs["first_masters"], masters(t)):
        assert torch.equal(saved, now)
    inner = t.optimizer.chained_optimizers[0].optimizer
    assert not inner.state, "load_optim=False must not load moments"


def test_gather_chunks_are_consecutive_and_bounded():
    assert _chunks([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    assert _chunks([7], 5) == [[0]] and _chunks([], 5) == []
    sizes = [5, 1, 4, 4, 2, 9, 1]
    runs = _chunks(sizes, 6)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in r) <= 6 or len(r) == 1 for r in runs)

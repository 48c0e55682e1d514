"""--rampup-batch-size and --train-samples in training (one in-process rank): each iteration trains
megatron-core's calculator's batch in as many micro-batches, the data position and the schedule's
sample count follow the batches, and a resume in the middle of the ramp goes on with its batch."""
from __future__ import annotations

import pytest

from megatron_ext.config.defaults import FORMER_DEFAULTS
from tests.config.test_samples import megatron_core_batches
from tests.runtime.trainer_helpers import one_rank, watched_run

VALUES = {**FORMER_DEFAULTS, "eval_iters": 0, "progress": False, "num_layers": 2, "hidden_size": 32,
          "num_attention_heads": 2, "seq_length": 32, "global_batch_size": 8, "micro_batch_size": 2,
          "rampup_batch_size": [2, 2, 12], "lr_warmup_iters": 2}


@pytest.fixture(scope="module")
def ctx():
    yield from one_rank(VALUES)


def run(ctx, **values):
    """(global batch, micro-batches, data position, the schedule's count) of every iteration."""
    return watched_run(ctx, {**VALUES, **values}, lambda t, m: (m.global_batch_size, len(t.last_batches),
                                                                  m.consumed_samples, t.scheduler.num_steps))


def test_each_iteration_trains_the_calculators_batch(ctx, tmp_path):
    trainer, seen = run(ctx, train_iters=8, save=str(tmp_path))
    expected = megatron_core_batches([2, 2, 12], 8, 2, 1, 8)
    assert [(b, n) for b, n, _, _ in seen] == expected
    consumed = [sum(b for b, _ in expected[:i + 1]) for i in range(8)]
    # The data position and the schedule (in samples) advance by each iteration's batch.
    assert [c for _, _, c, _ in seen] == consumed == [s for _, _, _, s in seen]
    assert trainer.train_stream.consumed_samples == consumed[-1]

    # Resumed from the checkpoint of iteration 8: the ramp goes on from its data position.
    resumed, more = run(ctx, train_iters=10, load=str(tmp_path))
    assert resumed.iteration == 10
    assert [(b, n) for b, n, _, _ in more] == megatron_core_batches([2, 2, 12], 8, 2, 1, 10)[8:]
    assert more[-1][3] == consumed[-1] + 16


def test_train_samples_end_where_the_samples_do(ctx):
    trainer, seen = run(ctx, train_samples=40, rampup_batch_size=None, lr_warmup_iters=0, lr_warmup_samples=16)
    assert trainer.cfg.training.train_iters == 5 and len(seen) == 5
    assert seen[-1][2] == 40 == seen[-1][3]

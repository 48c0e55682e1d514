"""Megatron-LM's sample-based training (config/samples.py): --train-samples and the --lr-*-samples
schedule equal the iteration-based one where they coincide, --lr-warmup-fraction, the batch of each
iteration under --rampup-batch-size as megatron-core's calculator gives it, and every bad pairing
refused in one line."""
from __future__ import annotations

import pytest
import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import parse_run_config
from megatron_ext.config.samples import iterations_for_samples, schedule_steps
from megatron_ext.runtime.optimizer import build_scheduler

BATCH = ["--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-5"]


def rates(argv: list[str], iterations: int) -> list[float]:
    """The learning rate of each of ``iterations`` iterations under the run's scheduler."""
    t = parse_run_config(BATCH + argv).training
    param = torch.nn.Parameter(torch.zeros(1))
    sched = build_scheduler(torch.optim.SGD([param], lr=t.lr), t)
    sched.step(0)
    out = []
    for _ in range(iterations):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step(1)
    return out


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_the_sample_based_schedule_is_the_iteration_based_one_where_they_coincide(style):
    by_iters = rates(["--train-iters", "20", "--lr-warmup-iters", "4", "--lr-decay-iters", "16",
                      "--lr-decay-style", style], 20)
    by_samples = rates(["--train-samples", "160", "--lr-warmup-samples", "32", "--lr-decay-samples", "128",
                        "--lr-decay-style", style], 20)
    assert by_samples == by_iters
    assert by_iters[0] == 0.0 and by_iters[4] == 1e-3 and by_iters[-1] == 1e-5 and len(set(by_iters)) > 10
    # --lr-warmup-fraction: a quarter of the decay is the same 4 iterations (32 samples).
    assert rates(["--train-iters", "20", "--lr-warmup-fraction", "0.25", "--lr-decay-iters", "16",
                  "--lr-decay-style", style], 20) == by_iters
    assert rates(["--train-samples", "160", "--lr-warmup-fraction", "0.25", "--lr-decay-samples", "128",
                  "--lr-decay-style", style], 20) == by_iters


def test_train_samples_derive_the_iterations_as_megatron_lm_does():
    t = parse_run_config(BATCH + ["--train-samples", "165"]).training
    assert t.train_iters == 20   # the partial last batch is dropped
    steps = schedule_steps(t)
    assert (steps.unit, steps.decay, steps.warmup, steps.wd_incr) == ("samples", 165, 0, 165)
    assert schedule_steps(parse_run_config(BATCH).training).unit == "iterations"
    assert parse_run_config([]).training.train_iters == 50


def megatron_core_batches(ramp: list[int], global_batch: int, micro_batch: int, dp: int, iterations: int):
    """The global batch of each iteration, straight from megatron-core's calculator as Megatron-LM's
    training loop drives it (update with the consumed samples, then train that batch)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calc = RampupBatchsizeNumMicroBatchesCalculator(global_batch, micro_batch, dp, False, 1, *ramp)
    consumed, out = 0, []
    for _ in range(iterations):
        calc.update(consumed, consistency_check=True)
        out.append((calc.get_current_global_batch_size(), calc.get()))
        consumed += calc.get_current_global_batch_size()
    return out


def test_the_ramp_gives_megatron_cores_batch_at_every_iteration():
    t = parse_run_config(BATCH + ["--rampup-batch-size", "2", "2", "20", "--train-iters", "12"]).training
    consumed, ours = 0, []
    for _ in range(12):
        batch = t.global_batch_at(consumed)
        ours.append((batch, batch // (t.micro_batch_size * 1)))
        consumed += batch
    assert ours == megatron_core_batches([2, 2, 20], 8, 2, 1, 12)
    assert [b for b, _ in ours] == [2, 2, 2, 2, 4, 4, 6, 8, 8, 8, 8, 8]   # 20/3 samples a step, then 8


def test_train_samples_with_a_ramp_count_the_ramps_iterations():
    ramp = [2, 2, 20]
    t = parse_run_config(BATCH + ["--rampup-batch-size", *map(str, ramp), "--train-samples", "100"]).training
    # Megatron-LM's update_train_iters: ramp iterations until its samples are passed, then full batches.
    batches = [b for b, _ in megatron_core_batches(ramp, 8, 2, 1, 40)]
    consumed = iterations = 0
    while consumed <= ramp[2] and consumed <= 100:
        consumed += batches[iterations]
        iterations += 1
    assert t.train_iters == iterations + (100 - consumed) // 8 == iterations_for_samples(100, 8, 2, ramp)


def test_the_schedule_of_a_ramp_counts_samples_and_steps_by_each_batch():
    argv = ["--rampup-batch-size", "2", "2", "20", "--train-iters", "12", "--lr-decay-iters", "12"]
    t = parse_run_config(BATCH + argv).training
    steps = schedule_steps(t)
    assert (steps.unit, steps.decay, steps.wd_incr) == ("samples", 12 * 8, 12 * 8)
    sched = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr), t)
    sched.step(0)
    for _ in range(12):
        sched.step(1)
    assert sched.num_steps == sum(b for b, _ in megatron_core_batches([2, 2, 20], 8, 2, 1, 12))


@pytest.mark.parametrize("argv, message", [
    (["--train-iters", "10", "--train-samples", "160"], "--train-iters 10 and --train-samples 160 (20 iterations) "
     "both give the run's length: give one"),
    (["--train-samples", "4"], "--train-samples 4 is less than one global batch (8)"),
    (["--train-samples", "160", "--lr-warmup-iters", "2"], "--lr-warmup-iters count iterations; with --train-samples "
     "the schedule counts samples: give --lr-warmup-samples / --lr-decay-samples"),
    (["--lr-decay-samples", "100"], "--lr-decay-samples needs --train-samples (with --train-iters: --lr-warmup-iters "
     "/ --lr-decay-iters)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters / "
     "--lr-warmup-samples each set the warm-up: give one"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1), got 1.5"),
    (["--rampup-batch-size", "2", "2"], "--rampup-batch-size takes START INCREMENT SAMPLES (three numbers), got 2 2"),
    (["--rampup-batch-size", "2", "4", "100"], "--rampup-batch-size 2 4 100: the batch must grow from 2 to "
     "--global-batch-size (8) in steps of 4"),
    (["--rampup-batch-size", "0", "2", "100"], "--rampup-batch-size 0 2 100: START and INCREMENT must be >= 1 and "
     "SAMPLES >= 0"),
])
def test_bad_schedules_are_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config(BATCH + argv)
    assert str(err.value) == message


@pytest.mark.parametrize("argv, world, message", [
    (["--rampup-batch-size", "2", "2", "20"], 2, "--rampup-batch-size 2 2 20: its global batch 2 is not a multiple of "
     "--micro-batch-size (2) x data-parallel size (2)"),
    (["--rampup-batch-size", "2", "2", "20", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--virtual-pipeline-model-parallel-size", "2"], 2, "--rampup-batch-size 2 2 20: its global batch 2 is not a "
     "multiple of --micro-batch-size (2) x data-parallel size (1) x --pipeline-model-parallel-size (2) under "
     "interleaving"),
    (["--rampup-batch-size", "4", "4", "20", "--data-parallel-microbatches", "3", "1"], 2, "--rampup-batch-size 4 4 "
     "20 and --data-parallel-microbatches: the replicas' micro-batches are fixed there, the global batch grows "
     "here: give one"),
    (["--rampup-batch-size", "4", "4", "20", "--engine", "deepspeed"], 1, "--rampup-batch-size needs --engine "
     "megatron: DeepSpeed's engine fixes its batch (train_batch_size) when it is built"),
])
def test_a_ramp_the_layout_cannot_split_is_refused_before_any_rank_starts(argv, world, message):
    cfg = parse_run_config(BATCH + argv)
    with pytest.raises(ConfigError) as err:
        cfg.validate(world)
    assert str(err.value) == message

"""Megatron-LM's sample-based training: how big each iteration's global batch is, how many iterations
``--train-samples`` makes, and in which unit the learning-rate schedule counts.

``--rampup-batch-size START INCREMENT SAMPLES`` grows the global batch from START by INCREMENT up to
``--global-batch-size`` over the first SAMPLES samples; the batch of an iteration is what
megatron-core's calculator (``megatron.core.num_microbatches_calculator``) says at the data position
the iteration starts from. ``--train-samples`` derives the iterations as Megatron-LM does
(``update_train_iters``: the ramp's iterations, then whole full batches). The schedule
(``OptimizerParamScheduler``) counts iterations, as it always did here, unless the run is sample-based
(``--train-samples``) or ramps its batch: then it counts samples, as Megatron-LM's does, and steps by
each iteration's batch -- with a constant batch the two give the same rates. Pure: no torch.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


def rampup_batch(rampup: Sequence[int], global_batch: int, micro_batch: int, consumed_samples: int) -> int:
    """The global batch of the iteration that starts after ``consumed_samples`` samples (megatron-core's
    ``RampupBatchsizeNumMicroBatchesCalculator``; its consistency with the data-parallel size is
    ``RunConfig.validate``'s)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    start, increment, samples = (int(v) for v in rampup)
    calc = RampupBatchsizeNumMicroBatchesCalculator(global_batch, micro_batch, 1, False, 1, start, increment, samples)
    calc.update(consumed_samples, consistency_check=False)
    return calc.get_current_global_batch_size()


def rampup_sizes(rampup: Sequence[int], global_batch: int) -> list[int]:
    """Every global batch a ramp goes through, the final one included."""
    start, increment, _ = (int(v) for v in rampup)
    return list(range(start, global_batch, increment)) + [global_batch]


def iterations_for_samples(train_samples: int, global_batch: int, micro_batch: int,
                           rampup: Sequence[int] | None) -> int:
    """The iterations of ``--train-samples`` (Megatron-LM's ``update_train_iters``): with a ramp, its
    iterations until the ramp's samples (or the run's) are passed, then whole full batches; the
    partial last batch is dropped."""
    if rampup is None:
        return train_samples // global_batch
    iterations = consumed = 0
    while consumed <= int(rampup[2]) and consumed <= train_samples:
        consumed += rampup_batch(rampup, global_batch, micro_batch, consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    return iterations


@dataclasses.dataclass(frozen=True)
class ScheduleSteps:
    """The learning-rate schedule's lengths in its own unit: "iterations" (the scheduler steps 1 an
    iteration) or "samples" (it steps by each iteration's global batch, as Megatron-LM's does)."""

    unit: str
    warmup: float
    decay: int
    wd_incr: int


def schedule_steps(t) -> ScheduleSteps:
    """The schedule of a ``TrainingConfig`` (Megatron-LM's ``get_optimizer_param_scheduler``)."""
    if t.train_samples is not None:
        decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.train_samples
        warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None else t.lr_warmup_samples
        return ScheduleSteps("samples", warmup, decay, t.train_samples)
    if t.rampup_batch_size is not None:
        # Iterations with a ramp (Megatron-LM refuses the pair; its formulas for iterations, in samples).
        decay = t.lr_decay_iters * t.global_batch_size
        warmup = (t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None
                  else t.lr_warmup_iters * t.global_batch_size)
        return ScheduleSteps("samples", warmup, decay, t.train_iters * t.global_batch_size)
    warmup = t.lr_warmup_fraction * t.lr_decay_iters if t.lr_warmup_fraction is not None else t.lr_warmup_iters
    return ScheduleSteps("iterations", warmup, t.lr_decay_iters, t.train_iters)

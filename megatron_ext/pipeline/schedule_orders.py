"""Per-stage compute order of the pipeline schedules we run, as plain data.

A schedule is, for every pipeline stage, the sequence in which it runs the forward (``F``) and
backward (``B``) pass of each (micro-batch, model chunk). Together with the pipeline topology
(who feeds whom) this is all a simulator or a timeline checker needs, so it lives here with no
torch or framework import and is shared by the pipeline-event code and the ResiHP simulator.

Three schedules are reproduced, each checked op-for-op against the real code in
``tests/pipeline/test_schedule_orders.py``:

* ``1f1b``: megatron-core ``forward_backward_pipelining_without_interleaving``;
* ``interleaved``: megatron-core ``forward_backward_pipelining_with_interleaving`` (virtual
  pipeline, ``microbatch_group_size_per_vp_stage``);
* ``deepspeed``: DeepSpeed ``runtime.pipe.schedule.TrainSchedule``.

DeepSpeed runs the same compute order as megatron's 1F1B, but in lock-step "steps": the
activation of a forward pass is sent at the start of the following step, and when that step is a
backward the send comes only after the gradient for it was received. ``Op.deferred_send`` marks
those forwards; it changes the timing (a downstream stage waits for an upstream backward's input),
so the simulator honours it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Sequence

logger = logging.getLogger(__name__)

SCHEDULES = ("1f1b", "interleaved", "deepspeed")

FORWARD = "F"
BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Op:
    """One compute op on a stage: phase ``F``/``B`` of ``microbatch`` on model ``chunk``.

    ``deferred_send``: the op's output leaves the stage only when the stage starts its next op
    (DeepSpeed's step structure), not when the op finishes.
    """

    phase: str
    microbatch: int
    chunk: int = 0
    deferred_send: bool = False

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.phase, self.microbatch, self.chunk)

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclasses.dataclass(frozen=True)
class ScheduleOrder:
    """The compute order of every stage of one pipeline iteration."""

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    stages: tuple[tuple[Op, ...], ...]

    def producer(self, stage: int, op: Op) -> tuple[int, Op] | None:
        """The (stage, op) whose output ``op`` consumes from another stage, or None.

        Model chunk ``v`` of stage ``s`` is virtual stage ``v * p + s`` (megatron's placement), so
        the forward of chunk ``v`` on stage 0 consumes the forward of chunk ``v - 1`` on the last
        stage, and backwards run the same chain in reverse.
        """
        p, v = self.num_stages, op.chunk
        if op.phase == FORWARD:
            if stage > 0:
                return stage - 1, Op(FORWARD, op.microbatch, v)
            if v > 0:
                return p - 1, Op(FORWARD, op.microbatch, v - 1)
            return None
        if stage < p - 1:
            return stage + 1, Op(BACKWARD, op.microbatch, v)
        if v < self.num_chunks - 1:
            return 0, Op(BACKWARD, op.microbatch, v + 1)
        # The very last virtual stage turns its own forward output into the loss gradient.
        return stage, Op(FORWARD, op.microbatch, v)

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """(stage, position, op) for every op."""
        for s, ops in enumerate(self.stages):
            for k, op in enumerate(ops):
                yield s, k, op

    def format(self) -> str:
        """One line per stage, e.g. ``stage 0: F0 F1 B0 F2 B1 B2``; ``*`` marks a deferred send."""
        return "\n".join(f"stage {s}: " + " ".join(str(o) + ("*" if o.deferred_send else "") for o in ops)
                         for s, ops in enumerate(self.stages))


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def megatron_1f1b(num_stages: int, num_microbatches: int, extra_warmup: Sequence[int] = ()) -> ScheduleOrder:
    """Megatron's non-interleaved 1F1B: ``p - s - 1`` warm-up forwards, then one forward and one
    backward alternately, then the cool-down backwards.

    ``extra_warmup[s]``: forwards stage ``s`` runs ahead beyond megatron's warm-up (ADAPTRA's
    adapted schedule, which the resilience simulator scores; none: megatron's own)."""
    _check_sizes(num_stages, num_microbatches)
    extra = list(extra_warmup) or [0] * num_stages
    if len(extra) != num_stages:
        raise ValueError(f"extra_warmup: one count per stage ({num_stages}), got {extra}")
    stages = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1 + extra[s], num_microbatches)
        ops = [Op(FORWARD, i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            ops += [Op(FORWARD, warmup + i), Op(BACKWARD, i)]
        ops += [Op(BACKWARD, i) for i in range(num_microbatches - warmup, num_microbatches)]
        stages.append(tuple(ops))
    return ScheduleOrder("1f1b", num_stages, num_microbatches, 1, tuple(stages))


def _interleaved_table(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each virtual micro-batch: micro-batches go in groups of ``group``,
    each group through all chunks in turn; the last group takes whatever is left."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(mb, chunk) for chunk in range(num_chunks) for mb in range(first, last)]
    return table


def megatron_interleaved(num_stages: int, num_microbatches: int, num_chunks: int,
                         microbatch_group_size: int | None = None) -> ScheduleOrder:
    """Megatron's interleaved 1F1B over ``num_chunks`` model chunks per stage.

    ``microbatch_group_size`` is megatron's ``microbatch_group_size_per_vp_stage`` (default: the
    number of stages). Megatron refuses the same configurations, with the same reasons.
    """
    _check_sizes(num_stages, num_microbatches)
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    group = num_stages if microbatch_group_size is None else microbatch_group_size
    if not num_stages <= group <= num_microbatches:
        raise ValueError(f"microbatch_group_size must lie in [num_stages={num_stages}, "
                         f"num_microbatches={num_microbatches}], got {group}")
    if 0 < num_microbatches % group < num_stages:
        raise ValueError(f"num_microbatches % microbatch_group_size = {num_microbatches % group} must be 0 "
                         f"or >= num_stages={num_stages} (megatron refuses it: dependency bubbles)")
    table = _interleaved_table(num_microbatches, num_chunks, group)
    total = num_microbatches * num_chunks
    stages = []
    for s in range(num_stages):
        if num_stages > 1:
            warmup = min((num_stages - s - 1) * 2 + (num_chunks - 1) * group, total)
        else:
            warmup = 0

        def fwd(k: int) -> Op:
            mb, chunk = table[k]
            return Op(FORWARD, mb, chunk)

        def bwd(k: int) -> Op:
            # Backward virtual micro-batch k walks the chunks in reverse; per chunk, backwards
            # pop in forward (FIFO) order, which is the table's micro-batch order.
            mb, chunk = table[k]
            return Op(BACKWARD, mb, num_chunks - 1 - chunk)

        ops = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [fwd(k + warmup), bwd(k)]
        ops += [bwd(k) for k in range(total - warmup, total)]
        stages.append(tuple(ops))
    return ScheduleOrder("interleaved", num_stages, num_microbatches, num_chunks, tuple(stages))


def _ds_step_to_microbatch(step: int, stage: int, num_stages: int) -> tuple[int, bool]:
    """DeepSpeed's lock-step mapping: even stages run forwards on even steps, odd stages on odd
    steps; the other parity is a backward step. Returns (micro-batch, is_forward); the
    micro-batch may be out of range (an idle step)."""
    if step % 2 == stage % 2:
        return step // 2 - stage // 2, True
    if step % 2 == 0:  # odd stage, backward step
        return step // 2 - num_stages + (stage + 1) // 2, False
    return (step - 1) // 2 - num_stages + 1 + stage // 2, False


def deepspeed_train(num_stages: int, num_microbatches: int) -> ScheduleOrder:
    """DeepSpeed's ``TrainSchedule``: 2 * (m + p - 1) lock-step steps per stage."""
    _check_sizes(num_stages, num_microbatches)
    total_steps = 2 * (num_microbatches + num_stages - 1)
    stages = []
    for s in range(num_stages):
        steps = [_ds_step_to_microbatch(t, s, num_stages) for t in range(total_steps)]
        ops: list[Op] = []
        for t, (mb, is_forward) in enumerate(steps):
            if not 0 <= mb < num_microbatches:
                continue
            if is_forward:
                # The activation goes out at the start of step t + 1, after that step's RecvGrad
                # when it is a backward step with a valid micro-batch. The last stage sends none.
                deferred = False
                if s < num_stages - 1 and t + 1 < total_steps:
                    nxt_mb, nxt_fwd = steps[t + 1]
                    deferred = (not nxt_fwd) and 0 <= nxt_mb < num_microbatches
                ops.append(Op(FORWARD, mb, 0, deferred))
            else:
                ops.append(Op(BACKWARD, mb))
        stages.append(tuple(ops))
    return ScheduleOrder("deepspeed", num_stages, num_microbatches, 1, tuple(stages))


def schedule_order(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1,
                   microbatch_group_size: int | None = None) -> ScheduleOrder:
    """Build a schedule by name (one of ``SCHEDULES``)."""
    if name == "1f1b":
        if num_chunks != 1:
            raise ValueError(f"schedule '1f1b' runs one model chunk per stage, got num_chunks={num_chunks}; "
                             "use 'interleaved'")
        return megatron_1f1b(num_stages, num_microbatches)
    if name == "interleaved":
        return megatron_interleaved(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    if name == "deepspeed":
        if num_chunks != 1:
            raise ValueError(f"schedule 'deepspeed' runs one model chunk per stage, got num_chunks={num_chunks}")
        return deepspeed_train(num_stages, num_microbatches)
    raise ValueError(f"unknown schedule '{name}'; expected one of {', '.join(SCHEDULES)}")

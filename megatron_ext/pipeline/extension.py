"""``--timeline`` / ``--timeline-out``: pipeline events in the training loop, on every engine.

Asks the trainer to record into its recorder (``Trainer.install_recorder``: megatron-core's schedule
wrapped from outside, or DeepSpeed's engine recording its own instructions), resets the recorder
each iteration, puts each stage's bubble fraction into the log line and TensorBoard at every log
interval, and writes Chrome-trace timelines of the chosen iterations. Other extensions (ResiHP, the
Bubble Squeezer) declare it in ``requires``, read ``recorder`` and call ``record()`` for the joined
IterationRecord.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from megatron_ext.config.base import ConfigError, doc
from megatron_ext.config.run import section
from megatron_ext.runtime.extension import Extension, IterationMetrics, register_extension

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.pipeline.timeline import IterationRecord
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)


@section("timeline")
@dataclasses.dataclass(kw_only=True)
class TimelineConfig:
    """Pipeline events, bubble fractions and Chrome-trace timelines."""

    timeline: bool = doc("Record pipeline events: per-stage bubble fraction in log lines and TensorBoard.", False)
    timeline_out: str | None = doc("Write Chrome-trace JSON timelines (Perfetto) into this directory; "
                                   "implies --timeline.", None)
    timeline_iters: list[int] | None = doc("Iterations to write with --timeline-out; default: the last one.", None)
    timeline_capacity: int = doc("Events kept per rank per iteration (more are dropped and counted).", 16384)

    def __post_init__(self) -> None:
        if self.timeline_out:
            self.timeline = True
        if self.timeline_capacity < 16:
            raise ConfigError(f"--timeline-capacity must be >= 16, got {self.timeline_capacity}")
        if self.timeline_iters is not None and any(i < 1 for i in self.timeline_iters):
            raise ConfigError(f"--timeline-iters must be iteration numbers >= 1, got {self.timeline_iters}")


class TimelineExtension(Extension):
    name = "timeline"

    def __init__(self, cfg: TimelineConfig) -> None:
        self.cfg = cfg
        self.recorder = None
        self.hooks = None
        self.offset_s = 0.0
        # Set by the Bubble Squeezer: this rank's guest run intervals, drawn in exported timelines.
        self.guest_runs = None

    def setup(self, trainer: "Trainer") -> None:
        from megatron_ext.pipeline.events import EventRecorder, timing_for

        # CUDA events on a GPU (also for ResiHP's op durations, read from this recorder).
        self.recorder = EventRecorder(self.cfg.timeline_capacity, timing=timing_for(trainer.ctx.device))
        last = trainer.cfg.training.train_iters
        self.export = set(self.cfg.timeline_iters or [last])
        self.attach(trainer)

    def attach(self, trainer: "Trainer") -> None:
        """Record this layout's events (again after a layout change: new chunks, a new engine)."""
        self.hooks = trainer.install_recorder(self.recorder)
        self.schedule = trainer.schedule_name
        self._sync_clocks(trainer)

    def _sync_clocks(self, trainer: "Trainer") -> None:
        """Collective: the clock offsets, at the start and again over every new world (its hosts
        may differ; a process that joins sets up while the others attach, and both do it here)."""
        from megatron_ext.pipeline.collect import clock_offsets
        from megatron_ext.runtime.distributed import collective_device

        change = getattr(trainer, "layout_change", None)
        if change is None or change.generation is not None:
            self.offset_s = clock_offsets(self.recorder.clock, collective_device(trainer.ctx))

    def detach(self, trainer: "Trainer") -> None:
        self.teardown(trainer)

    def before_iteration(self, trainer: "Trainer", iteration: int) -> None:
        self.recorder.reset()
        if self.hooks is not None:
            self.hooks.new_iteration()

    def record(self, trainer: "Trainer", iteration: int, dst: int | None = None) -> "IterationRecord | None":
        """Collective: the joined record of the iteration just run (on ``dst``, or every rank)."""
        from megatron_ext.pipeline.collect import gather_record

        c = trainer.ctx.coord
        return gather_record(
            self.recorder, rank=trainer.ctx.rank, stage=c.pp, tp=c.tp, dp=c.dp, offset_s=self.offset_s,
            iteration=iteration, schedule=self.schedule, num_stages=trainer.ctx.layout.pp,
            num_microbatches=trainer.train_stream.num_microbatches, num_chunks=trainer.ctx.vpp or 1,
            doc_lengths=[b["doc_lengths"] for b in trainer.last_batches], dst=dst)

    def after_iteration(self, trainer: "Trainer", metrics: IterationMetrics) -> None:
        from megatron_ext.pipeline.collect import stage_bubble_fractions
        from megatron_ext.runtime.distributed import collective_device

        it = metrics.iteration
        last = trainer.cfg.training.train_iters
        if it % trainer.cfg.logging.log_interval == 0 or it == last:
            c = trainer.ctx.coord
            fractions = stage_bubble_fractions(self.recorder, stage=c.pp, num_stages=trainer.ctx.layout.pp,
                                               is_representative=(c.tp == 0 and c.dp == 0), offset_s=self.offset_s,
                                               device=collective_device(trainer.ctx))
            metrics.extra.update({f"bubble_s{s}": round(f, 4) for s, f in enumerate(fractions)})
        if self.cfg.timeline_out and it in self.export:
            from megatron_ext.pipeline.trace import write_chrome_trace

            record = self.record(trainer, it, dst=0)
            guests = self._gather_guest_runs(trainer) if self.guest_runs is not None else None
            if record is not None:
                path = os.path.join(self.cfg.timeline_out, f"timeline_iter{it:07d}.json")
                write_chrome_trace(record, path, guests=guests)
                logger.info("wrote %s (bubble fraction per stage %s)", path,
                            [round(f, 3) for f in record.stage_bubble_fractions()])
        if self.recorder.dropped:
            logger.warning("timeline: %d events dropped in iteration %d; raise --timeline-capacity",
                           self.recorder.dropped, it)

    def _gather_guest_runs(self, trainer: "Trainer") -> dict[int, list[tuple[float, float]]] | None:
        """Collective: every rank's guest intervals on rank 0 (on rank 0's clock)."""
        import torch.distributed as dist

        mine = [(t0 - self.offset_s, t1 - self.offset_s) for t0, t1 in self.guest_runs()]
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return {trainer.ctx.rank: mine}
        parts = [None] * dist.get_world_size() if trainer.ctx.rank == 0 else None
        dist.gather_object((trainer.ctx.rank, mine), parts, dst=0)
        return dict(parts) if parts is not None else None

    def teardown(self, trainer: "Trainer") -> None:
        if self.hooks is not None:
            self.hooks.uninstall()
            self.hooks = None


@register_extension("timeline")
def _factory(cfg, required: bool = False) -> TimelineExtension | None:
    tl = cfg.ext("timeline")
    # ``required``: another extension reads the pipeline events (ResiHP, the Bubble Squeezer).
    if tl is None or not (tl.timeline or required):
        return None
    return TimelineExtension(tl)

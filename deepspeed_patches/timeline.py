"""``--timeline`` / ``--timeline-out`` for ``--engine deepspeed``.

The megatron variant (``megatron_ext.pipeline.extension.TimelineExtension``) wraps megatron-core's
schedule from outside; here the engine records its own instructions (``EventPipelineEngine``), so
setting up is attaching a recorder. Everything else — bubble fractions in log lines and TensorBoard,
Chrome traces of the chosen iterations, ``record()`` for other extensions — is the base class's,
with the same config section and the ``deepspeed`` schedule for the expected bubbles.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.pipeline.extension import TimelineExtension

if TYPE_CHECKING:  # pragma: no cover
    from deepspeed_patches.trainer import DeepSpeedTrainer


class DeepSpeedTimelineExtension(TimelineExtension):
    name = "timeline"

    def setup(self, trainer: "DeepSpeedTrainer") -> None:
        from megatron_ext.pipeline.events import EventRecorder, timing_for

        self.recorder = EventRecorder(self.cfg.timeline_capacity, timing=timing_for(trainer.ctx.device))
        self.schedule = "deepspeed"
        self.export = set(self.cfg.timeline_iters or [trainer.cfg.training.train_iters])
        self.attach(trainer)

    def attach(self, trainer: "DeepSpeedTrainer") -> None:
        """(Again after a live re-layout: the new engine records into the same recorder.)"""
        trainer.engine.attach_recorder(self.recorder)
        self._sync_clocks(trainer)

    def before_iteration(self, trainer: "DeepSpeedTrainer", iteration: int) -> None:
        self.recorder.reset()

    def teardown(self, trainer: "DeepSpeedTrainer") -> None:
        # The recorder keeps the last iteration's events: record() still works after the run.
        if trainer.engine is not None:  # None on a rank that left the layout (a spare)
            trainer.engine.attach_recorder(None)

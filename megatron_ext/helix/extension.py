"""``pretrain_gpt.py --helix``: compile each model chunk with the Helix backend.

The chunk's GPTModel is made traceable (``adapter.make_traceable``: its TP/SP regions become
functional collectives + waits in the graph) and its ``forward`` is wrapped in ``torch.compile``
with the backend built from the ``helix`` config section. Compilation happens at the first
forward; the device calibration (agreed over the world group) runs at setup, on every rank.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import section
from megatron_ext.helix.config import HelixConfig
from megatron_ext.runtime.extension import Extension, register_extension

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

UNTILED = "untiled"
"""The measured selection's reference candidate: the Helix backend with no pass."""

section("helix")(HelixConfig)


class HelixExtension(Extension):
    name = "helix"

    def __init__(self, cfg: HelixConfig) -> None:
        self.cfg = cfg
        self.models: list = []
        self.backend = None
        self.untiled_backend = None
        # measured selection (--helix-select-rounds): per model, candidate name -> compiled forward
        self.candidates: list[dict] = []
        self.selection = None
        self.step = 0
        self.decision = None

    def setup(self, trainer: "Trainer") -> None:
        from megatron_ext.helix.compiler import backend_from_config

        chunks = getattr(trainer.model, "chunks", None)
        if chunks is None:
            raise ConfigError("--helix needs the megatron engine (--engine megatron)")
        # Calibration agrees over the world group: here, where every rank is (see prepare()).
        self.backend = backend_from_config(self.cfg, batch_size=trainer.cfg.training.micro_batch_size).prepare()
        if self.cfg.select_rounds:
            import dataclasses

            # the untiled candidate: no pass, so no decision for a calibrated cost model to make
            untiled = dataclasses.replace(self.cfg, helix_mode="baseline", helix_cost_model="analytical",
                                          helix_select_rounds=0)
            self.untiled_backend = backend_from_config(untiled, batch_size=trainer.cfg.training.micro_batch_size
                                                       ).prepare()
        self.attach(trainer)

    def attach(self, trainer: "Trainer") -> None:
        """Compile this layout's model chunks (a re-layout brings new chunks: new graphs)."""
        import torch

        from megatron_ext.helix import rng
        from megatron_ext.helix.adapter import make_traceable, prefill_first_call_state
        from megatron_ext.runtime.model import unwrap

        if trainer.ctx.device.type == "cuda" and rng.apply():  # the CUDA RNG setter's deadlock (helix/rng.py)
            logger.info("helix: megatron's CUDA RNG-state setter runs outside Dynamo "
                        "(torch.cuda._lazy_call re-enters its lock)")
        seq_length = getattr(getattr(trainer.cfg, "model", None), "seq_length", None)
        for chunk in trainer.model.chunks:
            model = unwrap(chunk)
            report = make_traceable(model)
            if seq_length is not None:  # else the first micro-batch's graph creates it: two graphs
                prefill_first_call_state(model, trainer.cfg.training.micro_batch_size, seq_length)
            if self.untiled_backend is not None:
                compiled = {UNTILED: torch.compile(model.forward, backend=self.untiled_backend, dynamic=False),
                            self.schedule_name: torch.compile(model.forward, backend=self.backend, dynamic=False)}
                self.candidates.append(compiled)
                model.forward = compiled[UNTILED]
            else:
                model.forward = torch.compile(model.forward, backend=self.backend, dynamic=False)
            self.models.append(model)
            if trainer.ctx.rank == 0:
                logger.info("helix: %d tensor-parallel regions made traceable; tiles=%d, memory budget %s, "
                            "cost model %s", report.total, self.cfg.helix_tiles,
                            f"{self.cfg.helix_memory_budget_gb} GiB" if self.cfg.helix_memory_budget_gb else "none",
                            self.cfg.helix_cost_model)

        if self.untiled_backend is not None:
            from megatron_ext.helix.selection import MeasuredSelection

            self.selection = MeasuredSelection([UNTILED, self.schedule_name], self.cfg.select_rounds)
            self.step, self.decision = 0, None

    @property
    def schedule_name(self) -> str:
        return f"helix-{self.cfg.helix_mode}-k{self.cfg.helix_tiles}"

    def before_iteration(self, trainer: "Trainer", iteration: int) -> None:
        if self.selection is None:
            return
        name = self.selection.candidate(self.step)
        for model, compiled in zip(self.models, self.candidates):
            model.forward = compiled[name]

    def after_iteration(self, trainer: "Trainer", metrics) -> None:
        if self.selection is None:
            return
        self.selection.record(self.step, metrics.iter_time_s)
        self.step += 1
        if self.step == len(self.selection.names) and not self.any_graph_tiled(trainer):
            # every candidate has compiled: where the simulator tiled no graph they are one schedule
            self.selection = None
            self.decision = None
            if trainer.ctx.rank == 0:
                logger.info("helix: the simulator kept every graph untiled: nothing to measure, the untiled "
                            "graph runs")
            for model, compiled in zip(self.models, self.candidates):
                model.forward = compiled[UNTILED]
            return
        if self.step < self.selection.done_after:
            return
        self.decide(trainer)

    def any_graph_tiled(self, trainer: "Trainer") -> bool:
        """Whether the schedule kept a tiled graph on any rank (all ranks agree: a stage whose
        graphs stayed untiled must still measure beside a stage whose graphs did not)."""
        import torch
        import torch.distributed as dist

        tiled = any(s.tiled for s in self.backend.summaries)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return tiled
        from megatron_ext.runtime.distributed import collective_device

        t = torch.tensor([int(tiled)], device=collective_device(trainer.ctx))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def decide(self, trainer: "Trainer") -> None:
        """Every rank's samples, the slowest of each iteration (all-reduce MAX), decide: every rank
        keeps the same graph (its collectives must match its peers')."""
        import torch
        import torch.distributed as dist

        agreed = self.selection.vector()
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megatron_ext.runtime.distributed import collective_device

            t = torch.tensor(agreed, dtype=torch.float64, device=collective_device(trainer.ctx))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            agreed = t.cpu().tolist()
        self.decision = self.selection.decide(agreed)
        for model, compiled in zip(self.models, self.candidates):
            model.forward = compiled[self.decision.chosen]
        self.selection = None
        if trainer.ctx.rank == 0:
            logger.info("%s", self.decision.line())

    def detach(self, trainer: "Trainer") -> None:
        self.teardown(trainer)

    def teardown(self, trainer: "Trainer") -> None:
        from megatron_ext.helix import rng
        from megatron_ext.helix.adapter import restore

        for model in self.models:
            model.__dict__.pop("forward", None)
            restore(model)
        self.models.clear()
        self.candidates.clear()
        self.selection = None
        rng.remove()


@register_extension("helix")
def _factory(cfg) -> HelixExtension | None:
    h = cfg.ext("helix")
    if h is None or not h.helix:
        return None
    from megatron_ext.engines import engine

    engine(cfg.parallel.engine).refuse("helix")
    return HelixExtension(h)

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
        # measured selection (--helix-select-rounds): candidate name -> its backend; per model,
        # candidate name -> compiled forward
        self.backends: dict = {}
        self.specs: dict = {}  # candidate name -> its CandidateSpec (the untiled graph: mode "baseline")
        self.candidates: list[dict] = []
        self.selection = None
        self.step = 0
        self.decision = None
        self._summary_start: dict[str, int] = {}

    def setup(self, trainer: "Trainer") -> None:
        from megatron_ext.helix.compiler import backend_from_config

        chunks = getattr(trainer.model, "chunks", None)
        if chunks is None:
            raise ConfigError("--helix needs the megatron engine (--engine megatron)")
        # Calibration agrees over the world group: here, where every rank is (see prepare()).
        mbs = trainer.cfg.training.micro_batch_size
        self.backend = backend_from_config(self.cfg, batch_size=mbs).prepare()
        if self.cfg.select_rounds:
            self.specs = self.candidate_specs()
            # Every candidate is priced with the same cost model, device and one measurement of the
            # links and of the host's share: the ranking compares schedules, not draws of a noisy host.
            self.backends = {}
            for name, spec in self.specs.items():
                if name == self.schedule_name:
                    self.backends[name] = self.backend
                    continue
                b = backend_from_config(self.cfg, batch_size=mbs, mode=spec.mode, tiles=spec.tiles,
                                        bucketing=spec.bucketing, device=self.backend.device_spec).prepare()
                b.adopt_links(self.backend)
                self.backends[name] = b
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
        if self.backends:
            _allow_recompiles(len(self.backends) * len(trainer.model.chunks))
            self._summary_start = {name: len(b.summaries) for name, b in self.backends.items()}
        for chunk in trainer.model.chunks:
            model = unwrap(chunk)
            report = make_traceable(model)
            if seq_length is not None:  # else the first micro-batch's graph creates it: two graphs
                prefill_first_call_state(model, trainer.cfg.training.micro_batch_size, seq_length)
            if self.backends:
                compiled = {name: torch.compile(model.forward, backend=b, dynamic=False)
                            for name, b in self.backends.items()}
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

        if self.backends:
            from megatron_ext.helix.selection import MeasuredSelection

            self.selection = MeasuredSelection(list(self.backends), self.cfg.select_rounds,
                                               measure=self.cfg.helix_select_measure, ranked=True)
            self.step, self.decision = 0, None

    def candidate_specs(self) -> dict:
        """The measured selection's candidates, name -> ``CandidateSpec``: the untiled graph (no pass)
        first, the --helix-mode schedule, then --helix-select-candidates less any that builds the same
        backend as one before it."""
        from megatron_ext.helix.selection import CandidateSpec, parse_candidate

        specs = {UNTILED: CandidateSpec(UNTILED, "baseline"),
                 self.schedule_name: CandidateSpec(self.schedule_name, self.cfg.helix_mode, self.cfg.helix_tiles,
                                                   self.cfg.helix_bucketing)}
        for spec in (parse_candidate(c) for c in self.cfg.helix_select_candidates or []):
            if all(spec.key != s.key for s in specs.values()):
                specs[spec.name] = spec
        return specs

    @property
    def schedule_name(self) -> str:
        return f"helix-{self.cfg.helix_mode}-k{self.cfg.helix_tiles}" + (
            "" if self.cfg.helix_bucketing else "-unbucketed")

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
        if self.step == self.selection.warmups and not self.selection.narrowed:
            self.rank_candidates(trainer)
            if self.selection.done_after == self.step:  # nothing worth timing
                self.decision = self.selection.decide()
                self._keep(trainer, self.decision.chosen)
                return
        if self.step < self.selection.done_after:
            return
        self.decide(trainer)

    # --- the simulator's ranking, agreed over the ranks ---------------------------------------------
    def _graphs_of(self, name: str) -> list:
        b = self.backends[name]
        return b.summaries[self._summary_start.get(name, 0):]

    def rank_candidates(self, trainer: "Trainer") -> None:
        """Every candidate has compiled: rank them by the simulator's step makespan (the slowest rank's
        prediction), leave out those whose graphs are the untiled graph's or another candidate's, and
        time the best ``--helix-select-measure``. Every rank computes the same from agreed numbers."""
        from megatron_ext.helix.selection import rank

        names = list(self.backends)
        predicted = [sum(s.prediction.makespan_s for s in self._graphs_of(n) if s.prediction is not None)
                     for n in names]
        tiled = [float(any(s.tiled for s in self._graphs_of(n))) for n in names]
        # candidates that tile alike (the same tiles and bucketing, the simulator deciding or not)
        # compiled the same graphs where they tiled the same graphs
        alike = {n: (s.tiles, s.bucketing) if s.mode in ("auto", "tiled") else None for n, s in self.specs.items()}
        pairs = [(i, j) for i in range(1, len(names)) for j in range(i + 1, len(names))
                 if alike[names[i]] is not None and alike[names[i]] == alike[names[j]]]
        differ = [float([s.tiled for s in self._graphs_of(names[i])] != [s.tiled for s in self._graphs_of(names[j])])
                  for i, j in pairs]
        agreed = _agree(trainer, predicted + tiled + differ)
        predicted, tiled, differ = (agreed[:len(names)], agreed[len(names):2 * len(names)],
                                    agreed[2 * len(names):])
        same_as: dict[str, list[str]] = {}
        for (i, j), d in zip(pairs, differ):
            if not d:
                same_as.setdefault(names[i], []).append(names[j])
                same_as.setdefault(names[j], []).append(names[i])
        ranked, dropped = rank(names, predicted, [bool(t) for t in tiled], same_as=same_as,
                               always=[n for n in names if self.specs[n].mode == "inductor"])
        timed = self.selection.narrow(ranked, predicted_s=dict(zip(names, predicted)), dropped=dropped)
        for n in ranked:
            if n not in timed:
                self.selection.dropped[n] = "ranked below the timed ones"
        if trainer.ctx.rank == 0:
            logger.info("helix: the simulator's step makespan per candidate: %s; timing %s",
                        ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in zip(names, predicted)), ", ".join(timed))

    def decide(self, trainer: "Trainer") -> None:
        """Every rank's samples, the slowest of each iteration (all-reduce MAX), decide: every rank
        keeps the same graph (its collectives must match its peers')."""
        self.decision = self.selection.decide(_agree(trainer, self.selection.vector()))
        self._keep(trainer, self.decision.chosen)

    def _keep(self, trainer: "Trainer", name: str) -> None:
        for model, compiled in zip(self.models, self.candidates):
            model.forward = compiled[name]
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


def _agree(trainer: "Trainer", values: list[float]) -> list[float]:
    """``values`` all-reduced (MAX) over the world: every rank decides on the same numbers."""
    import torch
    import torch.distributed as dist

    if not values or not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    from megatron_ext.runtime.distributed import collective_device

    t = torch.tensor(values, dtype=torch.float64, device=collective_device(trainer.ctx))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _allow_recompiles(graphs: int) -> None:
    """Each candidate compiles the same forward code with another backend: Dynamo keeps one cache
    entry per (code, backend, model) and falls back to eager past its limit. Raise the limit to fit
    every candidate of every chunk (with room for graph breaks)."""
    import torch._dynamo.config as dc

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, key):
            setattr(dc, key, max(getattr(dc, key), 4 * graphs + 8))
            break


@register_extension("helix")
def _factory(cfg) -> HelixExtension | None:
    h = cfg.ext("helix")
    if h is None or not h.helix:
        return None
    from megatron_ext.engines import engine

    engine(cfg.parallel.engine).refuse("helix")
    return HelixExtension(h)

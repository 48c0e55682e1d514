"""The one description of a layout change: ``LayoutTarget``, and the one set of rules it must pass.

Every change of a live job's layout -- a fail-slow re-layout the planner chose, the survivors of a
lost rank, a replaced rank rejoining, a rank permutation asked for by hand -- is a ``LayoutTarget``:
TP and PP sizes, virtual stages, layers per pipeline stage, micro-batches per data-parallel
replica, and the members (launch ranks, in their new rank order: TP fastest, then DP, then PP).
``check`` is the one set of rules, run on every rank before anything changes, so a bad target is
refused identically everywhere and never half-applied. ``ft/transaction.py`` applies it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from megatron_ext.config.base import ConfigError


@dataclasses.dataclass(frozen=True)
class LayoutTarget:
    """Where a live job goes. ``stage_layers`` None: even stages; ``replica_microbatches`` None:
    an even split of the global batch over the replicas."""

    tp: int
    pp: int
    members: tuple[int, ...]
    vp: int = 1
    stage_layers: tuple[int, ...] | None = None
    replica_microbatches: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(int(m) for m in self.members))
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(int(n) for n in self.stage_layers))
        if self.replica_microbatches is not None:
            object.__setattr__(self, "replica_microbatches", tuple(int(n) for n in self.replica_microbatches))

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def dp(self) -> int:
        return len(self.members) // (self.tp * self.pp)

    @property
    def name(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}" + (f"vp{self.vp}" if self.vp > 1 else "")

    def normalised(self) -> "LayoutTarget":
        """Even stages and an even split written as None (what the config and the logs expect)."""
        stages, mbs = self.stage_layers, self.replica_microbatches
        return dataclasses.replace(self, stage_layers=None if stages is not None and len(set(stages)) == 1 else stages,
                                   replica_microbatches=None if mbs is not None and len(set(mbs)) == 1 else mbs)

    def describe(self) -> str:
        """One line: ``tp1pp2dp1 (layers 3/1) (micro-batches 5/3) on ranks 0,2``."""
        return (self.name + (f" (layers {'/'.join(map(str, self.stage_layers))})" if self.stage_layers else "")
                + (f" (micro-batches {'/'.join(map(str, self.replica_microbatches))})"
                   if self.replica_microbatches else "")
                + f" on rank(s) {','.join(map(str, self.members))}")

    def parallel(self, par: Any) -> Any:
        """``par`` (a ``ParallelConfig``) with this target's sizes."""
        return dataclasses.replace(par, tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                                   virtual_pipeline_model_parallel_size=self.vp if self.vp > 1 else None,
                                   pipeline_stage_layers=list(self.stage_layers) if self.stage_layers else None,
                                   data_parallel_microbatches=(list(self.replica_microbatches)
                                                               if self.replica_microbatches else None))

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "vp": self.vp, "members": list(self.members),
                "stage_layers": list(self.stage_layers) if self.stage_layers else None,
                "replica_microbatches": list(self.replica_microbatches) if self.replica_microbatches else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayoutTarget":
        return cls(tp=int(d["tp"]), pp=int(d["pp"]), members=tuple(d["members"]), vp=int(d.get("vp") or 1),
                   stage_layers=tuple(d["stage_layers"]) if d.get("stage_layers") else None,
                   replica_microbatches=tuple(d["replica_microbatches"]) if d.get("replica_microbatches") else None)

    @classmethod
    def current(cls, par: Any, members: Iterable[int]) -> "LayoutTarget":
        """The layout in force: ``par`` (the run's ``ParallelConfig``) over ``members``."""
        stages, mbs = par.pipeline_stage_layers, par.data_parallel_microbatches
        return cls(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size, members=tuple(members),
                   vp=par.virtual_pipeline_model_parallel_size or 1,
                   stage_layers=tuple(stages) if stages else None, replica_microbatches=tuple(mbs) if mbs else None)


KNOBS = frozenset({"shape", "layers", "microbatches", "permute"})
"""What an engine can change live: TP/PP sizes, layers per stage, micro-batches per replica, the
rank order (``Trainer.relayout_knobs``)."""


def check(target: LayoutTarget, *, cfg: Any, members: Iterable[int], knobs: frozenset[str],
          membership_may_change: bool, what: str = "relayout") -> None:
    """Raise ``ConfigError`` (a ``UserError``) for a target that cannot be applied, before
    anything changes. ``cfg``: the run's ``RunConfig`` (its ``validate`` is the rest of the
    rules); ``members``: the launch ranks of the layout in force, in rank order; ``knobs``: what
    the engine changes live; ``membership_may_change``: a loss or a rejoin is being applied (a
    planned re-layout keeps every rank)."""
    old = tuple(members)
    new = target.members
    if len(set(new)) != len(new):
        raise ConfigError(f"{what} to {target.name}: members {list(new)} name a rank twice")
    if target.tp < 1 or target.pp < 1 or len(new) % (target.tp * target.pp):
        raise ConfigError(f"{what}: {len(new)} rank(s) cannot form TP {target.tp} x PP {target.pp}")
    if not membership_may_change and sorted(new) != sorted(old):
        raise ConfigError(f"{what} rank_order {list(new)}: expected each rank 0..{len(old) - 1} once (every rank of "
                          "the job keeps a place; only a fail-stop or a rejoin changes who is in the job)")
    if not membership_may_change and new != old and "permute" not in knobs:
        raise ConfigError(f"{what} to {target.name}: the engine cannot permute ranks live (--engine megatron can)")
    if target.replica_microbatches is not None and len(set(target.replica_microbatches)) > 1 \
            and "microbatches" not in knobs:
        raise ConfigError(f"{what} to {target.name}: uneven micro-batches per replica "
                          f"{list(target.replica_microbatches)} are not built for this engine (--engine megatron is)")
    if target.vp > 1 and target.stage_layers is not None and len(set(target.stage_layers)) > 1:
        raise ConfigError(f"{what} to {target.name}: uneven stages {list(target.stage_layers)} with virtual "
                          "stages would need uneven interleaved chunks")
    new_cfg = dataclasses.replace(cfg, parallel=target.parallel(cfg.parallel))
    new_cfg.validate(len(new))

"""The one description of a layout change, and the one set of rules it must pass.

Every change of a live job's layout -- a fail-slow re-layout the planner chose, the survivors of a
lost rank, a replaced rank rejoining, a rank permutation asked for by hand -- is a ``LayoutTarget``,
which is the project's one layout value (``megatron_ext.layout.Layout``): TP and PP sizes, virtual
stages, layers per pipeline stage, micro-batches per data-parallel replica, and the members (launch
ranks, in their new rank order: TP fastest, then DP, then PP).
``check`` is the one set of rules, run on every rank before anything changes, so a bad target is
refused identically everywhere and never half-applied. ``ft/transaction.py`` applies it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from megatron_ext.config.base import ConfigError
from megatron_ext.layout import Layout


LayoutTarget = Layout
"""A layout change's target is a layout: the one value type (``megatron_ext/layout.py``)."""


def parallel_of(target: Layout, par: Any) -> Any:
    """``par`` (the launch request, a ``ParallelConfig``) as it would read with ``target``'s sizes,
    stages and split: what ``check`` validates. The run's own ``cfg.parallel`` is never rewritten;
    after launch the job reads ``ctx.layout``."""
    return dataclasses.replace(par, tensor_model_parallel_size=target.tp, pipeline_model_parallel_size=target.pp,
                               virtual_pipeline_model_parallel_size=target.vp if target.vp > 1 else None,
                               pipeline_stage_layers=list(target.stage_layers) if target.stage_layers else None,
                               data_parallel_microbatches=(list(target.replica_microbatches)
                                                           if target.replica_microbatches else None))


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
    new_cfg = dataclasses.replace(cfg, parallel=parallel_of(target, cfg.parallel))
    new_cfg.validate(len(new))

"""Acting on verdicts in the live job (``--resihp-act plan|relayout``).

The rank that runs the detector feeds its verdicts to the planner's policy (``planner_policy``:
believed speeds with hysteresis). Every iteration that rank broadcasts its decision, a plan or
nothing, so every rank agrees; with ``relayout`` the plan becomes a re-layout request that the
training loop carries out after the iteration (``Trainer.relayout``): layers per stage, micro-batches
per replica (DP work migration) and a rank permutation (slow devices into one TP group, or to the
stage the planner chose) and, with ``--resihp-act-reshape``, other TP x PP x DP sizes over the same
ranks, as far as the engine's ``relayout_knobs`` go. Fewer ranks are not asked of the planner
under ``relayout`` (every rank keeps a place); under ``plan`` every knob is searched and the plan
only logged. A plan becomes a target by the one rule (``choose.target_from_plan``) and is checked by the core's
one set of rules (``ft.target.check``). After a fail-stop (``--ft-on-stop continue``) the
survivors regroup anyway, and ``choose.choose_layout`` uses every knob.

Devices are named by their launch rank (``DistContext.members``), which stays with the process
when a permutation or a fail-stop renumbers the ranks: the policy's beliefs, the plans and the
plan lines keep meaning the same device. Verdicts name ranks of the current world and carry the
device in ``detail["launch_rank"]``, which the policy is fed.
"""
from __future__ import annotations

import logging
import math
import statistics
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.resihp.choose import extension_of, make_planner, not_applicable, plan_layout, target_from_plan
from megatron_ext.resihp.planner_types import Plan

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.resihp.config import ResiHPConfig
    from megatron_ext.resihp.planner_policy import PlanPolicy
    from megatron_ext.resihp.verdicts import Verdict
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

class Actor:
    """One per rank; the one on the detector's rank (``decider``) ``decides``.

    What the decider believes (speeds, recovery clocks, the healthy iteration time) goes to every
    rank with each plan it applies: a rank permutation can make another process the detector's
    rank, and that process's actor then plans on from the same beliefs (hysteresis included)
    instead of starting from an all-healthy job. ``rank`` follows this process through a
    permutation, so the extension keeps the same actor object."""

    def __init__(self, cfg: "ResiHPConfig", *, rank: int, decider: int) -> None:
        self.cfg = cfg
        self.decider = decider
        self.rank = rank
        self.policy: PlanPolicy | None = None
        self.healthy_times: list[float] = []
        self.carried: dict | None = None   # the decider's beliefs, as of the last plan applied

    @property
    def decides(self) -> bool:
        return self.rank == self.decider

    def _policy(self, trainer: "Trainer") -> "PlanPolicy":
        from megatron_ext.resihp.planner_policy import PlanPolicy

        carried = self.carried or {}
        if carried.get("healthy_s") is not None and not self.healthy_times:
            self.healthy_times = [float(carried["healthy_s"])]
        planner = make_planner(trainer, executable_only=self.cfg.resihp_act == "relayout",
                               min_gain=self.cfg.resihp_act_min_gain,
                               min_gain_healthy=self.cfg.resihp_act_min_gain_healthy, horizon=self.cfg.resihp_act_horizon,
                               healthy_times=self.healthy_times, live_reshape=self.cfg.resihp_act_reshape,
                               device_flops=carried.get("device_flops"))
        layout = plan_layout(trainer)
        if not carried:
            # The device speed was just scaled to this layout's healthy iterations: its shape is
            # measured at x1 by construction (a factor the shapes the job runs later are set against).
            planner.shape_factors[(layout.tp, layout.pp)] = 1.0
        known = [*carried.get("speeds", {}), *carried.get("recovering", {}), *carried.get("nics", {}),
                 *carried.get("nics_recovering", {})]
        policy = PlanPolicy(planner, layout, max([*trainer.ctx.members, *map(int, known)]) + 1)
        policy.restore(carried)
        return policy

    def _beliefs(self) -> dict:
        """What the next decider needs: the policy's beliefs by device and the healthy iteration
        time the planner's speeds are scaled to."""
        return {**self.policy.beliefs(), "device_flops": self.policy.planner.cluster.device_flops,
                "healthy_s": statistics.median(self.healthy_times) if self.healthy_times else None}

    def observe(self, trainer: "Trainer", iteration: int, verdicts: list["Verdict"], iter_time_s: float) -> Plan | None:
        """Collective: every rank calls it after each iteration; returns the agreed plan, if any."""
        import dataclasses

        import torch.distributed as dist

        self.rank = trainer.ctx.rank
        members = tuple(trainer.ctx.members)
        decision: str | None = None
        beliefs: dict | None = None
        if self.decides:
            if not verdicts and self.policy is None and self.carried is None:
                self.healthy_times = (self.healthy_times + [iter_time_s])[-50:]
            if (verdicts or self.carried is not None) and self.policy is None:
                self.policy = self._policy(trainer)
            if self.policy is not None:
                # The layout in force is the trainer's (a plan applied, or survivors regrouped);
                # devices that left the job are not spares.
                self.policy.layout = plan_layout(trainer)
                gone = np.setdiff1d(np.arange(self.policy.speeds.shape[0]), np.asarray(members))
                self.policy.speeds[gone] = 0.0
                named = [dataclasses.replace(v, rank=v.on_devices(members).launch_rank) for v in verdicts
                         if "launch_rank" in v.detail or v.rank < len(members)]
                plan = self.policy.observe(iteration, named, adopt=False)
                if plan is not None:
                    decision, beliefs = plan.to_json(), self._beliefs()
                elif self.cfg.resihp_act == "relayout" and math.isfinite(iter_time_s) and iter_time_s > 0:
                    # This iteration's time teaches the planner the shape in force (once it has run
                    # ``measure_after`` healthy iterations; the first after a change is dropped).
                    # Not under ``plan``: its layout is always the start, the one the scale came from.
                    self.policy.record_time(iter_time_s)
        ext = extension_of(trainer)
        box = [decision, beliefs, list(ext.verdicts) if decision is not None and ext is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=self.decider)
        if box[0] is None:
            return None
        plan = Plan.from_json(box[0])
        target = target_from_plan(plan.new)
        why = not_applicable(trainer, target)
        if self.decides:
            print(f" {plan.describe()}", flush=True)
            if self.cfg.resihp_act == "relayout" and why:
                print(f" resihp: plan not applied: {why}", flush=True)
        if self.cfg.resihp_act == "relayout" and why is None:
            self.carried = box[1]
            # The detector's rank may now be another process (a permutation, another shape): it
            # plans on from ``carried``, and its run-end outcome lines see the verdicts so far.
            if ext is not None and box[2] is not None:
                ext.verdicts = box[2]
            if target.members != members:
                # This process's rank after the permutation: the decider's role stays with the
                # detector's rank.
                self.rank = list(target.members).index(members[self.rank])
                if not self.decides:
                    self.policy = None
            trainer.request_layout(target, reason=plan.describe())
        return plan

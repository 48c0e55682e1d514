"""Acting on verdicts in the live job (``--resihp-act plan|relayout``).

The rank that runs the detector feeds its verdicts to the planner's policy (``planner_policy``:
believed speeds with hysteresis). Every iteration that rank broadcasts its decision, a plan or
nothing, so every rank agrees; with ``relayout`` the plan becomes a re-layout request that the
training loop carries out after the iteration (``Trainer.relayout``): layers per stage, micro-batches
per replica (DP work migration) and a rank permutation (slow devices into one TP group, or to the
stage the planner chose), as far as the engine's ``relayout_knobs`` go. What the executor cannot do
in a live job (fewer ranks, another TP/PP/DP shape from the planner's reshape search) is not asked
of the planner under ``relayout``; under ``plan`` every knob is searched and the plan only logged.
After a fail-stop (``--resihp-on-stop continue``) the survivors regroup anyway, and
``failstop.decide`` uses every knob.

Devices are named by their launch rank (``DistContext.members``), which stays with the process
when a permutation or a fail-stop renumbers the ranks: the policy's beliefs, the plans and the
plan lines keep meaning the same device. Verdicts name ranks of the current world and carry the
device in ``detail["launch_rank"]``, which the policy is fed.
"""
from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.resihp.planner_types import Cluster, Plan, PlanLayout, PlannerConfig, Workload

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.resihp.config import ResiHPConfig
    from megatron_ext.resihp.planner import Planner
    from megatron_ext.resihp.planner_policy import PlanPolicy
    from megatron_ext.resihp.verdicts import Verdict
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

# In-memory state moves between CPU ranks on one host: about a memory copy plus pickling.
CPU_LINK_BYTES_PER_S = 1e9
CPU_RELAYOUT_PAUSE_S = 2.0   # groups, model chunks and optimizer rebuilt (measured 1-3 s on 2 cores)


def plan_layout(trainer: "Trainer") -> PlanLayout:
    """The layout in force, in the planner's terms. Devices are the launch ranks of the ranks in
    megatron's order (``ctx.members``: ``0..world-1`` until a permutation or a fail-stop renumbers
    them)."""
    ctx, cfg = trainer.ctx, trainer.cfg
    lay, vp = ctx.layout, ctx.vpp or 1
    stages = cfg.parallel.pipeline_stage_layers
    if stages is None:
        per_chunk = cfg.model.num_layers // (lay.pp * vp)
        layers = tuple(tuple([per_chunk] * vp) for _ in range(lay.pp))
    else:
        layers = tuple((int(n),) for n in stages)
    split = cfg.parallel.data_parallel_microbatches
    m = trainer.train_stream.num_microbatches
    return PlanLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp, vp=vp, schedule="interleaved" if vp > 1 else "1f1b",
                      layers=layers, microbatches=tuple(split) if split else (m,) * lay.dp,
                      devices=tuple(ctx.members))


def not_applicable(plan: Plan, world_size: int, *, after_loss: bool = False, permute: bool = True) -> str | None:
    """Why the executor cannot apply ``plan``, or None when it can. ``after_loss``: the survivors
    of a fail-stop form a new process group, so a smaller world is possible; ``permute``: the
    engine re-lays out with the ranks in another order (``Trainer.relayout(rank_order=)``)."""
    new, old = plan.new, plan.old
    if not after_loss and sorted(new.devices) != sorted(old.devices):
        return f"it runs on {new.world_size} of {world_size} ranks (only after a fail-stop, with --resihp-on-stop continue)"
    if not after_loss and not permute and tuple(new.devices) != tuple(old.devices):
        return "it permutes ranks between groups, which this engine cannot do live (--engine megatron can)"
    if new.vp > 1 and len({n for row in new.layers for n in row}) > 1:
        return "it needs uneven interleaved chunks"
    return None


def rank_order(plan: Plan, members: tuple[int, ...]) -> list[int] | None:
    """``Trainer.relayout``'s ``rank_order`` for ``plan`` (current ranks in their new order), None
    when nobody moves."""
    order = [list(members).index(d) for d in plan.new.devices]
    return None if order == list(range(len(order))) else order


def make_planner(trainer: "Trainer", *, executable_only: bool, min_gain: float = 0.05, horizon: int = 500,
                 healthy_times: list[float] | None = None) -> "Planner":
    """A planner for the running job. ``executable_only``: search only what ``Trainer.relayout``
    applies in a live job (layers per stage, micro-batches per replica). The device speed is scaled so that the model predicts the healthy
    iterations measured so far: plans compare layouts relative to each other, but the pause is
    amortized in seconds."""
    from megatron_ext.resihp.live import model_spec
    from megatron_ext.resihp.planner import Planner

    spec = model_spec(trainer)
    t = trainer.cfg.training
    workload = Workload(seq_length=trainer.cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
                        state_bytes_per_param=12.0 if not t.bf16 else 16.0)
    config = PlannerConfig(min_gain=min_gain, horizon_iterations=horizon,
                           tp_regroup=not executable_only or "permute" in trainer.relayout_knobs,
                           dp_migration="microbatches" in trainer.relayout_knobs,
                           uneven_microbatches="microbatches" in trainer.relayout_knobs,
                           drop_replicas=not executable_only,
                           reshape=not executable_only)
    probe = Cluster(device_flops=1e12, memory_bytes=float("inf"), link_bytes_per_s=CPU_LINK_BYTES_PER_S)
    predicted = Planner(spec, probe, workload, config).iteration_s(plan_layout(trainer),
                                                                   np.ones(max(trainer.ctx.members) + 1))
    measured = statistics.median(healthy_times) if healthy_times else predicted
    cluster = Cluster(device_flops=1e12 * predicted / max(measured, 1e-9), memory_bytes=float("inf"),
                      link_bytes_per_s=CPU_LINK_BYTES_PER_S, relayout_pause_s=CPU_RELAYOUT_PAUSE_S)
    return Planner(spec, cluster, workload, config)


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
                               min_gain=self.cfg.resihp_act_min_gain, horizon=self.cfg.resihp_act_horizon,
                               healthy_times=self.healthy_times)
        known = [*carried.get("speeds", {}), *carried.get("recovering", {})]
        policy = PlanPolicy(planner, plan_layout(trainer), max([*trainer.ctx.members, *map(int, known)]) + 1)
        policy.restore(carried)
        return policy

    def _beliefs(self) -> dict:
        """What the next decider needs: the policy's beliefs by device and the healthy iteration
        time the planner's speeds are scaled to."""
        return {**self.policy.beliefs(),
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
        ext = _extension(trainer)
        box = [decision, beliefs, list(ext.verdicts) if decision is not None and ext is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=self.decider)
        if box[0] is None:
            return None
        plan = Plan.from_json(box[0])
        why = not_applicable(plan, trainer.ctx.world_size, permute="permute" in trainer.relayout_knobs)
        if self.decides:
            print(f" resihp: {plan.describe()}", flush=True)
            if self.cfg.resihp_act == "relayout" and why:
                print(f" resihp: plan not applied: {why}", flush=True)
        if self.cfg.resihp_act == "relayout" and why is None:
            new = plan.new
            self.carried = box[1]
            order = rank_order(plan, members)
            if order is not None:
                # This process's rank after the permutation: the decider's role stays with the
                # detector's rank, which may now be another process (it plans on from ``carried``,
                # and its run-end outcome lines see the verdicts so far).
                self.rank = order.index(self.rank)
                if not self.decides:
                    self.policy = None
                if ext is not None and box[2] is not None:
                    ext.verdicts = box[2]
            stages, mbs = list(new.stage_layers), list(new.microbatches)
            even = len(set(stages)) == 1 and new.vp == 1
            trainer.request_relayout(tp=new.tp, pp=new.pp, vpp=new.vp if new.vp > 1 else None,
                                     stage_layers=None if even else stages,
                                     replica_microbatches=None if len(set(mbs)) == 1 else mbs,
                                     rank_order=order, reason=plan.describe())
        return plan


def _extension(trainer: "Trainer"):
    return next((e for e in trainer.extensions if getattr(e, "name", None) == "resihp"), None)

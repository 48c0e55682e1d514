"""Acting on verdicts in the live job (``--resihp-act plan|relayout``).

The rank that runs the detector feeds its verdicts to the planner's policy (``planner_policy``:
believed speeds with hysteresis). Every iteration that rank broadcasts its decision, a plan or
nothing, so every rank agrees; with ``relayout`` the plan becomes a re-layout request that the
training loop carries out after the iteration (``Trainer.relayout``). What the executor cannot do
in a live job (a rank permutation, fewer ranks, another TP/PP/DP shape found by the planner's
reshape search) is not asked of the planner under ``relayout``, which then repartitions layers over
the stages and moves micro-batches between replicas (DP work migration); under ``plan`` every knob
is searched and the plan only logged. After a fail-stop (``--resihp-on-stop continue``) the
survivors regroup anyway, and ``failstop.decide`` uses every knob.
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
    """The layout in force, in the planner's terms. Devices are the ranks in megatron's order (the
    executor keeps that order), every replica runs the same micro-batches."""
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
                      devices=tuple(range(ctx.world_size)))


def not_applicable(plan: Plan, world_size: int, *, after_loss: bool = False) -> str | None:
    """Why the executor cannot apply ``plan``, or None when it can. ``after_loss``: the survivors
    of a fail-stop form a new process group, so a smaller world and a rank permutation are free."""
    new = plan.new
    if not after_loss and new.world_size != world_size:
        return f"it runs on {new.world_size} of {world_size} ranks (only after a fail-stop, with --resihp-on-stop continue)"
    if not after_loss and tuple(new.devices) != tuple(range(world_size)):
        return "it permutes ranks between groups (not built for a live job yet)"
    if new.vp > 1 and len({n for row in new.layers for n in row}) > 1:
        return "it needs uneven interleaved chunks"
    return None


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
    config = PlannerConfig(min_gain=min_gain, horizon_iterations=horizon, tp_regroup=not executable_only,
                           dp_migration="microbatches" in trainer.relayout_knobs,
                           uneven_microbatches="microbatches" in trainer.relayout_knobs,
                           drop_replicas=not executable_only,
                           reshape=not executable_only)
    probe = Cluster(device_flops=1e12, memory_bytes=float("inf"), link_bytes_per_s=CPU_LINK_BYTES_PER_S)
    predicted = Planner(spec, probe, workload, config).iteration_s(plan_layout(trainer),
                                                                   np.ones(trainer.ctx.world_size))
    measured = statistics.median(healthy_times) if healthy_times else predicted
    cluster = Cluster(device_flops=1e12 * predicted / max(measured, 1e-9), memory_bytes=float("inf"),
                      link_bytes_per_s=CPU_LINK_BYTES_PER_S, relayout_pause_s=CPU_RELAYOUT_PAUSE_S)
    return Planner(spec, cluster, workload, config)


class Actor:
    """One per rank; ``decides`` on the detector's rank."""

    def __init__(self, cfg: "ResiHPConfig", *, rank: int, decider: int) -> None:
        self.cfg = cfg
        self.decider = decider
        self.decides = rank == decider
        self.policy: PlanPolicy | None = None
        self.healthy_times: list[float] = []

    def _policy(self, trainer: "Trainer") -> "PlanPolicy":
        from megatron_ext.resihp.planner_policy import PlanPolicy

        planner = make_planner(trainer, executable_only=self.cfg.resihp_act == "relayout",
                               min_gain=self.cfg.resihp_act_min_gain, horizon=self.cfg.resihp_act_horizon,
                               healthy_times=self.healthy_times)
        return PlanPolicy(planner, plan_layout(trainer), trainer.ctx.world_size)

    def observe(self, trainer: "Trainer", iteration: int, verdicts: list["Verdict"], iter_time_s: float) -> Plan | None:
        """Collective: every rank calls it after each iteration; returns the agreed plan, if any."""
        import torch.distributed as dist

        decision: str | None = None
        if self.decides:
            if not verdicts and self.policy is None:
                self.healthy_times = (self.healthy_times + [iter_time_s])[-50:]
            if verdicts and self.policy is None:
                self.policy = self._policy(trainer)
            if self.policy is not None:
                # The layout in force changes only when a plan is applied (below).
                plan = self.policy.observe(iteration, verdicts, adopt=False)
                decision = plan.to_json() if plan is not None else None
        box = [decision]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=self.decider)
        if box[0] is None:
            return None
        plan = Plan.from_json(box[0])
        why = not_applicable(plan, trainer.ctx.world_size)
        if self.decides:
            print(f" resihp: {plan.describe()}", flush=True)
            if self.cfg.resihp_act == "relayout" and why:
                print(f" resihp: plan not applied: {why}", flush=True)
        if self.cfg.resihp_act == "relayout" and why is None:
            new = plan.new
            if self.policy is not None:
                self.policy.layout = new
            stages, mbs = list(new.stage_layers), list(new.microbatches)
            even = len(set(stages)) == 1 and new.vp == 1
            trainer.request_relayout(tp=new.tp, pp=new.pp, vpp=new.vp if new.vp > 1 else None,
                                     stage_layers=None if even else stages,
                                     replica_microbatches=None if len(set(mbs)) == 1 else mbs,
                                     reason=plan.describe())
        return plan


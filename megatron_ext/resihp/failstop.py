"""``--resihp-on-stop continue``: the ResiHP side of going on without a lost rank.

The runtime (``runtime/failover.py``, ``Trainer._continue_after_loss``) commits iterations,
unblocks and regroups the survivors and moves the state. ResiHP supplies what it knows: which
ranks are gone (the heartbeat; the launcher's exit reports come through the store directly), and
which layout the survivors should take (``decide``: the planner with every knob it has — DP
shrink, PP re-partition over the survivors, a new TP x PP shape, uneven micro-batches; a rank
permutation costs nothing here, since the ranks are renumbered anyway; on ``--engine deepspeed``
the layouts its ``PipelineModule`` builds: PP x DP with even micro-batches). ``check`` refuses the
configurations in which continuing cannot work, before any rank starts.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_ext.config.base import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.config.run import RunConfig
    from megatron_ext.resihp.live import ResiHPExtension
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

STORE_NEEDED = (
    "--resihp-on-stop continue needs a rendezvous store that outlives every rank: start the job with "
    "`python pretrain_gpt.py --nproc-per-node N ...` (its launcher hosts the store), or host one with "
    "`python -m megatron_ext.runtime.store` and export its MEGATRON_EXT_STORE=host:port line to every "
    "rank (e.g. under srun); torchrun's agent stops every rank when one dies, and its store lives in rank 0")


def check(cfg: "RunConfig", world_size: int, *, launcher: bool) -> None:
    """Refuse ``continue`` where it cannot work. ``launcher``: the ranks are about to be started
    by ``pretrain_gpt.py --nproc-per-node``, which hosts the store."""
    resihp = cfg.ext("resihp")
    if resihp is None or resihp.resihp_on_stop != "continue":
        return
    if not resihp.resihp:
        raise ConfigError("--resihp-on-stop continue needs --resihp (its heartbeat names the lost rank)")
    if cfg.parallel.use_distributed_optimizer:
        raise ConfigError("--resihp-on-stop continue cannot be used with --use-distributed-optimizer: its optimizer "
                          "state is sharded over the data-parallel ranks, so a lost rank's part has no copy in "
                          "memory; drop the flag, or use --resihp-on-stop abort and resume with --load")
    par = cfg.parallel
    on_gpu = par.device == "cuda" or (par.device == "auto" and _cuda_available())
    if par.distributed_backend == "nccl" or (on_gpu and par.distributed_backend == "auto"):
        raise ConfigError("--resihp-on-stop continue is built for gloo ranks: a survivor's NCCL collective with a "
                          "lost rank is not unblocked yet (that needs the process group's abort); use "
                          "--distributed-backend gloo, or --resihp-on-stop abort and resume with --load")
    if world_size > 1 and not launcher and not os.environ.get("MEGATRON_EXT_STORE"):
        raise ConfigError(STORE_NEEDED)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def decide(trainer: "Trainer", survivors: list[int], lost: list[int]) -> dict[str, Any]:
    """The survivors' layout, planned on the leader (``failover.Decide``). Speeds: 1 for every
    survivor (or the slowdown the policy believes, on the rank that holds the policy), 0 lost."""
    from megatron_ext.resihp.act import make_planner, not_applicable, plan_layout
    from megatron_ext.resihp.planner_types import PlanningError

    ctx = trainer.ctx
    members = list(ctx.members)
    try:
        layout = plan_layout(trainer)  # devices are launch ranks, as ``members``, ``lost`` and the policy's
        speeds = np.zeros(max(members) + 1)  # earlier losses are no spares
        speeds[members] = 1.0
        actor = getattr(_extension(trainer), "actor", None)
        if actor is not None and actor.policy is not None:
            known = [m for m in members if m < actor.policy.speeds.shape[0]]
            speeds[known] = np.minimum(speeds[known], actor.policy.speeds[known])
        speeds[list(lost)] = 0.0
        # The analytical model alone (1 TFLOP/s per rank), not scaled by measured iteration times:
        # the survivors' layout is a function of the layout and of who is lost, not of timing noise.
        planner = make_planner(trainer, executable_only=False, min_gain=0.0)
        plan = planner.plan(layout, speeds)
    except PlanningError as exc:
        return {"restart": str(exc)}
    if plan is None:
        return {"restart": "the planner found no layout for the survivors"}
    why = not_applicable(plan, ctx.world_size, after_loss=True, permute=True)  # renumbered anyway
    if why:
        return {"restart": f"the survivors' layout {why} ({plan.describe()})"}
    new = plan.new
    stages, mbs = list(new.stage_layers), list(new.microbatches)
    if len(set(mbs)) > 1 and "microbatches" not in trainer.relayout_knobs:
        return {"restart": f"the survivors' layout needs uneven micro-batches per replica ({plan.describe()}), "
                           "which this engine cannot run"}
    even_stages = len(set(stages)) == 1 and trainer.cfg.model.num_layers % new.pp == 0
    return {"members": list(new.devices), "tp": new.tp, "pp": new.pp,
            "vpp": new.vp if new.vp > 1 else None, "stage_layers": None if even_stages else stages,
            "replica_microbatches": None if len(set(mbs)) == 1 else mbs, "plan": plan.describe()}


def _extension(trainer: "Trainer") -> "ResiHPExtension | None":
    return next((e for e in trainer.extensions if e.name == "resihp"), None)


def make_failover(ext: "ResiHPExtension", trainer: "Trainer"):
    """The runtime's ``Failover``, fed by ``ext``'s heartbeat."""
    from megatron_ext.runtime.failover import Failover

    def by_heartbeat() -> set[int]:
        hb = ext.heartbeat
        if hb is None:
            return set()
        members = list(trainer.ctx.members)
        return {members[r] for r in hb.tracker.stopped if r < len(members)}

    # A failed collective waits this long for the heartbeat to name a rank (the launcher's report
    # comes sooner); after it the failure is not a lost rank's and is raised.
    wait_s = ext.cfg.resihp_heartbeat_timeout_s + 4 * ext.cfg.resihp_heartbeat_interval_s + 1.0
    return Failover(lost_by_heartbeat=by_heartbeat, decide=decide, wait_for_loss_s=wait_s,
                    stop=ext.stop_heartbeat).arm(trainer.ctx)


def on_stop_verdict(trainer: "Trainer", verdict, reporter: bool) -> None:
    """Heartbeat monitor thread, ``continue``: get the main thread out of any collective with the
    lost rank; a loss while the survivors regroup cannot be absorbed: restart."""
    from megatron_ext.runtime.failover import RESTART_EXIT_CODE, abort_connections

    fo = trainer.failover
    members = list(trainer.ctx.members)
    if fo is not None and verdict.rank < len(members) and members[verdict.rank] in fo.handled:
        return  # the launcher reported this loss first; the survivors are already on it
    if fo is not None and fo.phase == "regrouping":
        if reporter:
            where = trainer.cfg.checkpoint.save or trainer.cfg.checkpoint.load
            print(f"resihp: a second fault during the re-layout (rank {verdict.rank} of generation "
                  f"{trainer.ctx.generation} is gone too): cannot continue; restart from the last checkpoint"
                  + (f" (--load {where})" if where else ""), file=sys.stderr, flush=True)
        os._exit(RESTART_EXIT_CODE)
    abort_connections(trainer.ctx.store_addr)

"""Going on without a lost rank, in the same processes (``--resihp-on-stop continue``).

``continue_after_loss`` is the trainer's recovery: it settles the interrupted iteration, meets the
other survivors in the store, regroups them under the layout their leader planned and moves the
state, through the trainer's engine hooks (``_regroup_context``, ``_rebuild``) and the store
protocol of ``runtime/failover.py``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_ext.errors import one_line
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import failover

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.runtime.distributed import DistContext
    from megatron_ext.runtime.loop import Trainer


def continue_after_loss(trainer: "Trainer", error: BaseException) -> None:
    """Collective over the survivors: go on without the lost rank(s), in these processes.

    Settle the interrupted iteration; meet the other survivors in the store; the lowest of them
    plans their layout (``Failover.decide``: DP shrink, PP re-partition, ...); form a new default
    process group on the next generation's keys; move the state: every slice from a survivor
    that holds it at the committed iteration (a DP or TP replica of a lost rank's), else from
    the last checkpoint; go on from the committed iteration and data position. Raises
    ``RestartNeeded`` when that is impossible, ``LeftOut`` on a survivor the layout does not use."""
    fo, ctx = trainer.failover, trainer.ctx
    start = time.perf_counter()
    failover.abort_connections(ctx.store_addr)  # survivors still waiting on this rank fail now too
    lost = fo.wait_for_loss()
    if not lost:
        raise error  # a failure that no lost rank explains: not ours to handle
    fo.phase, fo.handled = "joining", set(lost)
    trainer.rolled_back = None
    applied = trainer._settle_inflight()
    saving, trainer._saving = trainer._saving, False
    old_name, gen = trainer.layout_name(), ctx.generation + 1
    joined = failover.join(fo.base, generation=gen, member=ctx.member,
                           info={"iteration": trainer.iteration, "consumed_samples": trainer.train_stream.consumed_samples},
                           expected=ctx.members, lost=fo.lost, timeout_s=ctx.timeout_s)
    leader = min(joined)
    if ctx.member == leader:
        failover.publish(fo.base, generation=gen, decision=fo.decide(trainer, sorted(joined), sorted(lost)))
    decision = failover.wait_decision(fo.base, generation=gen, leader=leader, lost=fo.lost,
                                      timeout_s=ctx.timeout_s)
    gone = ", ".join(map(str, sorted(set(ctx.members) - set(joined))))
    if "restart" in decision:
        raise failover.RestartNeeded(f"lost rank(s) {gone}: {decision['restart']}", report=ctx.member == leader)
    if ctx.member not in decision["members"]:
        fo.stop()
        raise failover.LeftOut(f"rank {ctx.member} has no place in the survivors' layout "
                               f"({decision['plan']}); it leaves the job")
    iteration, _ = failover.agree_iteration(joined)
    fo.phase = "regrouping"  # from here on another loss cannot be absorbed: restart instead
    trainer._fault_point("relayout", trainer.iteration + 1)  # the iteration the loss interrupted
    payload = ckpt.collect_payload(trainer.model, trainer.optimizer, every_replica=True)
    mine = payload if applied == iteration else None  # a stale copy (its update failed) is not used
    new_parallel = dataclasses.replace(
        trainer.cfg.parallel, tensor_model_parallel_size=decision["tp"], pipeline_model_parallel_size=decision["pp"],
        virtual_pipeline_model_parallel_size=decision["vpp"], pipeline_stage_layers=decision["stage_layers"],
        data_parallel_microbatches=decision["replica_microbatches"])
    new_cfg = dataclasses.replace(trainer.cfg, parallel=new_parallel)

    def new_ctx() -> DistContext:
        return trainer._regroup_context(ctx, members=decision["members"], tp=decision["tp"], pp=decision["pp"],
                                     vpp=decision["vpp"], ep=new_parallel.expert_model_parallel_size)

    def reshard() -> dict[str, Any]:
        payloads: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, mine)
        fallback = trainer.cfg.checkpoint.save or trainer.cfg.checkpoint.load
        try:
            report = ckpt.reshard_from_peers(payloads, model=trainer.model, optimizer=trainer.optimizer,
                                             fallback=fallback)
        except ckpt.CheckpointError as exc:
            report = {"error": str(exc)}
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)  # every rank learns a failure, and the oldest source
        return reports

    try:
        new_cfg.validate(len(decision["members"]))
        reports = trainer._rebuild(new_cfg, new_ctx, reshard)
    except failover.RestartNeeded:
        raise
    except Exception as exc:
        raise failover.RestartNeeded(f"lost rank(s) {gone}; the survivors could not regroup: "
                                     f"{one_line(exc)[:300]}") from exc
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise failover.RestartNeeded(f"lost rank(s) {gone}: state of a lost rank has no replica in memory and "
                                     f"no checkpoint to come from ({errors[0]})")
    from_ckpt = [r["checkpoint_iteration"] for r in reports if r["checkpoint_iteration"] is not None]
    lost_iterations = iteration - min(from_ckpt) if from_ckpt else 0
    fo.arm(trainer.ctx)
    fo.phase = "training"
    info = {"lost_ranks": sorted(set(ctx.members) - set(joined)), "from": old_name, "to": trainer.layout_name(),
            "members": list(trainer.ctx.members), "iteration": iteration, "rolled_back": trainer.rolled_back,
            "lost_iterations": lost_iterations,
            "restored_from_checkpoint": sorted({k for r in reports for k in r["from_checkpoint"]}),
            "checkpoint_iteration": min(from_ckpt) if from_ckpt else None, "generation": trainer.ctx.generation,
            "plan": decision["plan"], "pause_s": time.perf_counter() - start}
    trainer.continued.append(info)
    if trainer.ctx.rank == 0:
        redo = f"iteration {info['rolled_back']} rolled back, " if info["rolled_back"] else ""
        where = (f" (the lost ranks' shards of {len(info['restored_from_checkpoint'])} tensor(s) from the "
                 f"checkpoint of iteration {info['checkpoint_iteration']})") if from_ckpt else ""
        print(f" resihp: continuing without rank(s) {gone} after iteration {iteration}: {old_name} -> "
              f"{info['to']} on rank(s) {','.join(map(str, trainer.ctx.members))}; {redo}"
              f"{lost_iterations} iteration(s) lost{where}; pause {info['pause_s']:.2f} s", flush=True)
    trainer._record("fail_stop_continue", info)
    if saving and trainer.cfg.checkpoint.save:
        trainer.save_checkpoint()  # the save the loss interrupted, now by the survivors

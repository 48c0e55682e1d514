"""Part (a) of tools/bench_relayout.py: a live job with one rank slowed 2x, re-laid out by the
planner's plan through ``Trainer.relayout``.

    torchrun --nproc_per_node 2 tools/relayout_live_worker.py OUT ITERS pp2
    torchrun --nproc_per_node 4 tools/relayout_live_worker.py OUT ITERS pp2dp2

``pp2``: PP2, rank 1 (the last stage) slowed; each rank pinned to its own core (one rank per core,
so a stage's capacity is clean). ``pp2dp2``: PP2 x DP2, rank 2 (stage 1 of replica 0) slowed; the
planner may move layers and micro-batches between the replicas (DP work migration); each replica
pinned to its own core (its two stages share it: 4 ranks on 2 cores). Phases, each ``ITERS``
measured iterations after 2 unmeasured ones: healthy; the rank slowed 2x (ResiHP's throttle: held
idle inside each op) with no action; the planner's plan for the believed speeds applied live, the
rank still slowed. Then the same number of iterations straight, without the re-layout, from the
same initialisation: the loss curves must agree. Writes one JSON file.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.resihp.choose import make_planner, not_applicable, plan_layout, target_from_plan  # noqa: E402
from megatron_ext.resihp.injection import Throttle  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402

BASE = {"num_layers": 12, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128, "micro_batch_size": 1,
        "global_batch_size": 8, "pipeline_model_parallel_size": 2, "lr": 1e-3, "lr_decay_style": "constant",
        "eval_iters": 0, "progress": False, "train_iters": 10**6}
FACTOR = 2.0
SLOW_RANK = {"pp2": 1, "pp2dp2": 2}


def phase(trainer: Trainer, iters: int, losses: list) -> float:
    """Median iteration time of ``iters`` iterations after 2 unmeasured ones (agreed over ranks)."""
    times = []
    for i in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        m = trainer.train_step()
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(m.loss)
    return statistics.median(times)


def gather_losses(trainer: Trainer, mine: list) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    # the last stage has the loss; after a re-layout the last stage may be another rank: per index
    return [next(o[i] for o in out if o[i] is not None) for i in range(len(mine))]


def main() -> None:
    out_path, iters, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "pp2"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    slow_rank = SLOW_RANK[scenario]
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        # Rank r on core r mod the cores: on 2 cores pp2 gets one core per rank, pp2dp2 one per
        # replica (megatron's order puts replica r % 2 at rank r).
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    cfg = config_from_values(dict(BASE))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    trainer = Trainer(cfg, ctx).setup()
    losses: list = []
    healthy_s = phase(trainer, iters, losses)
    throttle = Throttle(list(trainer.model.chunks), FACTOR) if rank == slow_rank else None
    if throttle is not None:
        throttle.active = True
    slow_s = phase(trainer, iters, losses)
    speeds = [1.0 / FACTOR if r == slow_rank else 1.0 for r in range(world)]
    t0 = time.perf_counter()
    planner = make_planner(trainer, executable_only=True, healthy_times=[healthy_s])
    plan = planner.plan(plan_layout(trainer), speeds)
    decide_s = time.perf_counter() - t0
    result = {"healthy_s": healthy_s, "slow_s": slow_s, "decide_s": decide_s,
              "plan": plan.describe() if plan else None, "speeds": speeds}
    target = target_from_plan(plan.new) if plan is not None else None
    if target is not None and not_applicable(trainer, target) is None:
        if throttle is not None:
            throttle.remove()
        # The plan's rank permutation too (the slow process moved off the output layer's stage):
        # ``rank`` stays this process's launch rank, so the throttle below follows the device.
        info = trainer.change_layout(target, reason=plan.describe())
        if rank == slow_rank:
            throttle = Throttle(list(trainer.model.chunks), FACTOR)
            throttle.active = True
        result["pause_s"] = info["pause_s"]
        result["stage_layers"] = info["stage_layers"]
        result["replica_microbatches"] = info["replica_microbatches"]
        result["members"] = info["members"] if info["rank_order"] else None
        result["relayout_s"] = phase(trainer, iters, losses)
    curve = gather_losses(trainer, losses)
    if throttle is not None:
        throttle.remove()
    # The same iterations straight (no throttle: it changes no arithmetic), same initialisation.
    ctx = distributed.relayout(trainer.ctx, tp=1, pp=2, vpp=None, seed=cfg.training.seed)
    straight = Trainer(config_from_values(dict(BASE)), ctx).setup()
    ref: list = []
    for _ in range(len(curve)):
        ref.append(straight.train_step().loss)
    ref_curve = gather_losses(straight, ref)
    result["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(curve, ref_curve))
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

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

from megatron_ext.config.defaults import FORMER_DEFAULTS  # noqa: E402
from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.resihp.choose import make_planner, not_applicable, plan_layout, target_from_plan  # noqa: E402
from megatron_ext.resihp.injection import Throttle  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402

BASE = {**FORMER_DEFAULTS, "num_layers": 12, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 128, "micro_batch_size": 1,
        "global_batch_size": 8, "pipeline_model_parallel_size": 2, "lr": 1e-3, "lr_decay_style": "constant",
        "eval_iters": 0, "progress": False, "train_iters": 10**6}
FACTOR = 2.0
SLOW_RANK = {"pp2": 1, "pp2dp2": 2}


class ComputeClock:
    """Seconds this rank spends inside its model chunks' forward passes (the throttle's hold
    included: install it after the throttle, so its post-hook runs last). The ratio of two phases'
    per-iteration forward seconds is the rank's measured speed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.per_iteration = 0.0    # set by ``phase``: this rank's median forward seconds per iteration
        self._handles: list = []

    def install(self, chunks) -> None:
        self.remove()
        for chunk in chunks:
            start: dict[str, float] = {}
            self._handles.append(chunk.register_forward_pre_hook(
                lambda m, a, start=start: start.__setitem__("t", time.perf_counter())))
            self._handles.append(chunk.register_forward_hook(
                lambda m, a, o, start=start: setattr(self, "seconds", self.seconds + time.perf_counter() - start["t"])))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def phase(trainer: Trainer, iters: int, losses: list, clock: ComputeClock | None = None,
          samples: list | None = None) -> float:
    """Median iteration time of ``iters`` iterations after 2 unmeasured ones (agreed over ranks);
    ``clock``: its ``per_iteration`` is set to this rank's median forward seconds per iteration;
    ``samples``: gets every measured iteration's seconds."""
    times, fwd = [], []
    for i in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        f0 = clock.seconds if clock is not None else 0.0
        m = trainer.train_step()
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t0)
            if clock is not None:
                fwd.append(clock.seconds - f0)
        losses.append(m.loss)
    if clock is not None:
        clock.per_iteration = statistics.median(fwd)
    if samples is not None:
        samples.extend(times)
    return statistics.median(times)


def measured_speeds(healthy_fwd: float, slow_fwd: float) -> list[float]:
    """Every rank's measured speed in the slowed phase (its forward seconds healthy / slowed)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, healthy_fwd / slow_fwd if slow_fwd > 0 else 1.0)
    return [float(x) for x in out]


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
        # Rank r on core r mod the cores: one core per rank (the bench runs a case only when it
        # has a core for each rank).
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    cfg = config_from_values(dict(BASE))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    trainer = Trainer(cfg, ctx).setup()
    losses: list = []
    clock = ComputeClock()
    clock.install(trainer.model.chunks)
    series: dict[str, list[float]] = {"healthy": [], "healthy_again": [], "slowed": [], "after_relayout": []}
    healthy_s = phase(trainer, iters, losses, clock, series["healthy"])
    healthy_fwd = clock.per_iteration
    # The A/A phase: healthy again, right after -- how far two phases of the same job differ on
    # this host (phases run one after another; a re-layout is one-way and cannot be interleaved).
    phase(trainer, iters, losses, samples=series["healthy_again"])
    throttle = Throttle(list(trainer.model.chunks), FACTOR) if rank == slow_rank else None
    if throttle is not None:
        throttle.active = True
    clock.install(trainer.model.chunks)  # after the throttle: its hold counts
    slow_s = phase(trainer, iters, losses, clock, series["slowed"])
    clock.remove()
    measured = measured_speeds(healthy_fwd, clock.per_iteration)
    # The planner gets what the detector would believe (the nominal factor); the optimum the
    # bench compares with comes from the measured speeds.
    speeds = [1.0 / FACTOR if r == slow_rank else 1.0 for r in range(world)]
    t0 = time.perf_counter()
    planner = make_planner(trainer, executable_only=True, healthy_times=[healthy_s])
    plan = planner.plan(plan_layout(trainer), speeds)
    decide_s = time.perf_counter() - t0
    result = {"healthy_s": healthy_s, "slow_s": slow_s, "decide_s": decide_s,
              "plan": plan.describe() if plan else None, "speeds": speeds, "measured_speeds": measured,
              "series": series}
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
        result["relayout_s"] = phase(trainer, iters, losses, samples=series["after_relayout"])
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

"""The resilient-training systems as policies: what each does when its detector names a fault.

Every policy starts from the same job (``Context.start``) and sees the same detector model; each
pays what its mechanism costs (``hardware.Costs``): a restart reads a checkpoint and loses the work
since it; a live re-layout rebuilds communicators and copies state from replicas; rerouting and
schedule changes are nearly free but leave the devices where they were. docs/resilience.md says
what each system does, from its paper, and what this model of it leaves out.

Decisions use each system's own (analytical) view, from the detector's verdicts only; the score
always comes from the simulator (``sim``), which no policy calls to decide. ResiHP and this
package's glue around it are in ``resihp_policy``; ``make`` there builds any policy by name.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np

from megatron_ext.resihp.verdicts import Verdict
from megatron_ext.resilience.detector import LinkVerdict
from megatron_ext.resilience.job import Job, Pipeline, balanced_layers, move_bytes, stage_memory_bytes, stage_params
from megatron_ext.resilience.run import Action, Context
from megatron_ext.resilience.shapes import BWD_ATTENTION, BWD_LINEAR

logger = logging.getLogger(__name__)

READMIT_AFTER_S = 3600.0
"""A slow device (or node, or replica group) a policy left out of the job counts as healthy again
after this long unwatched: the fault model's slow-device episodes (``setting.mixed_day``: Pareto
from 10 minutes, shape 1.5) are over within the hour nine times in ten. The one readmission signal
of every policy that readmits (ResiHP, ``ckpt_restart``, ``torchft``): out of the job, nothing
observes the device, so no ``recovered`` verdict can come for it."""


# ---- shared helpers: each system's own analytical view ----------------------------------------

def stage_mb_s(ctx: Context, pipe: Pipeline, k: int, speed: float) -> float:
    """A micro-batch's forward + backward seconds on stage ``k`` (FLOPs at the mean attention work)."""
    sh, tokens = ctx.shape, ctx.data.tokens
    lin = pipe.layers[k] * sh.layer_linear_flops() * tokens + (sh.head_flops() * tokens if k == pipe.pp - 1 else 0.0)
    att = pipe.layers[k] * sh.layer_attention_flops_per_sq() * float(ctx.data.sum_sq.mean())
    return ((1 + BWD_LINEAR) * lin + (1 + BWD_ATTENTION) * att) / (ctx.hw.flops * pipe.tp * max(speed, 1e-12))


def split_by_finish(total: int, depth: Sequence[int], per_mb: Sequence[float]) -> list[int]:
    """Micro-batches per pipeline so that all finish together: a 1F1B pipeline of depth ``p`` whose
    slowest stage takes ``c`` per micro-batch finishes ``m`` of them in about ``(m + p - 1) c``.
    Each pipeline gets at least one."""
    n = len(depth)
    if total < n:
        raise ValueError(f"{total} micro-batches cannot feed {n} pipelines")
    m = np.ones(n, dtype=np.int64)
    d, c = np.asarray(depth, dtype=float), np.asarray(per_mb, dtype=float)
    for _ in range(total - n):
        m[int(np.argmin((m + 1 + d - 1) * c))] += 1
    return m.tolist()


def stage_speeds(pipe: Pipeline, speed: np.ndarray) -> list[float]:
    return [float(speed[list(g)].min()) for g in pipe.stages]


def layer_caps(ctx: Context, pipe: Pipeline, dp: int) -> list[int]:
    """Most layers each stage can hold in memory."""
    out = []
    for k in range(pipe.pp):
        n = 1
        while n < ctx.shape.num_layers:
            trial = dataclasses.replace(pipe, layers=tuple(n + 1 if i == k else x for i, x in enumerate(pipe.layers)))
            if stage_memory_bytes(ctx.shape, trial, k, dp, ctx.data.tokens) > ctx.hw.memory_bytes:
                break
            n += 1
        out.append(n)
    return out


def move_pause_s(ctx: Context, old: Job, new: Job, fixed_s: float) -> float:
    """``fixed_s`` plus the largest state a device receives, from a replica over its NIC."""
    moved = move_bytes(ctx.shape, old, new)
    return fixed_s + (max(moved.values()) if moved else 0.0) / ctx.hw.nic_bytes_per_s


def restart_pause_s(ctx: Context, job: Job) -> float:
    """In-job restart plus reading the checkpoint shard of the most loaded device."""
    shard = max(ctx.shape.layer_params() * max(p.layers) + 2 * ctx.shape.embedding_params()
                for p in job.pipelines) / job.tp * 16.0
    return ctx.costs.restart_s + shard / ctx.costs.checkpoint_read_bytes_per_s


def remap_nodes(job: Job, mapping: dict[int, int], g: int) -> Job:
    """The same job with node ``a``'s devices moved to node ``mapping[a]`` (same local index)."""
    def m(d: int) -> int:
        return mapping[d // g] * g + d % g if d // g in mapping else d
    return Job(tuple(dataclasses.replace(p, stages=tuple(tuple(m(d) for d in grp) for grp in p.stages))
                     for p in job.pipelines))


def nodes_of(devices, g: int) -> set[int]:
    return {d // g for d in devices}


class Policy:
    name = "policy"

    def start(self, ctx: Context) -> Job:
        self.job = ctx.start
        self.speed = np.ones(ctx.num_devices)
        return self.job

    def believe(self, verdicts: Sequence[Verdict]) -> list[Verdict]:
        """Update the believed speeds; returns the verdicts that changed them."""
        changed = []
        for v in verdicts:
            new = {"fail_slow": 1.0 / v.factor if v.factor else 1.0, "fail_stop": 0.0, "recovered": 1.0}.get(v.kind)
            if new is not None and self.speed[v.rank] != new and not (self.speed[v.rank] == 0 and new > 0):
                self.speed[v.rank] = new
                changed.append(v)
        return changed

    def react(self, ctx: Context, t: float, it: int, verdicts: list[Verdict], links: list[LinkVerdict]) -> Action | None:
        raise NotImplementedError


# ---- checkpoint-restart with a spare (Megatron-LM + NVRx) ----------------------------------------

class CheckpointRestart(Policy):
    """Megatron's default under NVRx: a lost device stops the job; the launcher restarts it inside
    the allocation with the lost node swapped for a spare node, from the last checkpoint. NVRx's
    straggler detection names slow GPUs; the job is restarted without a slow node when the time it
    would save over ``horizon_s`` pays for the restart and the lost work."""

    name = "ckpt_restart"

    def __init__(self, horizon_s: float = 3600.0) -> None:
        self.horizon_s = horizon_s

    def start(self, ctx: Context) -> Job:
        job = super().start(ctx)
        g = ctx.hw.gpus_per_node
        self.free_nodes = sorted(nodes_of(ctx.spares, g))
        self.excluded: dict[int, float] = {}     # slow node left out -> since when
        self.dropped: list[Pipeline] = []         # pipelines a restart without a spare gave up
        return job

    def restart_without(self, ctx: Context, bad_nodes: set[int], why: str) -> Action:
        g = ctx.hw.gpus_per_node
        mapping = {}
        for n in sorted(bad_nodes & nodes_of(self.job.devices, g)):
            while self.free_nodes and (self.speed[self.free_nodes[0] * g:(self.free_nodes[0] + 1) * g] < 1).any():
                self.free_nodes.pop(0)
            if not self.free_nodes:
                break
            mapping[n] = self.free_nodes.pop(0)
        job = remap_nodes(self.job, mapping, g)
        left = bad_nodes & nodes_of(job.devices, g)
        if left:
            # No spare left: restart on the whole pipelines that avoid the bad nodes, the global
            # batch spread over them.
            keep = [p for p in job.pipelines if not nodes_of(p.devices, g) & left]
            if not keep:
                raise RuntimeError(f"{self.name}: no pipeline left without node(s) {sorted(left)}")
            self.dropped += [p for p in job.pipelines if nodes_of(p.devices, g) & left]
            job = _spread(keep, job.microbatches)
        self.job = job
        return Action(job, restart_pause_s(ctx, job), rollback=True, note=f"restart {why}")

    def react(self, ctx, t, it, verdicts, links):
        self.believe(verdicts)
        g = ctx.hw.gpus_per_node
        dead = {v.rank // g for v in verdicts if v.kind == "fail_stop"}
        if dead:
            return self.restart_without(ctx, dead, f"without node(s) {sorted(dead)}")
        slow = [v for v in verdicts if v.kind == "fail_slow"]
        if slow and self.free_nodes:
            factor = max(v.factor for v in slow)
            cost = restart_pause_s(ctx, self.job) + ctx.costs.checkpoint_interval_s / 2
            if (1 - 1 / factor) * self.horizon_s > cost:
                bad = {v.rank // g for v in slow}
                for n in bad & nodes_of(self.job.devices, g):
                    self.excluded.setdefault(n, t)
                return self.restart_without(ctx, bad, f"without slow node(s) x{factor:.2f}")
        return self.readmit(ctx, t)

    def readmit(self, ctx: Context, t: float) -> Action | None:
        """A slow node left out for ``READMIT_AFTER_S`` joins the free nodes again (believed
        healthy; named again if it is not once it computes). When the job runs on fewer pipelines
        than it started with (a loss without a spare), a free node lets a dropped pipeline come
        back at the next restart: taken when the hour's gain pays for the restart and the lost work,
        the same rule as leaving a slow node out."""
        g = ctx.hw.gpus_per_node
        for n, since in sorted(self.excluded.items()):
            if t - since >= READMIT_AFTER_S:
                del self.excluded[n]
                devs = self.speed[n * g:(n + 1) * g]
                devs[devs > 0] = 1.0
                if (devs > 0).all() and n not in self.free_nodes:
                    self.free_nodes = sorted([*self.free_nodes, n])
        if not self.dropped or not self.free_nodes:
            return None
        back, rest, free = [], [], list(self.free_nodes)
        for p in self.dropped:
            bad = sorted(n for n in nodes_of(p.devices, g) if (self.speed[n * g:(n + 1) * g] < 1).any())
            if len(bad) > len(free):
                rest.append(p)
                continue
            back.append(remap_nodes(Job((p,)), dict(zip(bad, free)), g).pipelines[0])
            free = free[len(bad):]
        if not back:
            return None
        k = len(self.job.pipelines)
        cost = restart_pause_s(ctx, self.job) + ctx.costs.checkpoint_interval_s / 2
        if (1 - k / (k + len(back))) * self.horizon_s <= cost:
            return None
        self.dropped = rest
        self.free_nodes = free
        self.job = _spread([*self.job.pipelines, *back], self.job.microbatches)
        return Action(self.job, restart_pause_s(ctx, self.job), rollback=True,
                      note=f"restart on {len(self.job.pipelines)} pipelines ({len(back)} back on readmitted node(s))")


def _spread(pipes: Sequence[Pipeline], total: int) -> Job:
    """``pipes`` with ``total`` micro-batches spread evenly (the first ones take the remainder)."""
    base, extra = divmod(total, len(pipes))
    return Job(tuple(dataclasses.replace(p, microbatches=base + (1 if i < extra else 0)) for i, p in enumerate(pipes)))


# ---- Oobleck -------------------------------------------------------------------------------------

class Oobleck(CheckpointRestart):
    """Pipeline templates over whole nodes. After a loss the job is re-instantiated over the nodes
    left (and idle ones) from templates of different depths, the batch split so the pipelines finish
    together; state comes from the other pipelines' replicas, no restart. No fail-slow handling."""

    name = "oobleck"

    def start(self, ctx: Context) -> Job:
        job = super().start(ctx)
        g = ctx.hw.gpus_per_node
        p0 = job.pipelines[0]
        self.tp, self.pp = p0.tp, p0.pp
        self.per_node = g // (p0.tp * p0.pp) if (p0.tp * p0.pp) <= g and g % (p0.tp * p0.pp) == 0 else 0
        if not self.per_node and ((p0.tp * p0.pp) % g or g % p0.tp):
            raise ValueError(f"oobleck: pipelines of tp {p0.tp} x pp {p0.pp} neither fill whole nodes of {g} "
                             "nor divide one")
        self.nodes_per_pipe = max(1, p0.tp * p0.pp // g)
        self.stages_per_node = g // p0.tp
        return job

    def instantiate(self, ctx: Context, nodes: list[int]) -> Job:
        g, spn, sh = ctx.hw.gpus_per_node, self.stages_per_node, ctx.shape
        total = ctx.start.microbatches
        if self.per_node:
            # Pipelines smaller than a node: the template, as many times as each node holds it.
            span = self.tp * self.pp
            pipes = [Pipeline(stages=tuple(tuple(range(n * g + i * span + k * self.tp, n * g + i * span + (k + 1) * self.tp))
                                           for k in range(self.pp)),
                              layers=ctx.start.pipelines[0].layers, microbatches=1)
                     for n in nodes for i in range(self.per_node)]
            mbs = split_by_finish(total, [p.pp for p in pipes], [1.0] * len(pipes))
            return Job(tuple(dataclasses.replace(p, microbatches=m) for p, m in zip(pipes, mbs)))
        n_min = 1
        while n_min * spn < sh.num_layers and not self._fits(ctx, n_min, len(nodes) // max(n_min, 1)):
            n_min += 1
        x = max(1, math.ceil(len(nodes) / self.nodes_per_pipe))
        while x > 1 and len(nodes) // x < n_min:
            x -= 1
        sizes = [len(nodes) // x + (1 if i < len(nodes) % x else 0) for i in range(x)]
        if min(sizes) < n_min:
            raise RuntimeError(f"oobleck: {len(nodes)} node(s) cannot hold one pipeline")
        pipes, at = [], 0
        for size in sizes:
            mine = nodes[at:at + size]
            at += size
            pp = size * spn
            stages = tuple(tuple(n * g + s * self.tp + t for t in range(self.tp)) for n in mine for s in range(spn))
            pipes.append(Pipeline(stages=stages, layers=balanced_layers(sh, pp), microbatches=1))
        per_mb = [max(stage_mb_s(ctx, p, k, 1.0) for k in range(p.pp)) for p in pipes]
        mbs = split_by_finish(total, [p.pp for p in pipes], per_mb)
        return Job(tuple(dataclasses.replace(p, microbatches=m) for p, m in zip(pipes, mbs)))

    def _fits(self, ctx: Context, n_nodes: int, dp: int) -> bool:
        pp = n_nodes * self.stages_per_node
        if pp > ctx.shape.num_layers:
            return False
        p = Pipeline(stages=tuple(tuple(range(k * self.tp, (k + 1) * self.tp)) for k in range(pp)),
                     layers=balanced_layers(ctx.shape, pp), microbatches=ctx.start.microbatches)
        return all(stage_memory_bytes(ctx.shape, p, k, max(dp, 1), ctx.data.tokens) <= ctx.hw.memory_bytes
                   for k in range(pp))

    def react(self, ctx, t, it, verdicts, links):
        self.believe(verdicts)
        g = ctx.hw.gpus_per_node
        dead = {v.rank // g for v in verdicts if v.kind == "fail_stop"}
        if not dead:
            return None
        used = sorted(nodes_of(self.job.devices, g) - dead)
        alive = [n for n in self.free_nodes if (self.speed[n * g:(n + 1) * g] > 0).all()]
        self.free_nodes = [n for n in self.free_nodes if n not in alive]
        new = self.instantiate(ctx, used + alive)
        pause = move_pause_s(ctx, self.job, new, ctx.costs.reconfigure_s)
        self.job = new
        return Action(new, pause, note=f"re-instantiated without node(s) {sorted(dead)}: "
                      f"{len(new.pipelines)} pipelines of depths {sorted({p.pp for p in new.pipelines})}")


# ---- ReCycle -------------------------------------------------------------------------------------

def reroute(pipelines: Sequence[Pipeline], speed: np.ndarray) -> tuple[list[Pipeline], Job]:
    """ReCycle's answer for ``pipelines`` at the believed ``speed``: the pipelines that still have a
    usable stage (a pipeline that lost every stage is dropped, its
    micro-batches spread over the rest), and the job with every slow or lost stage's micro-batches
    on its peers."""
    pipes, orphaned = [], 0
    for p in pipelines:
        v = stage_speeds(p, speed)
        if all(x <= 0 for x in v):
            orphaned += p.microbatches
            continue
        pipes.append(p)
    if not pipes:
        raise RuntimeError("recycle: every pipeline is lost")
    if orphaned:
        base, extra = divmod(orphaned, len(pipes))
        pipes = [dataclasses.replace(p, microbatches=p.microbatches + base + (1 if i < extra else 0))
                 for i, p in enumerate(pipes)]
    out = []
    for p in pipes:
        # A slow stage hands all of its micro-batches to its peers: in the simulator the rerouted
        # ones still take their place in the stage's order (at the peer's speed), so keeping
        # any on the slow device only lengthens the chain; all of them is ReCycle's best split.
        rer = tuple(p.microbatches if x < 1.0 else 0 for x in stage_speeds(p, speed))
        out.append(dataclasses.replace(p, rerouted=rer if any(rer) else ()))
    return pipes, Job(tuple(out))


def _reroute_note(job: Job) -> str:
    return ("reroute " + ", ".join(f"p{q}:{list(p.rerouted)}" for q, p in enumerate(job.pipelines) if p.rerouted))[:200]


class ReCycle(Policy):
    """A lost (or slow) stage's micro-batches go to the same stage of the other pipelines, into
    their bubbles; no spare, no restart. A pipeline that lost every stage is dropped and its
    micro-batches spread over the others."""

    name = "recycle"

    def start(self, ctx: Context) -> Job:
        job = super().start(ctx)
        self.kept = list(job.pipelines)
        return job

    def react(self, ctx, t, it, verdicts, links):
        if not self.believe(verdicts):
            return None
        self.kept, job = reroute(self.kept, self.speed)
        self.job = job
        return Action(job, ctx.costs.reroute_s, note=_reroute_note(job))


# ---- Malleus-like straggler-aware re-planner ------------------------------------------------------

class Malleus(CheckpointRestart):
    """Re-plans around slow devices without changing group membership: each pipeline's layers in
    proportion to its stages' speeds, the micro-batches in proportion to the pipelines' speeds;
    migrates state live. A loss falls back to checkpoint-restart with a spare."""

    name = "malleus"

    def __init__(self, min_gain: float = 0.05) -> None:
        super().__init__()
        self.min_gain = min_gain

    def replan(self, ctx: Context) -> Job:
        dp = len(self.job.pipelines)
        pipes = []
        for p in self.job.pipelines:
            v = stage_speeds(p, self.speed)
            caps = layer_caps(ctx, p, dp)
            pipes.append(dataclasses.replace(p, layers=balanced_layers(ctx.shape, p.pp, v, caps)))
        per_mb = [max(stage_mb_s(ctx, p, k, s) for k, s in enumerate(stage_speeds(p, self.speed))) for p in pipes]
        mbs = split_by_finish(self.job.microbatches, [p.pp for p in pipes], per_mb)
        return Job(tuple(dataclasses.replace(p, microbatches=m) for p, m in zip(pipes, mbs)))

    def estimate_s(self, ctx: Context, job: Job) -> float:
        return max((p.microbatches + p.pp - 1) * max(stage_mb_s(ctx, p, k, s) for k, s in
                                                     enumerate(stage_speeds(p, self.speed))) for p in job.pipelines)

    def react(self, ctx, t, it, verdicts, links):
        if any(v.kind == "fail_stop" for v in verdicts):
            return super().react(ctx, t, it, verdicts, links)
        if not self.believe(verdicts):
            return None
        new = self.replan(ctx)
        if self.estimate_s(ctx, new) >= self.estimate_s(ctx, self.job) * (1 - self.min_gain):
            return None
        pause = move_pause_s(ctx, self.job, new, ctx.costs.reconfigure_s)
        self.job = new
        return Action(new, pause, note="re-plan layers " + "; ".join(sorted({"/".join(map(str, p.layers)) for p in new.pipelines}))[:120])


# ---- ADAPTRA ---------------------------------------------------------------------------------------

class Adaptra(CheckpointRestart):
    """On a slow link between pipeline stages: sends leave the GPU's stream (host-side transfers, so
    they no longer hold the sender) and the stages before the link run more micro-batches ahead, so
    the delay is absorbed instead of stalling the schedule. Compute stragglers: nothing; a loss:
    checkpoint-restart with a spare."""

    name = "adaptra"

    def start(self, ctx: Context) -> Job:
        job = super().start(ctx)
        self.nic = np.ones(ctx.num_devices)
        self.path: dict[tuple[int, int], float] = {}
        return job

    def adapt(self, ctx: Context) -> Job:
        g, hw = ctx.hw.gpus_per_node, ctx.hw
        nbytes = 2.0 * ctx.data.tokens * ctx.shape.hidden_size / self.job.tp
        dp = len(self.job.pipelines)
        out = []
        for p in self.job.pipelines:
            delays = []
            for k in range(p.pp - 1):
                worst = 0.0
                for a, b in zip(p.stages[k], p.stages[k + 1]):
                    if a // g == b // g:
                        continue
                    f = min(self.nic[a], self.nic[b], self.path.get((min(a // g, b // g), max(a // g, b // g)), 1.0))
                    worst = max(worst, nbytes / (hw.nic_bytes_per_s * f))
                delays.append(worst)
            if not delays or max(delays) <= nbytes / hw.nic_bytes_per_s * 1.0001:
                out.append(dataclasses.replace(p, extra_warmup=(), async_sends=False))
                continue
            extra = [0] * p.pp
            for k, dl in enumerate(delays):
                mb = min(stage_mb_s(ctx, p, j, 1.0) for j in range(p.pp))
                need = math.ceil(2 * dl / mb)
                for j in range(k + 1):
                    extra[j] = max(extra[j], need)
            extra = [min(e, p.microbatches) for e in extra]
            q = dataclasses.replace(p, extra_warmup=tuple(extra), async_sends=True)
            while any(stage_memory_bytes(ctx.shape, q, k, dp, ctx.data.tokens) > hw.memory_bytes for k in range(q.pp)) \
                    and max(q.extra_warmup) > 0:
                q = dataclasses.replace(q, extra_warmup=tuple(max(0, e - 1) for e in q.extra_warmup))
            out.append(q)
        return Job(tuple(out))

    def react(self, ctx, t, it, verdicts, links):
        if any(v.kind == "fail_stop" for v in verdicts):
            return super().react(ctx, t, it, verdicts, links)
        self.believe(verdicts)
        if not links:
            return None
        for lv in links:
            if lv.kind == "slow_nic":
                self.nic[lv.target] = 1.0 / lv.factor
            else:
                self.path[tuple(sorted(lv.target))] = 1.0 / lv.factor
        new = self.adapt(ctx)
        if new == self.job:
            return None
        self.job = new
        return Action(new, ctx.costs.schedule_adapt_s, note="adapt schedule: extra warm-up " + "; ".join(
            sorted({"/".join(map(str, p.extra_warmup)) for p in new.pipelines if p.extra_warmup}))[:120])


# ---- torchft: data-parallel shrink ------------------------------------------------------------------

class TorchFT(Policy):
    """Replica groups (here: pipelines) leave the quorum when they fail; the others step on without
    them (a smaller global batch) after a quorum change. A group that lost a device is started again
    on the spare node in the lost node's place (the launcher restarts its processes while the others
    train) and joins with its state from a peer. A group that is slow, or behind a slow NIC or path,
    is left out when its own estimate says the job is faster without it, and rejoins on the same
    signal as ResiHP's readmission: after ``READMIT_AFTER_S`` out of the job (nothing observes it
    there), named again if it is still slow."""

    name = "torchft"

    def start(self, ctx: Context) -> Job:
        job = super().start(ctx)
        g = ctx.hw.gpus_per_node
        self.groups = list(ctx.start.pipelines)
        self.lost: set[int] = set()                 # groups with a lost device and no spare for it
        self.ready_at: dict[int, float] = {}        # groups restarting on the spare node
        self.out_since: dict[int, float] = {}       # groups left out for slowness
        self.free_nodes = sorted(nodes_of(ctx.spares, g))
        self.nic = np.ones(ctx.num_devices)
        self.path: dict[tuple[int, int], float] = {}
        return job

    def _believe_links(self, links: Sequence[LinkVerdict]) -> bool:
        changed = False
        for lv in links:
            f = 1.0 / lv.factor
            if lv.kind == "slow_nic":
                changed |= bool(self.nic[lv.target] != f)
                self.nic[lv.target] = f
            else:
                key = tuple(sorted(lv.target))
                changed |= self.path.get(key, 1.0) != f
                if f >= 1.0:
                    self.path.pop(key, None)
                else:
                    self.path[key] = f
        return changed

    def group_s(self, ctx: Context, q: int) -> float:
        """torchft's estimate of a step of group ``q`` alone (its own view, at the believed speeds):
        1F1B's ``(m + p - 1)`` slowest micro-batches, the gradient all-reduce across groups through
        the group's slowest NIC, and a slow path inside the group paid by every send over it. A
        slow path between two groups' nodes is charged to the group on its higher node: one group
        leaving the ring takes the path out of it."""
        p, g, hw = self.groups[q], ctx.hw.gpus_per_node, ctx.hw
        v = stage_speeds(p, self.speed)
        compute = (p.microbatches + p.pp - 1) * max(stage_mb_s(ctx, p, k, s) for k, s in enumerate(v))
        grads = 2.0 * max(stage_params(ctx.shape, p, k) for k in range(p.pp)) / p.tp
        slow = 1.0 / float(self.nic[list(p.devices)].min())
        nodes = nodes_of(p.devices, g)
        sends = 0.0
        hop = 2.0 * ctx.data.tokens * ctx.shape.hidden_size / p.tp / hw.nic_bytes_per_s
        for (a, b), f in self.path.items():
            if a in nodes and b in nodes:
                sends += 2 * p.microbatches * hop * (1.0 / f - 1.0)
            elif max(a, b) in nodes:
                slow = max(slow, 1.0 / f)
        return compute + sends + 2.0 * grads / (hw.nic_bytes_per_s / slow)

    def _lose(self, ctx: Context, q: int, t: float) -> None:
        """Group ``q`` lost a device: started again on free nodes in its lost nodes' place, or lost."""
        g = ctx.hw.gpus_per_node
        p = self.groups[q]
        bad = sorted(n for n in nodes_of(p.devices, g) if (self.speed[n * g:(n + 1) * g] <= 0).any())
        free = [n for n in self.free_nodes if (self.speed[n * g:(n + 1) * g] > 0).all()]
        self.out_since.pop(q, None)
        if len(bad) > len(free):
            self.lost.add(q)
            return
        self.free_nodes = [n for n in self.free_nodes if n not in free[:len(bad)]]
        self.groups[q] = remap_nodes(Job((p,)), dict(zip(bad, free)), g).pipelines[0]
        self.ready_at[q] = t + ctx.costs.restart_s

    def react(self, ctx, t, it, verdicts, links):
        changed = bool(self.believe(verdicts)) | self._believe_links(links)
        g = ctx.hw.gpus_per_node
        for q, p in enumerate(self.groups):
            if q not in self.lost and q not in self.ready_at and (self.speed[list(p.devices)] <= 0).any():
                self._lose(ctx, q, t)
                changed = True
        for q, when in sorted(self.ready_at.items()):
            if t >= when:
                del self.ready_at[q]
                changed = True
        for q, since in sorted(self.out_since.items()):
            if t - since >= READMIT_AFTER_S:
                # Readmitted: believed healthy again, its links with it.
                devs = list(self.groups[q].devices)
                self.speed[devs] = np.where(self.speed[devs] > 0, 1.0, 0.0)
                self.nic[devs] = 1.0
                nodes = nodes_of(devs, g)
                self.path = {k: f for k, f in self.path.items() if not set(k) & nodes}
                del self.out_since[q]
                changed = True
        if not changed:
            return None
        # A step waits for the slowest group in the quorum and trains each group's share: keep the
        # k groups of the shortest estimated steps for the k that trains the most per second.
        live = [q for q in range(len(self.groups)) if q not in self.lost and q not in self.ready_at]
        if not live:
            raise RuntimeError("torchft: no replica group left")
        est = {q: self.group_s(ctx, q) for q in live}
        order = sorted(live, key=lambda q: (est[q], q))
        mb = [self.groups[q].microbatches for q in order]
        k = max(range(1, len(order) + 1), key=lambda k: (sum(mb[:k]) / est[order[k - 1]], k))
        keep = sorted(order[:k])
        for q in order[k:]:
            self.out_since.setdefault(q, t)
        for q in keep:
            self.out_since.pop(q, None)
        new = Job(tuple(self.groups[q] for q in keep))
        if new == self.job:
            return None
        rejoin = [self.groups[q] for q in keep if self.groups[q] not in self.job.pipelines]
        pause = ctx.costs.quorum_s
        if rejoin:
            pause += 16.0 * max(ctx.shape.layer_params() * max(p.layers) + 2 * ctx.shape.embedding_params()
                                for p in rejoin) / new.tp / ctx.hw.nic_bytes_per_s
        self.job = new
        return Action(new, pause, note=f"quorum of {len(keep)}/{len(self.groups)} replica groups"
                      + (f" ({len(rejoin)} joining)" if rejoin else ""))


BASELINES = ("ckpt_restart", "oobleck", "recycle", "malleus", "adaptra", "torchft")
TABLE = {"ckpt_restart": CheckpointRestart, "oobleck": Oobleck, "recycle": ReCycle, "malleus": Malleus,
         "adaptra": Adaptra, "torchft": TorchFT}

"""ResiHP as a policy: ``megatron_ext.resihp``'s planner and hysteresis decide, the simulator scores;
and this package's glue around them (issue #22 item 5), each variant a row of the benchmark.

* ``resihp``: the planner and ``PlanPolicy`` as they are; the planner is told the node size
  (``Cluster.devices_per_node``), so its TP groups stay inside nodes, and the NIC verdicts of the
  live ring probe (``resihp/nic.py``, ``--resihp-nic-probe-interval``), which it charges to the
  data-parallel rings the device is in;
* ``resihp-nodeless``: the planner as it was before it knew nodes (the "before" of that change);
* ``resihp-nicless``: the planner as it was before it took NIC verdicts (the "before" of that one);
* ``resihp-noreadmit``: the policy as it was before it readmitted slow devices left out of the
  job (``PlanPolicy(readmit_after=...)``: a left-out device is not watched, so without it the
  policy believes it slow for the rest of the run) and before the planner grew DP back onto them;
* ``resihp-pathless``: the policy as it was before it took the ring probe's path verdicts (issue
  #47 item 6: the planner reorders the data-parallel rings around a slow path);
* ``resihp+rr``: also reroutes a faulty stage's micro-batches to its peers at once (ReCycle's
  mechanism) and re-lays out only when the planner predicts its plan beats that.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from megatron_ext.models.flops import ModelSpec
from megatron_ext.resihp.planner import Cluster, Planner, PlannerConfig, Workload
from megatron_ext.resihp.planner_policy import PlanPolicy
from megatron_ext.resihp.planner_types import PlanningError
from megatron_ext.resihp.verdicts import Verdict
from megatron_ext.resilience.detector import LinkVerdict
from megatron_ext.resilience.job import Job, from_plan_layout, memory_bytes, to_plan_layout
from megatron_ext.resilience.policies import (BASELINES, READMIT_AFTER_S, TABLE, CheckpointRestart, Policy,
                                              _reroute_note, move_pause_s, nodes_of, reroute)
from megatron_ext.resilience.run import Action, Context
from megatron_ext.resilience.shapes import ModelShape

logger = logging.getLogger(__name__)



def model_spec(shape: ModelShape) -> ModelSpec:
    """The shape as ResiHP's FLOPs model sees it."""
    return ModelSpec(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                     num_attention_heads=shape.num_attention_heads, vocab_size=shape.vocab_size,
                     ffn_hidden_size=shape.moe_ffn_hidden_size if shape.is_moe else shape.ffn_hidden_size,
                     num_query_groups=shape.num_query_groups, gated_linear_unit=True,
                     num_experts=shape.num_experts, moe_router_topk=shape.moe_topk if shape.is_moe else 2,
                     shared_expert_ffn_hidden_size=shape.shared_expert_ffn_hidden_size,
                     flash_attention=True)


class ResiHP(Policy):
    """ResiHP's planner and hysteresis (``megatron_ext.resihp``) decide; the simulator scores. The
    planner gets this cluster's figures (effective FLOP/s, NIC and NVLink bandwidth, the re-layout
    pause) and, since the planner's memory model is injectable, this module's (distributed
    optimizer over the layout's replicas, selective recomputation). A layout no planner move can reach after a loss falls back
    to checkpoint-restart."""

    name = "resihp"

    def __init__(self, *, config: PlannerConfig | None = None, recover_after: int = 50, nodes: bool = True,
                 nics: bool = True, reroute_first: bool = False, readmit_after_s: float | None = READMIT_AFTER_S,
                 paths: bool = True) -> None:
        self.config = config or PlannerConfig()
        if readmit_after_s is None:
            self.config = dataclasses.replace(self.config, grow_replicas=False)
        self.recover_after = recover_after
        self.readmit_after_s = readmit_after_s
        self.nodes = nodes
        self.nics = nics
        self.reroute_first = reroute_first
        self.paths = paths
        if not nodes:
            self.name = "resihp-nodeless"
        elif not nics:
            self.name = "resihp-nicless"
        elif readmit_after_s is None:
            self.name = "resihp-noreadmit"
        elif not paths:
            self.name = "resihp-pathless"
        elif reroute_first:
            self.name = "resihp+rr"

    def planner(self, ctx: Context) -> Planner:
        shape, tokens = ctx.shape, ctx.data.tokens

        def memory(spec, workload, tp, pp, layers, dp):
            # The distributed optimizer: master weights and moments sharded over the replicas.
            return np.array([memory_bytes(shape, int(n), first=k == 0, last=k == pp - 1, tp=tp, dp=dp, inflight=pp - k,
                                          seq_tokens=tokens) for k, n in enumerate(layers)])

        cl = Cluster(device_flops=ctx.hw.flops, memory_bytes=ctx.hw.memory_bytes, link_bytes_per_s=ctx.hw.nic_bytes_per_s,
                     tp_bytes_per_s=ctx.hw.nvlink_bytes_per_s, relayout_pause_s=ctx.costs.reconfigure_s,
                     p2p_latency_s=ctx.hw.nic_latency_s,
                     devices_per_node=ctx.hw.gpus_per_node if self.nodes else None)
        wl = Workload(seq_length=ctx.data.seq_length, micro_batch_size=ctx.data.micro_batch_size,
                      attention_sq_per_sequence=float(ctx.data.sum_sq.mean()) / ctx.data.micro_batch_size)
        return Planner(model_spec(shape), cl, wl, self.config, memory_model=memory)

    def start(self, ctx: Context) -> Job:
        job = super().start(ctx)
        self.fallback = CheckpointRestart()
        self.fallback.start(ctx)
        planner, layout = self.planner(ctx), to_plan_layout(job)
        # The window in iterations of the healthy job as the planner's own model times it (it used
        # to ask the simulator, which no policy may: issue #47).
        readmit = 0 if self.readmit_after_s is None else \
            max(1, math.ceil(self.readmit_after_s / planner.iteration_s(layout, np.ones(ctx.num_devices))))
        self.policy = PlanPolicy(planner, layout, ctx.num_devices,
                                 recover_after=self.recover_after, readmit_after=readmit)
        self._last: tuple[float, bool] | None = None   # the last react's time, and whether it left the job as it was
        return job

    def decide(self, ctx: Context, it: int, verdicts: list[Verdict]) -> Action | None:
        try:
            plan = self.policy.observe(it, verdicts)
        except PlanningError as exc:
            self.fallback.job, self.fallback.speed = self.job, self.policy.speeds.copy()
            g = ctx.hw.gpus_per_node
            self.fallback.free_nodes = [n for n in self.fallback.free_nodes if n not in nodes_of(self.job.devices, g)]
            act = self.fallback.restart_without(ctx, {v.rank // ctx.hw.gpus_per_node for v in verdicts
                                                      if v.kind == "fail_stop"}, f"(planner: {exc})"[:80])
            self.job = act.job
            self.policy.layout = to_plan_layout(act.job)
            return act
        if plan is None:
            return None
        return self._adopt(ctx, plan, "")

    def react(self, ctx, t, it, verdicts, links):
        if self.nics:
            verdicts = list(verdicts) + self._probe_verdicts(ctx, it, links) + self._readmit_nics(t, it)
        if self.reroute_first:
            return self._reroute_or_plan(ctx, it, verdicts)
        act = self.decide(ctx, it, verdicts)
        # The iteration's measured time, as the live job measures its own (run_policy calls react
        # once per iteration, at its end): not when either call changed the job (a pause in it).
        # (`resihp+rr` learns none: its rerouted job is not the planner's layout.)
        if act is None and self._last is not None and self._last[1]:
            self.policy.record_time(t - self._last[0])
        self._last = (t, act is None)
        return act

    def _reroute_or_plan(self, ctx: Context, it: int, verdicts: list[Verdict]) -> Action | None:
        """Glue (item 5, "combine rerouting with re-layout"): hand a slow or lost stage's
        micro-batches to its data-parallel peers at once (ReCycle's mechanism: seconds, nothing
        moves), and re-lay out only when the planner predicts its plan beats the layout in force
        with the faulty devices' work hidden that way."""
        before = self.policy.speeds.copy()
        try:
            plan = self.policy.observe(it, verdicts, adopt=False)
        except PlanningError:
            return self.decide(ctx, it, [])   # no plan survives: decide's fallback restarts
        base = self.policy.layout
        if np.array_equal(before, self.policy.speeds):
            # No device changed speed (a NIC did): nothing to reroute; the plan stands on its own.
            return None if plan is None else self._adopt(ctx, plan, "")
        hidden = np.where((self.policy.speeds < 1) & np.isin(np.arange(ctx.num_devices), base.devices), 1.0,
                          self.policy.speeds)
        # A replica that lost every stage cannot be rerouted: its micro-batches go to the others.
        grid = np.asarray(base.devices).reshape(base.pp, base.dp, base.tp)
        gone = [d for d in range(base.dp) if (self.policy.speeds[grid[:, d, :]] <= 0).any(axis=1).all()]
        share = base.num_microbatches / max(1, base.num_microbatches - sum(base.microbatches[d] for d in gone))
        rerouted_s = self.policy.planner.iteration_s(base, hidden, self.policy.links, self.policy.nics,
                                                     self.policy.paths) * share
        if plan is not None and plan.iteration_s_after + plan.move_s / plan.horizon_iterations < rerouted_s:
            return self._adopt(ctx, plan, " (beats rerouting)")
        try:
            _, job = reroute(from_plan_layout(base).pipelines, self.policy.speeds)
        except RuntimeError:
            return None
        if job == self.job:
            return None
        self.job = job
        return Action(job, ctx.costs.reroute_s, note=_reroute_note(job))

    def _adopt(self, ctx: Context, plan, why: str) -> Action:
        """The plan's layout becomes the job's. Its pause: the largest state a device receives plus
        a process-group rebuild, or, when every device keeps its place (a new micro-batch split
        only), what a reroute costs the baselines for the same act."""
        self.policy.layout = plan.new
        new = from_plan_layout(plan.new)
        same_places = plan.new.dp == plan.old.dp and \
            dataclasses.replace(plan.new, microbatches=plan.old.microbatches) == plan.old
        pause = move_pause_s(ctx, self.job, new, ctx.costs.reroute_s if same_places else ctx.costs.reconfigure_s)
        self.job = new
        return Action(new, pause, note=f"plan [{', '.join(plan.actions)}] {plan.new.shape} layers "
                      f"{'/'.join(map(str, plan.new.stage_layers))}{why}")

    def _readmit_nics(self, t: float, it: int) -> list[Verdict]:
        """A slow NIC whose device the layout left out is readmitted like a slow device (the same
        ``READMIT_AFTER_S`` out of the job; nothing observes it there): a ``nic_recovered``
        verdict, which the policy's hysteresis then applies. The detector names it again if it is
        still slow once its device is back in the job. (Until issue #47 the detector model reported
        such a NIC recovered the moment its device left the job.)"""
        inside = set(self.job.devices)
        out = getattr(self, "_nics_out", {})
        self._nics_out = {d: out.get(d, t) for d in self.policy.nics if d not in inside}
        back = [d for d, since in self._nics_out.items() if t - since >= self.readmit_after_s] \
            if self.readmit_after_s is not None else []
        for d in back:
            del self._nics_out[d]
        return [Verdict(kind="nic_recovered", rank=int(d), stage=None, iteration=it, factor=None, confidence=1.0,
                        detector="readmission") for d in sorted(back)]

    def _probe_verdicts(self, ctx: Context, it: int, links: list[LinkVerdict]) -> list[Verdict]:
        """The detector model's NIC and path verdicts as the live ring probe gives them
        (``resihp/nic.py``: ``slow_nic`` with the NIC's bandwidth in ``detail["mbps"]``,
        ``nic_recovered``; ``slow_path`` / ``path_recovered`` for a pair of devices). A slow path
        between two nodes slows every pair of devices across them: one path verdict per pair."""
        out = []
        g = ctx.hw.gpus_per_node
        for lv in links:
            if lv.kind == "slow_path":
                if not self.paths:
                    continue
                recovered = lv.factor == 1.0
                na, nb = lv.target
                detail = {} if recovered else {"mbps": ctx.hw.nic_bytes_per_s / lv.factor / 1e6}
                out += [Verdict(kind="path_recovered" if recovered else "slow_path", rank=a, stage=None, iteration=it,
                                factor=None, confidence=1.0, detector="link-model",
                                detail={"launch_rank": a, "peer_launch_rank": b, **detail})
                        for a in range(na * g, (na + 1) * g) for b in range(nb * g, (nb + 1) * g)]
                continue
            if lv.kind != "slow_nic":
                continue
            recovered = lv.factor == 1.0
            out.append(Verdict(kind="nic_recovered" if recovered else "slow_nic", rank=int(lv.target), stage=None,
                               iteration=it, factor=None, confidence=1.0, detector="link-model",
                               detail={} if recovered else {"mbps": ctx.hw.nic_bytes_per_s / lv.factor / 1e6}))
        return out


BEFORE = ("resihp-nodeless", "resihp-nicless", "resihp-noreadmit", "resihp-pathless")
"""ResiHP as it was before a change of ``megatron_ext.resihp``, kept as rows for the before/after."""
GLUE = ("resihp+rr",)
"""ResiHP's decisions with this package's glue (docs/resilience.md, "Policy glue")."""
_FLAGS = {"resihp": {}, "resihp-nodeless": {"nodes": False, "nics": False}, "resihp-nicless": {"nics": False},
          "resihp-noreadmit": {"readmit_after_s": None},
          "resihp-pathless": {"paths": False},
          "resihp+rr": {"reroute_first": True}}


def make(name: str) -> Policy:
    """A fresh policy by name: a baseline (``BASELINES``), ``resihp``, its "before" or a glue variant."""
    if name in _FLAGS:
        return ResiHP(**_FLAGS[name])
    if name not in TABLE:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join([*BASELINES, *_FLAGS])}")
    return TABLE[name]()

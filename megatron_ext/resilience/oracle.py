"""The oracle (issue #47 item 3): the physical limit of this setting, as far as these mechanisms go.

It knows every fault the moment it starts and its true size, changes layout at no cost (no pause,
no state to move, no lost iteration, no rollback), and in every stretch of the trace where nothing
changes runs the layout the *scorer* times fastest, among:

* the start job;
* every job any policy of the cell ran (``RunResult.jobs``): every baseline's mechanism and
  ResiHP's as they played out;
* each baseline's mechanism applied at once with the true speeds: ReCycle's reroute of every
  faulty stage, torchft's quorum without the faulty replica groups (every prefix of the groups
  ranked by the scorer's own time for them);
* ResiHP's knobs with the truth: its planner's best layout (``Planner.best_layout``: membership,
  PP repartition, DP migration, reshape, node-local groups) for the faults' true sizes (device
  speeds, NIC bandwidths), searched from the start job.

Under the perturbed scorer (``perturb``) the oracle knows the faults, not the drawn spread between
healthy devices: that spread is what no policy here is told, and the scorer still picks among the
candidates on the truths, so the oracle gains from it only where a candidate happens to.

A policy's throughput over the oracle's is the fraction of this limit it reaches. The oracle is a
bound on these layouts, not on every layout there is; it is scored by the same scorer as the
policies, so a policy can pass it only by the part of one iteration that straddles a change of the
trace (an iteration is timed on the state at its start).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

import numpy as np

from megatron_ext.resihp.planner_types import PlanningError
from megatron_ext.resilience.faults import ClusterState, FaultTrace
from megatron_ext.resilience.job import Job, from_plan_layout, to_plan_layout
from megatron_ext.resilience.policies import reroute
from megatron_ext.resilience.run import Context, RunResult
from megatron_ext.resilience.sim import DeviceGone, Simulator, computing_devices

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OracleResult:
    throughput_vs_healthy: float
    tokens: float
    choices: tuple[tuple[float, str], ...]
    """Per stretch of the trace: its start and where the chosen layout came from."""


def _rate(scorer: Simulator, job: Job, state: ClusterState) -> float:
    if (state.speed[computing_devices(job)] <= 0).any():
        return 0.0
    try:
        r = scorer.iteration(job, state)
    except DeviceGone:
        return 0.0
    return r.tokens / r.time_s


def candidates(ctx: Context, scorer: Simulator, state: ClusterState, seen: Iterable[Job],
               planner=None) -> list[tuple[str, Job]]:
    """The layouts the oracle may run on ``state`` (see the module's docstring), named by origin."""
    out: list[tuple[str, Job]] = [("start", ctx.start)]
    out += [("policy", j) for j in seen]
    faulty = state.speed < 1
    if faulty[list(ctx.start.devices)].any():
        try:
            _, job = reroute(ctx.start.pipelines, np.where(faulty, np.minimum(state.speed, 0.5), 1.0))
            out.append(("reroute", job))
        except RuntimeError:
            pass
    # torchft: the replica groups ranked by the scorer's time for each alone, every prefix.
    groups = [p for p in ctx.start.pipelines if (state.speed[list(p.devices)] > 0).all()]
    bad = [p for p in groups if (state.speed[list(p.devices)] < 1).any() or (state.nic[list(p.devices)] < 1).any()]
    if bad and len(bad) < len(groups):
        good = [p for p in groups if p not in bad]
        out.append(("quorum", Job(tuple(good))))
    elif len(groups) < len(ctx.start.pipelines) and groups:
        out.append(("quorum", Job(tuple(groups))))
    if planner is not None:
        nics = {int(d): float(ctx.hw.nic_bytes_per_s * state.nic[d]) for d in np.flatnonzero(state.nic < 1)}
        g = ctx.hw.gpus_per_node
        paths = {(a, b): float(ctx.hw.nic_bytes_per_s * f) for (na, nb), f in state.path.items() if f < 1
                 for a in range(na * g, (na + 1) * g) for b in range(nb * g, (nb + 1) * g)}
        try:
            best, _ = planner.best_layout(to_plan_layout(ctx.start), state.speed, nics=nics, paths=paths)
            out.append(("planner", from_plan_layout(best)))
        except PlanningError as exc:
            logger.debug("oracle: the planner has no layout: %s", exc)
    return out


def run_oracle(ctx: Context, trace: FaultTrace, *, end_s: float, measure_from_s: float = 0.0,
               runs: Sequence[RunResult] = (), scorer: Simulator | None = None, planner=None) -> OracleResult:
    """The oracle's throughput relative to the healthy start job over ``[measure_from_s, end_s)``.
    ``runs``: the cell's policy runs (their jobs are candidates); ``planner``: ResiHP's planner for
    ``ctx`` (``resihp_policy.ResiHP().planner(ctx)``), or None to leave its knobs out."""
    if not 0 <= measure_from_s < end_s:
        raise ValueError(f"run_oracle: need 0 <= measure_from_s ({measure_from_s}) < end_s ({end_s})")
    if trace.n != ctx.num_devices:
        raise ValueError(f"run_oracle: the trace covers {trace.n} devices, the context {ctx.num_devices}")
    scorer = scorer or ctx.sim
    seen: list[Job] = []
    for r in runs:
        for j in r.jobs:
            if j not in seen:
                seen.append(j)
    h = scorer.healthy(ctx.start)
    healthy = h.tokens / h.time_s
    edges = [measure_from_s] + [float(x) for x in trace.changes if measure_from_s < x < end_s] + [end_s]
    tokens, choices = 0.0, []
    for a, b in zip(edges[:-1], edges[1:]):
        state = trace.state(a)
        rates = [(_rate(scorer, j, state), name) for name, j in candidates(ctx, scorer, state, seen, planner)]
        best, origin = max(rates, key=lambda x: x[0])
        if best <= 0:
            raise RuntimeError(f"oracle: no candidate layout runs on the cluster at {a:.0f} s")
        tokens += best * (b - a)
        choices.append((a, origin))
    return OracleResult(tokens / (healthy * (end_s - measure_from_s)), tokens, tuple(choices))


__all__ = ["OracleResult", "candidates", "run_oracle"]

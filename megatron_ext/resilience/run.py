"""One policy through one fault trace, in wall-clock time.

The loop runs iterations back to back. An iteration takes the simulator's time for the job in force
on the cluster state at its start. A device of the job that dies inside an iteration loses that
iteration; the job hangs until the heartbeat timeout names it (``Costs.heartbeat_timeout_s``), then
the policy must move the job off it. After every finished iteration the detector model may name
devices or links; the policy's answer (an ``Action``) may change the job, pause it, and roll it
back to the last checkpoint. Checkpoints are taken every ``Costs.checkpoint_interval_s`` of wall
time (asynchronously: free); a rollback loses the tokens trained since the last one.

Throughput is measured from ``measure_from_s`` (the fault's onset in the single-fault scenarios)
to ``end_s``: tokens trained in that span, rollbacks subtracted, against what the healthy job
trains in the same span.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from megatron_ext.resilience.detector import DetectorModel
from megatron_ext.resilience.faults import FaultTrace
from megatron_ext.resilience.hardware import Costs, Hardware
from megatron_ext.resilience.job import Job
from megatron_ext.resilience.shapes import ModelShape
from megatron_ext.resilience.sim import Data, DeviceGone, Simulator, computing_devices

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Action:
    """A policy's answer: the job to run from now (None: the same), seconds paused, and whether
    the job restarts from the last checkpoint."""

    job: Job | None = None
    pause_s: float = 0.0
    rollback: bool = False
    note: str = ""


class _NoSimulator:
    """Stands in for the simulator in the context a policy is handed: a policy decides from the
    detector's verdicts and its own model; the simulator is the scorer's."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"a policy asked the simulator for {name!r}: policies decide from the detector's "
                           "verdicts and their own model; the simulator only scores (docs/resilience.md)")

    def __repr__(self) -> str:
        return "NO_SIMULATOR"


NO_SIMULATOR = _NoSimulator()


@dataclasses.dataclass
class Context:
    """What every policy knows about the job and the cluster (not the faults). ``sim`` is the
    nominal simulator; ``run_policy`` hands policies ``for_policy()``, where it is absent."""

    shape: ModelShape
    hw: Hardware
    costs: Costs
    data: Data
    sim: Simulator
    start: Job
    num_devices: int
    """All devices of the cluster, spares included (devices outside ``start`` are spares)."""
    detector_delay: int = 7
    detector_severe_factor: float = 2.0
    """A device more than this many times slower is named after ``detector_severe_delay`` iterations
    (ResiHP's detector, ``--resihp-severe-factor``); 0: off (every fault waits ``detector_delay``)."""
    detector_severe_delay: int = 4

    def for_policy(self) -> "Context":
        """This context without the simulator: what a policy is handed."""
        return dataclasses.replace(self, sim=NO_SIMULATOR)

    @property
    def spares(self) -> list[int]:
        used = set(self.start.devices)
        return [d for d in range(self.num_devices) if d not in used]


@dataclasses.dataclass
class RunResult:
    policy: str
    throughput_vs_healthy: float
    tokens: float
    relayouts: int
    restarts: int
    pause_s: float
    events: list[str]
    jobs: tuple = ()
    """Every job the policy ran, in order of first use (the oracle's candidates)."""


def run_policy(policy, ctx: Context, trace: FaultTrace, *, end_s: float, measure_from_s: float = 0.0,
               healthy_tokens_per_s: float | None = None,
               on_iteration: Callable[[float, float], None] | None = None,
               scorer: Simulator | None = None) -> RunResult:
    """``on_iteration(t, tokens)``: called after every iteration that finished, with its end time and
    its tokens (not for the one cut off at ``end_s``, nor for one lost to a device loss; a rollback
    takes back tokens already reported). ``scorer``: the simulator that times the iterations
    (default ``ctx.sim``; ``perturb.perturbed`` gives one whose truths the policies are not told).
    The policy is handed ``ctx.for_policy()``: the same context without any simulator."""
    if not 0 <= measure_from_s < end_s:
        raise ValueError(f"run_policy: need 0 <= measure_from_s ({measure_from_s}) < end_s ({end_s})")
    if trace.n != ctx.num_devices:
        raise ValueError(f"run_policy: the trace covers {trace.n} devices, the context {ctx.num_devices}")
    sim, costs = scorer or ctx.sim, ctx.costs
    pctx = ctx.for_policy()
    job = policy.start(pctx)
    if healthy_tokens_per_s is None:
        h = sim.healthy(ctx.start)
        healthy_tokens_per_s = h.tokens / h.time_s
    det = DetectorModel(ctx.num_devices, ctx.hw.gpus_per_node, delay=ctx.detector_delay,
                        severe_factor=ctx.detector_severe_factor or None, severe_delay=ctx.detector_severe_delay)
    t, tokens, it = 0.0, 0.0, 0
    ckpt_tokens, next_ckpt = 0.0, costs.checkpoint_interval_s
    at_measure: float | None = 0.0 if measure_from_s == 0 else None
    relayouts = restarts = 0
    paused = 0.0
    events: list[str] = []
    jobs: list[Job] = [job]
    last = None

    def apply(action, when: float) -> None:
        nonlocal job, tokens, t, relayouts, restarts, paused
        if action is None:
            return
        if action.rollback:
            tokens = min(tokens, ckpt_tokens)
            restarts += 1
        elif action.job is not None and action.job != job:
            relayouts += 1
        if action.job is not None:
            job = action.job
            if job not in jobs:
                jobs.append(job)
        t += action.pause_s
        paused += action.pause_s
        events.append(f"{when:.0f}s it{it}: {policy.name}: {action.note} (pause {action.pause_s:.0f} s"
                      f"{', rollback' if action.rollback else ''})")

    while t < end_s:
        while t >= next_ckpt:
            ckpt_tokens = tokens
            next_ckpt += costs.checkpoint_interval_s
        seg = trace.segment(t)
        state = trace.state(t)
        try:
            if last is not None and last[0] is job and last[1] == seg:
                r = last[2]
            else:
                r = sim.iteration(job, state)
                last = (job, seg, r)
        except DeviceGone:
            # The job hangs until the heartbeat timeout names the lost devices.
            if at_measure is None and t + costs.heartbeat_timeout_s >= measure_from_s:
                at_measure = tokens
            t += costs.heartbeat_timeout_s
            paused += costs.heartbeat_timeout_s
            verdicts = det.stops(it, job, trace.state(t))
            action = policy.react(pctx, t, it, verdicts, [])
            if action is None or action.job is None:
                raise RuntimeError(f"policy {policy.name} left the job on a lost device at {t:.0f} s")
            apply(action, t)
            continue
        dt = r.time_s
        used = set(computing_devices(job))
        deaths = [f for f in trace.deaths_between(t, t + dt) if _hits(f, used, ctx.hw.gpus_per_node)]
        if deaths:
            lost_until = min(f.start_s for f in deaths)
            if at_measure is None and lost_until >= measure_from_s:
                at_measure = tokens
            t = lost_until   # the iteration in flight is lost
            continue
        if at_measure is None and t + dt >= measure_from_s:
            at_measure = tokens + r.tokens * max(0.0, measure_from_s - t) / dt
        if t + dt > end_s:
            tokens += r.tokens * (end_s - t) / dt
            t = end_s
            break
        before = tokens
        t += dt
        tokens += r.tokens
        it += 1
        if on_iteration is not None:
            on_iteration(t, r.tokens)
        while t >= next_ckpt:
            # A checkpoint taken while this iteration ran holds the state from before it.
            ckpt_tokens = tokens if next_ckpt >= t else before
            next_ckpt += costs.checkpoint_interval_s
        verdicts, links = det.observe(it, job, state)
        # Every iteration, verdicts or not: a policy may keep a clock (ResiHP's recovery hysteresis).
        apply(policy.react(pctx, t, it, verdicts, links), t)
    span = end_s - measure_from_s
    done = tokens - (at_measure if at_measure is not None else tokens)
    return RunResult(policy.name, done / (healthy_tokens_per_s * span), tokens, relayouts, restarts, paused, events,
                     tuple(jobs))


def _hits(fault, used: set[int], g: int) -> bool:
    if fault.kind == "stop_device":
        return fault.target in used
    return any(d in used for d in range(fault.target * g, (fault.target + 1) * g))


__all__ = ["Action", "Context", "NO_SIMULATOR", "RunResult", "run_policy"]

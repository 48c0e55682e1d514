"""Scheduling policies behind one small interface.

A policy only orders jobs; the engine (``engine.py``) owns time, placement and preemption. Keys are
tuples, smaller runs first, ending in the job's arrival number so that ties are deterministic.

* Non-preemptive policies give each job a ``static_key`` when it is queued; the queue is served in
  that order (FIFO: submit time, SJF: oracle duration, QSSF: estimated GPU time).
* Preemptive policies give ``pend_key(js, now)`` for a waiting job and, for a running job, a
  ``run_rank`` that is fixed while it runs (recomputed at the policy's timers) together with
  ``run_key(js, now)``, comparable with ``pend_key`` and ordered like ``run_rank``. The engine keeps
  both sets sorted, so a scheduling pass looks only at the head of the queue and the tail of the
  running set: a waiting job preempts the lowest-priority running jobs whose key is strictly larger
  than its own, lowest first, until it fits (SRTF: remaining time, Tiresias: discretized attained GPU
  service, finish-time fairness: the finish-time ratio). ``lease_s`` limits preemption to periodic
  rounds; ``dynamic_pending`` says waiting jobs' keys drift with time and must be re-sorted.
"""
from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.cluster.config import ClusterSimConfig

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.cluster.state import JobState
    from megatron_ext.cluster.trace import Job

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type["Policy"]] = {}


def register(name: str):
    def deco(cls: type["Policy"]) -> type["Policy"]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def make_policy(name: str, cfg: ClusterSimConfig, jobs: "list[Job]") -> "Policy":
    """A fresh policy for one VC's simulation (``jobs``: that VC's jobs in arrival order)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return cls(cfg, jobs)


class Policy:
    name = ""
    preemptive = False
    dynamic_pending = False       # waiting jobs' keys change with time (re-sort before each pass)
    lease_s: float | None = None  # preemptive policies: preempt only at rounds this far apart

    def __init__(self, cfg: ClusterSimConfig, jobs: "list[Job]"):
        self.cfg = cfg

    # non-preemptive
    def static_key(self, js: "JobState") -> float:
        raise NotImplementedError

    # preemptive
    def pend_key(self, js: "JobState", now: float) -> tuple:
        raise NotImplementedError

    def run_rank(self, js: "JobState", now: float) -> tuple:
        raise NotImplementedError

    def run_key(self, js: "JobState", now: float) -> tuple:
        return js.rank

    def promote(self, pending: list[tuple], now: float) -> "list[JobState]":
        """Waiting jobs (``pending``: the engine's sorted (key, job) entries) whose key just changed,
        e.g. by starvation promotion; the engine re-queues them."""
        return []

    def next_change(self, js: "JobState", now: float) -> float | None:
        """For a running job: when its rank next changes (a Tiresias queue demotion), or None."""
        return None

    def on_finish(self, js: "JobState") -> None:
        """A job completed (history-based estimators learn here)."""


@register("fifo")
class FIFO(Policy):
    def static_key(self, js):
        return js.submit


@register("sjf")
class SJF(Policy):
    """Shortest job first with oracle durations (the trace's run time), non-preemptive."""

    def static_key(self, js):
        return js.job.duration


@register("srtf")
class SRTF(Policy):
    """Shortest remaining time first with oracle durations; preemptive. A waiting job's key is its
    remaining work, a running job's the time until it finishes at its current speed."""

    preemptive = True

    def pend_key(self, js, now):
        return (js.rem, js.seq)

    def run_rank(self, js, now):
        return (js.t_upd + js.rem / js.rate, js.seq)  # finish time: fixed while it runs

    def run_key(self, js, now):
        return (js.rank[0] - now, js.seq)


@register("tiresias")
class Tiresias(Policy):
    """Discretized two-dimensional least-attained-service (Tiresias' 2D-LAS).

    Attained service is GPUs x executed seconds; K queues split by ``las_thresholds_gpu_s``
    (Tiresias' simulator: 2 queues, 3250 GPU-s). Lower queues run first; within a queue, arrival
    order. A running job is demoted when it crosses a threshold (a timer), so it can then be
    preempted. With ``las_promote_knob`` > 0 a job that has waited more than knob x its executed
    time returns to the top queue (Tiresias' starvation guard).
    """

    preemptive = True

    def __init__(self, cfg, jobs):
        super().__init__(cfg, jobs)
        self.thresholds = list(cfg.las_thresholds_gpu_s)
        self.knob = cfg.las_promote_knob

    def queue_of(self, attained: float) -> int:
        # the margin puts a job whose timer fires exactly at a threshold into the next queue
        return bisect.bisect_right(self.thresholds, attained + 1e-6)

    def pend_key(self, js, now):
        return (self.queue_of(js.attained), js.submit, js.seq)

    def run_rank(self, js, now):
        return (self.queue_of(js.attained_at(now)), js.submit, js.seq)

    def promote(self, pending, now):
        if self.knob <= 0:
            return []
        out = []
        for _, js in pending:
            if js.state == 0 and js.attained > 0 and js.run_s > 0 and now - js.t_wait >= self.knob * js.run_s:
                js.attained = 0.0
                js.run_s = 0.0
                out.append(js)
        return out

    def next_change(self, js, now):
        attained = js.attained_at(now)
        i = self.queue_of(attained)
        if i >= len(self.thresholds):
            return None
        gpus = js.gpus if js.alloc else 1  # a bubble guest holds one GPU slot
        return now + max(0.0, self.thresholds[i] - attained) / gpus


@register("ftf")
class FinishTimeFairness(Policy):
    """Finish-time fairness (Themis' rho): rho = (time in system + remaining time) / exclusive run
    time. The job treated most unfairly (largest rho) runs first. As in Themis' lease rounds,
    priorities are re-ranked and preemption happens only every ``ftf_lease_s``; between rounds
    freed GPUs go to waiting jobs in the last round's order. A waiting job's rho grows with time; a
    running job's is fixed (its finish time is)."""

    preemptive = True
    dynamic_pending = True

    def __init__(self, cfg, jobs):
        super().__init__(cfg, jobs)
        self.lease_s = cfg.ftf_lease_s

    def pend_key(self, js, now):
        return (-(now - js.submit + js.rem) / js.job.duration, js.seq)

    def run_rank(self, js, now):
        return (-(js.t_upd + js.rem / js.rate - js.submit) / js.job.duration, js.seq)


def noisy_estimates(durations: np.ndarray, seed: int) -> np.ndarray:
    """Helios' synthetic Philly estimator: relative error |e| within 10% for 10% of jobs, 10-50% for
    40%, 50-100% for 20%, 1-10x for 20% and 10-100x for 10%, random sign (symmetric band for the
    first). Returns ``int(d + d * e)``, which can be negative, as in the artifact."""
    rng = np.random.default_rng(seed)
    n = len(durations)
    level = rng.random(n)
    u = rng.random(n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    lo = np.select([level <= 0.1, level <= 0.5, level <= 0.7, level <= 0.9], [-1.0, 0.1, 0.5, 1.0], 10.0)
    hi = np.select([level <= 0.1, level <= 0.5, level <= 0.7, level <= 0.9], [1.0, 0.5, 1.0, 10.0], 100.0)
    mag = lo + (hi - lo) * u
    err = np.where(level <= 0.1, mag * 0.1, mag * sign)
    return np.trunc(durations + durations * err)


@register("qssf")
class QSSF(Policy):
    """Quasi-shortest-service-first (Helios): queue by estimated GPU time = estimated duration x GPUs,
    non-preemptive.

    ``history``: the estimate is the mean duration of the user's finished jobs with the same GPU
    count, else of all the user's finished jobs, else of the VC's finished jobs with that GPU count,
    else of all the VC's finished jobs, else one hour. A trace without users (Philly) falls straight
    to the VC level. ``noisy_oracle``: Helios' error distribution around the true duration.
    """

    PRIOR_S = 3600.0

    def __init__(self, cfg, jobs):
        super().__init__(cfg, jobs)
        self.mode = cfg.qssf_estimator
        self.sums: dict[tuple, list[float]] = {}
        self.noisy: dict[int, float] = {}
        if self.mode == "noisy_oracle" and jobs:
            est = noisy_estimates(np.array([j.duration for j in jobs], dtype=float), cfg.estimator_seed)
            # A negative or zero estimate would jump the queue forever; clamp outside Helios mode.
            self.noisy = {id(j): max(1.0, float(e)) for j, e in zip(jobs, est)}

    def _mean(self, key: tuple) -> float | None:
        s = self.sums.get(key)
        return s[0] / s[1] if s else None

    def estimate(self, js) -> float:
        job = js.job
        if self.mode == "noisy_oracle":
            return self.noisy[id(job)]
        for key in (("u", job.user, job.gpus), ("u", job.user), ("vc", job.gpus), ("vc",)):
            if key[0] == "u" and job.user is None:
                continue
            mean = self._mean(key)
            if mean is not None:
                return mean
        return self.PRIOR_S

    def static_key(self, js):
        if js.est is None:
            js.est = self.estimate(js)
        return js.est * js.gpus

    def on_finish(self, js):
        if self.mode != "history":
            return
        job = js.job
        keys = [("vc", job.gpus), ("vc",)]
        if job.user is not None:
            keys += [("u", job.user, job.gpus), ("u", job.user)]
        for key in keys:
            s = self.sums.setdefault(key, [0.0, 0])
            s[0] += job.duration
            s[1] += 1


def policy_names() -> list[str]:
    return sorted(_REGISTRY)

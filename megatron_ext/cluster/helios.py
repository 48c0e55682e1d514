"""Helios-compatible simulation (``--helios-compat``): the semantics of the QSSF-service simulator
of the Helios artifact (S-Lab-System-Group/HeliosArtifact, SC'21), event-driven.

That simulator advances a clock one second at a time, per VC. Each tick it (1) ends jobs, (2) queues
the jobs submitted at that second, (3) orders the queue and starts jobs with its consolidate placer.
Nothing changes between arrivals and completions, so jumping from event to event reproduces it
exactly; what must be copied are its rules and tie-breaks:

* times are integer seconds: submit offsets are floored, run times rounded up to >= 1 s (a
  zero-length job would never end there);
* FIFO and SJF walk the queue in order (submit time / duration; ties in queueing order) and stop at
  the first job the placer rejects — no backfill. A job started at ``t`` ends at ``t + duration``;
* QSSF orders by priority = estimated duration x GPUs (the artifact's Philly estimator: Helios'
  error distribution around the true duration, ``noisy_estimates``; negative values kept), ties by
  GPUs then queueing order — except at a tick where every queued job is new, when it orders by GPUs
  only, as the artifact does;
* SRTF re-selects at every arrival and completion: all queued and running jobs sorted by remaining
  time (stable: queued jobs before running ones, each in list order), then greedily kept while they
  fit the VC's GPU count; running jobs left out are preempted, paying a checkpoint of 7 / 30 / 60 s
  (1 / up to 8 / more GPUs) as extra remaining time. Its clock decrements a job's remaining time
  from the tick after it starts and ends the job on the tick after that reaches zero, so a job of
  ``d`` seconds that is never preempted ends ``d + 1`` seconds after it starts.

Queueing delay is the time from submit to first start plus, for a preempted job, the time from each
checkpoint to the restart — the artifact's ``queue`` column.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math

import numpy as np

from megatron_ext.cluster.cluster import NodePool
from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.state import DONE, PENDING, RUNNING, JobState, VCRun, _insort, _remove
from megatron_ext.cluster.policies import noisy_estimates
from megatron_ext.cluster.trace import Job, VCSpec

logger = logging.getLogger(__name__)

_CKPT_S = (7, 30, 60)


def helios_ckpt_s(gpus: int) -> int:
    if gpus == 1:
        return _CKPT_S[0]
    if gpus <= 8:
        return _CKPT_S[1]
    return _CKPT_S[2]


class HeliosVCSimulator:
    def __init__(self, spec: VCSpec, jobs: list[Job], cfg: ClusterSimConfig, record: bool = False):
        if cfg.policy not in ("fifo", "sjf", "srtf", "qssf"):
            raise ValueError(f"the Helios simulator has no policy {cfg.policy!r}")
        self.spec = spec
        self.cfg = cfg
        self.pool = NodePool(spec.nodes, spec.gpus_per_node)
        self.states = [JobState(job, i) for i, job in enumerate(jobs)]
        for js in self.states:
            js.submit = math.floor(js.job.submit + 1e-9)
            js.rem = max(1, math.ceil(js.job.duration - 1e-9))
        self.busy_gpu_s = 0.0
        self.events = 0
        self.record = record
        self.segments: list[tuple] = []

    def run(self) -> VCRun:
        if self.cfg.policy == "srtf":
            self._run_srtf()
        else:
            self._run_queue()
        return VCRun(self.spec, self.states, self.busy_gpu_s, 0.0, self.events, self.segments)

    def _place(self, js: JobState, now: int) -> bool:
        alloc = self.pool.place_consolidate(js.gpus)
        if alloc is None:
            return False
        self.pool.take(alloc)
        js.alloc = alloc
        js.state = RUNNING
        js.t_upd = now
        return True

    def _release(self, js: JobState, now: int) -> None:
        self.pool.release(js.alloc)
        self.busy_gpu_s += (now - js.t_upd) * js.gpus
        if self.record:
            self.segments.append((js.job.job_id, js.t_upd, now, js.alloc, None, 1.0))
        js.alloc = None

    # -- FIFO / SJF / QSSF ---------------------------------------------------------------------
    def _run_queue(self) -> None:
        policy = self.cfg.policy
        arrivals = self.states
        prio = None
        if policy == "qssf":
            est = noisy_estimates(np.array([js.rem for js in arrivals], dtype=float), self.cfg.estimator_seed)
            prio = [int(e) * js.gpus for e, js in zip(est, arrivals)]
        n, i = len(arrivals), 0
        heap: list[tuple[int, int, JobState]] = []
        que: list[tuple] = []  # sorted queue entries (key..., seq, js)
        while i < n or heap:
            now = arrivals[i].submit if i < n else None
            if heap and (now is None or heap[0][0] <= now):
                now = heap[0][0]
            while heap and heap[0][0] == now:
                _, _, js = heapq.heappop(heap)
                self.events += 1
                self._release(js, now)
                js.state = DONE
                js.end = now
            new = []
            while i < n and arrivals[i].submit == now:
                new.append(arrivals[i])
                i += 1
                self.events += 1
            if policy == "qssf" and not que:
                # every queued job is new: the artifact orders them by GPU count only
                order = sorted(new, key=lambda js: (js.gpus, js.seq))
                started = self._start_in_order(order, now, heap)
                for js in order[started:]:
                    bisect.insort(que, (prio[js.seq], js.gpus, js.seq, js))
                continue
            for js in new:
                if policy == "fifo":
                    item = (js.submit, js.seq, js)
                elif policy == "sjf":
                    item = (js.rem, js.seq, js)
                else:
                    item = (prio[js.seq], js.gpus, js.seq, js)
                if not que or que[-1] < item:
                    que.append(item)
                else:
                    bisect.insort(que, item)
            started = self._start_in_order(_Heads(que), now, heap)
            if started:
                del que[:started]

    def _start_in_order(self, order, now: int, heap: list) -> int:
        """Start jobs in order until the placer rejects one; returns how many started."""
        started = 0
        for js in order:
            if not self._place(js, now):
                break
            js.start = now
            js.wait_s = now - js.submit
            js.end = now + js.rem
            heapq.heappush(heap, (js.end, js.seq, js))
            started += 1
        return started

    # -- SRTF ----------------------------------------------------------------------------------
    def _run_srtf(self) -> None:
        """The artifact keeps que_list and run_list in insertion order and stable-sorts their
        concatenation by remaining time every tick. Equivalently: queued jobs sorted by (remaining,
        queue position), running jobs by (remaining at now, run position) -- a running job's
        remaining time at ``now`` is (start tick + remaining at start) - now, so its order is fixed
        while it runs -- merged with queued jobs first on ties. Both lists are kept sorted and
        merged once per event."""
        arrivals = self.states
        n, i = len(arrivals), 0
        pool = self.pool
        heap: list[tuple[int, int, JobState, int]] = []
        que: list[tuple] = []          # ((remaining, queue position), js)
        run: list[tuple] = []          # ((start tick + remaining at start, run position), js)
        qseq = itertools.count()
        rseq = itertools.count()
        ckpt_at: dict[int, int] = {}
        demand = 0                     # GPUs of queued + running jobs

        def enqueue(js: JobState) -> None:
            js.key = (js.rem, next(qseq))
            _insort(que, (js.key, js))

        while i < n or heap:
            now = arrivals[i].submit if i < n else None
            if heap and (now is None or heap[0][0] <= now):
                now = heap[0][0]
            while heap and heap[0][0] == now:
                _, _, js, ver = heapq.heappop(heap)
                self.events += 1
                if ver != js.ver:
                    continue
                self._release(js, now)
                js.state = DONE
                js.end = now
                _remove(run, js.rank, js)
                demand -= js.gpus
            while i < n and arrivals[i].submit == now:
                js = arrivals[i]
                i += 1
                self.events += 1
                enqueue(js)
                demand += js.gpus
            if not que:
                continue
            preempt: list[JobState] = []
            if demand <= pool.capacity:  # every job fits the quota: no preemption
                prerun = [js for _, js in que]
            else:
                prerun = []
                quota = pool.capacity
                qi = ri = 0
                nq, nr = len(que), len(run)
                while qi < nq or ri < nr:
                    if ri >= nr or (qi < nq and que[qi][0][0] <= run[ri][0][0] - now):
                        js = que[qi][1]
                        qi += 1
                        if js.gpus <= quota:
                            quota -= js.gpus
                            prerun.append(js)
                        elif quota == 0:
                            qi = nq  # no later queued job can fit either
                    else:
                        js = run[ri][1]
                        ri += 1
                        if js.gpus <= quota:
                            quota -= js.gpus
                        else:
                            preempt.append(js)
            for js in preempt:
                js.preemptions += 1
                ckpt_at[id(js)] = now
                js.rem = js.rem - (now - js.t_upd) + helios_ckpt_s(js.gpus)
                self._release(js, now)
                _remove(run, js.rank, js)
                js.state = PENDING
                js.ver += 1
                enqueue(js)
            for js in prerun:
                if not self._place(js, now):
                    continue  # the artifact keeps trying the rest (consolidation may fail)
                if js.preemptions == 0:
                    js.start = now
                    js.wait_s = now - js.submit
                else:
                    js.wait_s += now - ckpt_at[id(js)]
                js.ver += 1
                _remove(que, js.key, js)
                js.rank = (now + js.rem, next(rseq))
                _insort(run, (js.rank, js))
                heapq.heappush(heap, (now + js.rem + 1, js.seq, js, js.ver))


class _Heads:
    """Iterate the jobs of sorted queue entries without copying the queue."""

    __slots__ = ("que",)

    def __init__(self, que: list[tuple]):
        self.que = que

    def __iter__(self):
        for entry in self.que:
            yield entry[-1]

"""Discrete-event core: one virtual cluster (VC), its jobs, one policy.

VCs are independent clusters (as in Helios and Philly's quota VCs), so :func:`simulate` runs one
event loop per VC and merges the results. Within a VC:

* Events are arrivals (read in order from the sorted trace, never pushed on the heap), completions,
  policy timers (Tiresias demotions) and lease rounds (finish-time fairness), on one ``heapq``. All
  events at the same instant are applied first (completions, then arrivals) and the scheduler runs
  once for the instant.
* A job holds ``rem``: seconds of exclusive work left at time ``t_upd``; it progresses at ``rate``
  (1, ``1/spread_slowdown`` when spread over more nodes than needed, or the bubble speed as a guest).
  A completion event carries the job's version number, so a preemption invalidates it lazily.
* Preemptive policies: a waiting job preempts the lowest-priority running jobs that rank strictly
  below it, lowest first, until it fits; if placement still fails, nothing changes. Preemption
  charges the restart cost as extra work, and a job that has paid one is protected until it has
  earned it back (a wake-up event re-runs the scheduler then), which rules out livelock.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass

from megatron_ext.cluster.bubbles import BubblePool
from megatron_ext.cluster.cluster import NodePool
from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.policies import Policy, make_policy
from megatron_ext.cluster.state import (_FINISH, _INF, _LEASE, _TIMER, _WAKE, DONE, GUEST, PENDING,
                                        RUNNING, JobState, VCRun, _insort, _remove)
from megatron_ext.cluster.trace import Job, Trace, VCSpec, jobs_by_vc

logger = logging.getLogger(__name__)

class VCSimulator:
    """Event loop of one VC. ``record=True`` keeps every run segment for invariant checks:
    ``(job_id, t0, t1, alloc or None, slot or None, rate)``."""

    def __init__(self, spec: VCSpec, jobs: list[Job], cfg: ClusterSimConfig, *, policy: Policy | None = None,
                 use_bubbles: bool = True, record: bool = False):
        self.spec = spec
        self.cfg = cfg
        self.pool = NodePool(spec.nodes, spec.gpus_per_node)
        self.policy = policy or make_policy(cfg.policy, cfg, jobs)
        self.preemptive = self.policy.preemptive
        self.states = [JobState(job, i) for i, job in enumerate(jobs)]
        self.pending: list[tuple] = []   # sorted (key, js): waiting jobs and bubble guests
        self.running: list[tuple] = []   # sorted (rank, js) of exclusive jobs (preemptive policies)
        self.run_set: set[JobState] = set()
        self.heap: list[tuple] = []
        self.tick = itertools.count()
        self.busy_gpu_s = 0.0
        self.bubble_gpu_s = 0.0
        self.events = 0
        self.lease_armed = False
        self.wake_at = -_INF
        self.now = 0.0
        self.record = record
        self.segments: list[tuple] = []
        kinds = {j.kind for j in jobs}
        self.bubbles = (BubblePool(cfg.bubble_speed, cfg.gpu_mem_gb, cfg.work_per_bubble_s)
                        if use_bubbles and "pipeline" in kinds and "hpo" in kinds else None)

    # -- queues --------------------------------------------------------------------------------
    def _enqueue(self, js: JobState, now: float) -> None:
        pol = self.policy
        js.key = pol.pend_key(js, now) if self.preemptive else (pol.static_key(js), js.seq)
        _insort(self.pending, (js.key, js))

    def _dequeue(self, js: JobState) -> None:
        _remove(self.pending, js.key, js)

    # -- job transitions -----------------------------------------------------------------------
    def _close_segment(self, js: JobState, now: float) -> None:
        dt = now - js.t_upd
        js.rem -= dt * js.rate
        js.run_s += dt
        if js.state == RUNNING:
            js.attained += dt * js.gpus
            self.busy_gpu_s += (now - js.seg_start) * js.gpus
        else:
            js.attained += dt
            js.bubble_s += now - js.seg_start
            self.bubble_gpu_s += now - js.seg_start
        if self.record:
            self.segments.append((js.job.job_id, js.seg_start, now, js.alloc, js.slot, js.rate))
        js.t_upd = now
        js.ver += 1

    def _begin(self, js: JobState, now: float, rate: float) -> None:
        if js.state == PENDING:
            js.wait_s += now - js.t_wait
        if js.start < 0:
            js.start = now
        js.rate = rate
        js.t_upd = now
        js.seg_start = now
        js.ver += 1
        heapq.heappush(self.heap, (now + js.rem / rate, next(self.tick), _FINISH, js, js.ver))
        change = self.policy.next_change(js, now)
        if change is not None:
            heapq.heappush(self.heap, (change, next(self.tick), _TIMER, js, js.ver))

    def _start_exclusive(self, js: JobState, alloc: list[tuple[int, int]], now: float) -> None:
        """Start ``js`` (already out of the pending queue) on ``alloc``."""
        self.pool.take(alloc)
        if js.state == GUEST:  # migrate from a bubble: checkpoint, restore on the new GPUs
            self._close_segment(js, now)
            self.bubbles.release(js.slot)
            js.slot = None
            self._charge_restart(js)
        js.alloc = alloc
        slow = self.cfg.spread_slowdown if len(alloc) > self.pool.min_nodes(js.gpus) else 1.0
        self._begin(js, now, 1.0 / slow)
        js.state = RUNNING
        self.run_set.add(js)
        if self.preemptive:
            # A restarted job must first earn back its restart cost: preempting it sooner can
            # livelock (e.g. Tiresias with a threshold crossed faster than the restart cost).
            if js.restart_s > 0:
                js.protect_until = now + self.cfg.restart_cost(js.gpus, self.pool.gpus_per_node) / js.rate + 1.0
            js.rank = self.policy.run_rank(js, now)
            _insort(self.running, (js.rank, js))
        if self.bubbles is not None and js.job.kind == "pipeline":
            self.bubbles.add_host(js)

    def _charge_restart(self, js: JobState) -> None:
        cost = self.cfg.restart_cost(js.gpus, self.pool.gpus_per_node)
        js.rem += cost
        js.restart_s += cost

    def _start_guest(self, js: JobState, now: float) -> bool:
        slot = self.bubbles.acquire(js, js.job.mem_gb)
        if slot is None:
            return False
        js.slot = slot
        self._begin(js, now, slot.speed)
        js.state = GUEST  # stays in the pending queue: it still wants exclusive GPUs
        return True

    def _guest_eligible(self, js: JobState) -> bool:
        return self.bubbles is not None and js.job.kind == "hpo" and js.gpus == 1

    def _worth_migrating(self, js: JobState, now: float) -> bool:
        left = js.remaining(now)
        return left / js.rate > left + self.cfg.restart_cost(js.gpus, self.pool.gpus_per_node)

    def _displace_guests(self, host: JobState, now: float) -> None:
        for guest in self.bubbles.remove_host(host):
            self._close_segment(guest, now)
            guest.slot = None
            guest.state = PENDING  # it never left the pending queue
            guest.t_wait = now
            guest.preemptions += 1
            self._charge_restart(guest)
            if self.preemptive:  # its key may depend on the work it has left
                self._dequeue(guest)
                self._enqueue(guest, now)

    def _stop_exclusive(self, js: JobState, now: float, released: bool) -> None:
        self._close_segment(js, now)
        if not released:
            self.pool.release(js.alloc)
        js.alloc = None
        self.run_set.discard(js)
        if self.preemptive:
            _remove(self.running, js.rank, js)
        if self.bubbles is not None and js.job.kind == "pipeline":
            self._displace_guests(js, now)

    def _finish(self, js: JobState, now: float) -> None:
        if js.state == RUNNING:
            self._stop_exclusive(js, now, released=False)
        else:  # a guest finishing on its bubble
            self._close_segment(js, now)
            self.bubbles.release(js.slot)
            js.slot = None
            self._dequeue(js)
        js.rem = 0.0
        js.state = DONE
        js.end = now
        self.policy.on_finish(js)

    def _preempt(self, js: JobState, now: float, released: bool) -> None:
        self._stop_exclusive(js, now, released)
        js.state = PENDING
        js.t_wait = now
        js.hold = now
        js.preemptions += 1
        self._charge_restart(js)
        self._enqueue(js, now)

    def _retime(self, js: JobState, now: float) -> None:
        """A Tiresias demotion: move the job in the running order, arm its next timer."""
        _remove(self.running, js.rank, js)
        js.rank = self.policy.run_rank(js, now)
        _insort(self.running, (js.rank, js))
        nxt = self.policy.next_change(js, now)
        if nxt is not None:
            heapq.heappush(self.heap, (nxt, next(self.tick), _TIMER, js, js.ver))

    # -- scheduling ----------------------------------------------------------------------------
    def _try_place(self, js: JobState, now: float) -> bool:
        """Exclusive GPUs if the placement rule finds them, else a bubble slot for a trial.
        Returns True if the job runs (exclusively or as a guest); the caller dequeues a job that
        now runs exclusively."""
        if js.gpus <= self.pool.free_total and (js.state != GUEST or self._worth_migrating(js, now)):
            alloc = self.pool.place(js.gpus, self.cfg.placement)
            if alloc is not None:
                self._start_exclusive(js, alloc, now)
                return True
        if js.state == GUEST:
            return True
        if self._guest_eligible(js) and self.bubbles.has_room():
            return self._start_guest(js, now)
        return False

    def _no_room(self) -> bool:
        return self.pool.free_total == 0 and (self.bubbles is None or not self.bubbles.has_room())

    def _schedule_queue(self, now: float) -> None:
        """Non-preemptive: serve the queue in key order; 'none' stops at the first job that cannot
        run, 'greedy' tries every job, 'easy' lets later jobs run only if they do not delay the
        blocked head's reservation."""
        q = self.pending
        mode = self.cfg.backfill
        pool = self.pool
        started: list[int] = []
        shadow, extra = None, 0
        for idx, (_, js) in enumerate(q):
            if self._no_room():
                break
            if shadow is not None:  # EASY: only jobs that do not delay the head may start
                ends_by_shadow = now + js.remaining(now) <= shadow
                if ends_by_shadow or js.gpus <= extra:
                    if self._try_place(js, now) and js.state == RUNNING:
                        started.append(idx)
                        if not ends_by_shadow:
                            extra -= js.gpus
                elif js.state == PENDING and self._guest_eligible(js) and self.bubbles.has_room():
                    self._start_guest(js, now)  # bubbles do not touch the head's reservation
                continue
            if self._try_place(js, now):
                if js.state == RUNNING:
                    started.append(idx)
                continue
            if mode == "none":
                break
            if mode == "easy":
                shadow, extra = self._reservation(js, now)
        if started:
            if started[-1] == len(started) - 1:
                del q[:len(started)]
            else:
                drop = set(started)
                q[:] = [e for i, e in enumerate(q) if i not in drop]

    def _reservation(self, head: JobState, now: float) -> tuple[float, int]:
        """EASY backfilling: when the blocked head can start (counting GPUs only, with oracle
        remaining times) and how many GPUs are spare at that moment."""
        free = self.pool.free_total
        ends = sorted((js.t_upd + js.rem / js.rate, js.gpus) for js in self.run_set)
        for t_end, gpus in ends:
            free += gpus
            if free >= head.gpus:
                return t_end, free - head.gpus
        return _INF, 0

    def _victims(self, js: JobState, now: float) -> list[JobState] | None:
        """Lowest-priority running jobs, each strictly below ``js``, whose GPUs let it fit."""
        need = js.gpus - self.pool.free_total
        victims, got = [], 0
        run_key = self.policy.run_key
        wake = _INF
        for _, r in reversed(self.running):
            if run_key(r, now) <= js.key:
                break
            if r.seg_start == now:
                continue  # started in this very pass: keys of waiting and running jobs may disagree
            if now < r.protect_until:  # (e.g. a spread job runs slower than its key assumed)
                wake = min(wake, r.protect_until)
                continue
            victims.append(r)
            got += r.gpus
            if got >= need:
                return victims
        if wake < _INF:
            self._wake(wake)
        return None

    def _wake(self, t: float) -> None:
        """Re-run the scheduler at ``t`` (when a protected victim becomes preemptible)."""
        if t < self.wake_at or self.wake_at <= self.now:
            self.wake_at = t
            heapq.heappush(self.heap, (t, next(self.tick), _WAKE, None, 0))

    def _schedule_preemptive(self, now: float, allow_preempt: bool) -> None:
        pol = self.policy
        pool = self.pool
        if pol.dynamic_pending and allow_preempt:
            # Waiting keys drift with time: re-rank them at each preemption round only; between
            # rounds freed GPUs go by the last round's order (new arrivals by their key at arrival).
            for _, js in self.pending:
                js.key = pol.pend_key(js, now)
            self.pending[:] = sorted((js.key, js) for _, js in self.pending)
        for js in pol.promote(self.pending, now):
            self._dequeue(js)
            self._enqueue(js, now)
        q = self.pending
        running = self.running
        # A later (lower-priority) job can only preempt a subset of what an earlier one could, so
        # once a job of g GPUs fails to preempt its way in, no later job of >= g GPUs will either.
        stuck = _INF
        i = 0
        while i < len(q):
            key, js = q[i]
            if self._try_place(js, now):
                if js.state == RUNNING:
                    del q[i]
                    continue
                i += 1  # a guest
                continue
            if allow_preempt and js.state == PENDING and js.hold != now and js.gpus < stuck:
                victims = self._victims(js, now)
                if not victims:
                    stuck = js.gpus
                else:
                    for v in victims:  # tentatively free their GPUs
                        pool.release(v.alloc)
                    alloc = pool.place(js.gpus, self.cfg.placement)
                    if alloc is None:  # consolidation still fails: leave everything as it was
                        for v in victims:
                            pool.take(v.alloc)
                        stuck = js.gpus
                    else:
                        del q[i]
                        for v in victims:
                            self._preempt(v, now, released=True)
                        self._start_exclusive(js, alloc, now)
                        i = 0  # victims may have been queued ahead of i
                        continue
            if self._no_room() and (not allow_preempt or not running
                                    or pol.run_key(running[-1][1], now) <= key):
                break  # nothing later can start, nor preempt anyone
            i += 1

    def _schedule(self, now: float, lease_round: bool) -> None:
        if not self.pending:
            return
        if self.preemptive:
            allow = self.policy.lease_s is None or lease_round
            self._schedule_preemptive(now, allow)
            if self.policy.lease_s is not None and self.pending and not self.lease_armed:
                self.lease_armed = True
                heapq.heappush(self.heap, (now + self.policy.lease_s, next(self.tick), _LEASE, None, 0))
        else:
            self._schedule_queue(now)

    # -- main loop -----------------------------------------------------------------------------
    def run(self) -> VCRun:
        arrivals = self.states
        n, i = len(arrivals), 0
        heap = self.heap
        pop = heapq.heappop
        while True:
            t_arr = arrivals[i].submit if i < n else _INF
            if heap and heap[0][0] <= t_arr:
                now = heap[0][0]
            elif i < n:
                now = t_arr
            else:
                break
            self.now = now
            changed = lease = False
            while heap and heap[0][0] <= now:
                _, _, kind, js, ver = pop(heap)
                self.events += 1
                if kind == _LEASE:
                    self.lease_armed = False
                    lease = changed = True
                elif kind == _WAKE:
                    changed = True
                elif ver == js.ver:
                    if kind == _FINISH:
                        self._finish(js, now)
                    elif js.state == RUNNING:
                        self._retime(js, now)
                    else:  # a guest's demotion only changes its key in the queue
                        self._dequeue(js)
                        self._enqueue(js, now)
                        nxt = self.policy.next_change(js, now)
                        if nxt is not None:
                            heapq.heappush(heap, (nxt, next(self.tick), _TIMER, js, js.ver))
                    changed = True
            while i < n and arrivals[i].submit <= now:
                js = arrivals[i]
                i += 1
                self.events += 1
                self._enqueue(js, now)
                changed = True
            if changed:
                self._schedule(now, lease)
        unfinished = [js for js in self.states if js.state != DONE]
        if unfinished:  # a job that can never be placed would be a bug in the placement rules
            raise RuntimeError(f"VC {self.spec.name}: {len(unfinished)} jobs never finished, e.g. {unfinished[0]}")
        return VCRun(self.spec, self.states, self.busy_gpu_s, self.bubble_gpu_s, self.events, self.segments)


@dataclass
class SimRun:
    """All VCs of one simulation."""

    policy: str
    load_scale: float
    helios_compat: bool
    vcs: list[VCRun]
    dropped: dict[str, int]
    rejected: int
    wall_s: float

    @property
    def events(self) -> int:
        return sum(v.events for v in self.vcs)


def simulate(trace: Trace, cfg: ClusterSimConfig, *, use_bubbles: bool = True, record: bool = False) -> SimRun:
    """Run ``cfg.policy`` over every VC of ``trace`` (``cfg.helios_compat`` selects the Helios
    semantics of ``helios.py``)."""
    t0 = time.perf_counter()
    runs = []
    for name, jobs in sorted(jobs_by_vc(trace.jobs).items()):
        spec = trace.vcs[name]
        if cfg.helios_compat:
            from megatron_ext.cluster.helios import HeliosVCSimulator
            sim = HeliosVCSimulator(spec, jobs, cfg, record=record)
        else:
            sim = VCSimulator(spec, jobs, cfg, use_bubbles=use_bubbles, record=record)
        runs.append(sim.run())
    wall = time.perf_counter() - t0
    return SimRun(cfg.policy, trace.load_scale, cfg.helios_compat, runs, dict(trace.dropped),
                  len(trace.rejected), wall)

"""Per-run job state of the cluster simulator (a job, and a bubble slot a guest job may hold) and
the sorted-list helpers its queues use.

Its own module so that the engine, the bubble model and the Helios-compatible simulator import it
without importing each other.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from megatron_ext.cluster.trace import Job, VCSpec

PENDING, RUNNING, GUEST, DONE = 0, 1, 2, 3
_FINISH, _TIMER, _LEASE, _WAKE = 0, 1, 2, 3
_INF = math.inf


class JobState:
    """Mutable simulation state of one job in one run."""

    __slots__ = ("job", "seq", "submit", "gpus", "rem", "rate", "t_upd", "seg_start", "start", "end",
                 "wait_s", "t_wait", "preemptions", "attained", "run_s", "alloc", "slot", "state", "ver",
                 "est", "bubble_s", "key", "rank", "hold", "restart_s", "protect_until")

    def __init__(self, job: Job, seq: int):
        self.job = job
        self.seq = seq
        self.submit = job.submit
        self.gpus = job.gpus
        self.rem = job.duration   # exclusive seconds of work left at t_upd
        self.rate = 0.0
        self.t_upd = job.submit
        self.seg_start = 0.0
        self.start = -1.0
        self.end = -1.0
        self.wait_s = 0.0
        self.t_wait = job.submit
        self.preemptions = 0
        self.attained = 0.0       # GPU-seconds of service (Tiresias)
        self.run_s = 0.0          # wall seconds of service
        self.alloc: list[tuple[int, int]] | None = None
        self.slot: "BubbleSlot | None" = None
        self.state = PENDING
        self.ver = 0
        self.est: float | None = None
        self.bubble_s = 0.0       # seconds run as a bubble guest
        self.key: tuple = ()      # its key in the pending queue
        self.rank: tuple = ()     # its rank among running jobs (preemptive policies)
        self.hold = -1.0          # preempted at this instant: may not preempt others in the same pass
        self.restart_s = 0.0      # restart work charged so far (preemptions, displacements, migrations)
        self.protect_until = -1.0 # a restarted job is not preempted before this (see _start_exclusive)

    def remaining(self, now: float) -> float:
        if self.state == RUNNING or self.state == GUEST:
            return self.rem - (now - self.t_upd) * self.rate
        return self.rem

    def attained_at(self, now: float) -> float:
        if self.state == RUNNING:
            return self.attained + (now - self.t_upd) * self.gpus
        if self.state == GUEST:
            return self.attained + (now - self.t_upd)
        return self.attained

    def __repr__(self) -> str:
        return f"JobState({self.job.job_id!r}, state={self.state}, rem={self.rem:.1f})"


@dataclass
class VCRun:
    spec: VCSpec
    states: list[JobState]
    busy_gpu_s: float
    bubble_gpu_s: float
    events: int
    segments: list[tuple] = field(default_factory=list)


def _insort(entries: list, item: tuple) -> None:
    # keys end in the job's unique seq, so comparisons never reach the JobState
    if not entries or entries[-1] < item:
        entries.append(item)
    else:
        bisect.insort(entries, item)


def _remove(entries: list, key: tuple, js: "JobState") -> None:
    i = bisect.bisect_left(entries, (key,))
    if i >= len(entries) or entries[i][1] is not js:
        raise RuntimeError(f"{js} is not in its sorted list under key {key}")
    del entries[i]


class BubbleSlot:
    __slots__ = ("host", "stage", "spare_gb", "speed", "guest")

    def __init__(self, host: "JobState", stage: int, spare_gb: float, speed: float):
        self.host = host
        self.stage = stage
        self.spare_gb = spare_gb
        self.speed = speed
        self.guest: "JobState | None" = None

    def __repr__(self) -> str:
        return f"BubbleSlot(host={self.host.job.job_id}, stage={self.stage}, spare={self.spare_gb}GB, speed={self.speed})"

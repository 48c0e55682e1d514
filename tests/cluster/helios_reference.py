"""A second-by-second reference of the Helios artifact's per-VC simulation loop, for parity tests.

Deliberately naive: a clock that advances one second at a time, plain lists re-sorted every tick,
and a placer that sorts the node list on every call -- the shape of the artifact's simulator, with
none of the event-driven engine's shortcuts (bitmasks, sorted queues, jumping between events).
Usable only on small traces (cost ~ seconds of simulated time x queue length).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RefJob:
    seq: int
    submit: int
    duration: int
    gpus: int
    priority: int = 0          # QSSF: estimated duration x GPUs
    status: str = ""
    remain: int = 0
    start: int = -1
    end: int = -1
    queue: int = 0
    ckpt_times: int = 0
    ckpt_time: int = 0
    nodes: list = field(default_factory=list)


def _place(free: list[int], gpn: int, gpus: int) -> list[tuple[int, int]] | None:
    """Consolidate placer: nodes with free GPUs, in index order, sorted on each call."""
    if sum(free) < gpus:
        return None
    avail = [i for i in range(len(free)) if free[i] > 0]
    if gpus <= gpn:
        for i in sorted(avail, key=lambda i: free[i]):
            if free[i] >= gpus:
                return [(i, gpus)]
        return None
    ordered = sorted(avail, key=lambda i: free[i], reverse=True)
    need = gpus // gpn if gpus % gpn == 0 else gpus // gpn + 1
    out = []
    for i in ordered:
        if gpus % gpn == 0:
            if free[i] < gpn:
                return None
            out.append((i, gpn))
            need -= 1
            if need == 0:
                return out
        else:
            if free[i] == gpn and need > 1:
                out.append((i, gpn))
                need -= 1
                continue
            if free[i] >= gpus % gpn and need == 1:
                out.append((i, gpus % gpn))
                return out
            return None
    return None


def simulate(jobs: list[RefJob], nodes: int, gpn: int, policy: str, max_ticks: int = 10**6) -> list[RefJob]:
    free = [gpn] * nodes
    que: list[RefJob] = []
    run: list[RefJob] = []
    ended = 0
    total = nodes * gpn
    by_time: dict[int, list[RefJob]] = {}
    for j in jobs:
        j.remain = j.duration
        by_time.setdefault(j.submit, []).append(j)
    t = 0
    while ended < len(jobs):
        if t > max_ticks:
            raise RuntimeError("reference did not finish")
        # 1. end jobs
        for j in list(run):
            if policy == "srtf":
                if j.remain == 0:
                    j.status, j.end = "end", t
                else:
                    j.remain -= 1
                    continue
            elif t != j.end:
                continue
            ended += 1
            for i, n in j.nodes:
                free[i] += n
            j.nodes = []
            run.remove(j)
        # 2. queue new jobs
        new = by_time.get(t, [])
        for j in new:
            j.status = "pend"
            que.append(j)
        # 3. order and start
        if policy in ("fifo", "sjf", "qssf"):
            if policy == "fifo":
                que.sort(key=lambda j: j.submit)
            elif policy == "sjf":
                que.sort(key=lambda j: j.duration)
            else:
                que.sort(key=lambda j: j.gpus)
                if len(que) > len(new):
                    que.sort(key=lambda j: j.priority)
            for j in list(que):
                alloc = _place(free, gpn, j.gpus)
                if alloc is None:
                    break
                for i, n in alloc:
                    free[i] -= n
                j.nodes = alloc
                j.start, j.end, j.queue, j.status = t, t + j.duration, t - j.submit, "run"
                que.remove(j)
                run.append(j)
        else:
            current = que + run
            current.sort(key=lambda j: j.remain)
            quota = total
            preempt, prerun = [], []
            for j in current:
                if j.gpus <= quota:
                    quota -= j.gpus
                    if j.status == "pend":
                        prerun.append(j)
                elif j.status == "run":
                    preempt.append(j)
            for j in preempt:
                j.ckpt_times += 1
                j.ckpt_time = t
                j.status = "pend"
                j.remain += 7 if j.gpus == 1 else 30 if j.gpus <= 8 else 60
                for i, n in j.nodes:
                    free[i] += n
                j.nodes = []
                que.append(j)
                run.remove(j)
            for j in prerun:
                alloc = _place(free, gpn, j.gpus)
                if alloc is None:
                    continue
                for i, n in alloc:
                    free[i] -= n
                j.nodes = alloc
                j.status = "run"
                if j.ckpt_times == 0:
                    j.start, j.queue = t, t - j.submit
                else:
                    j.queue += t - j.ckpt_time
                que.remove(j)
                run.append(j)
        t += 1
    return jobs

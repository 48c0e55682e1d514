"""Slow NICs: which device sends everything late, found by a ring probe.

A slow network interface slows every transfer of its device: its pipeline messages, its part of the
data-parallel ring's all-reduce. The all-reduce cannot name it: a ring finishes when its slowest
link does, so every member waits the same. ``links.py`` names a slow *pipeline* link, but only
between two stages and only where a pipeline exists. What names the device is a probe: every
``--resihp-nic-probe-interval`` iterations, after a barrier, each rank sends a small message
(``--resihp-nic-probe-kb``) to its next neighbour on the ring of current ranks and times when the
one from its previous neighbour arrives; then, after another barrier, the same the other way round
(``ring_probe``). A message's time is its sender's egress plus
the receiver's ingress; each barrier gives the ranks a common start (a rank slow at computing is
not late here: the probe begins after everyone has arrived).

Per device and probe, its *egress* time is the smaller of its two messages' times (on a ring of two
devices, the two messages go to the same neighbour): a device whose own sends are slow is slow on
both, while a neighbour of it is slow on at most one. After ``warmup`` probes the pooled healthy
egress times are the baseline (median, MAD as noise); a device is flagged in a probe when its egress
exceeds the baseline by ``max(floor_s, zscore x noise)``, named ``slow_nic`` when all but one of its
last ``window`` probes are flagged (the persistence rule of the other detectors), and
``nic_recovered`` after ``window`` probes unflagged. ``extra_s_per_message`` is the median excess;
with the probe's size it gives the NIC's bandwidth (``detail["mbps"]``).

What the planner does with it (``planner_policy``, ``planner.ring_factors``): the NIC's bandwidth
slows the gradient all-reduce of every data-parallel ring its device is in, and every pipeline
message the device sends; the planner replaces the device by a spare, moves layers off its stage,
or (``--resihp-act-reshape``) takes a shape without a ring over it (docs/resihp.md, "Slow NICs").
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from megatron_ext.resihp.links import ExcessWatch
from megatron_ext.resihp.verdicts import Verdict


def ring_probe(nbytes: int, *, hold: Callable[[int, int], None] | None = None, group=None,
               device=None) -> tuple[float, float]:
    """One probe on this rank (a collective: every rank of ``group`` calls it). Returns the seconds
    from a common start to the arrival of the message from the previous rank, and (a second round)
    from the next one. ``hold(nbytes, peer_rank)`` is called before each send (fault injection: a
    slow NIC). Two rounds of one message each, because a gloo receive says it is complete only once
    waited on: each round has one receive to wait for, so its wait ends when the message is in.
    ``device``: where the messages live (the group's collective device: a CUDA device under NCCL,
    which sends no CPU tensor; default the CPU). On CUDA a wait only orders the stream, so the
    host synchronizes the device after the barrier and after the receive: the times are arrivals,
    not enqueues."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        return (0.0, 0.0)
    n = max(1, nbytes // 4)
    device = torch.device("cpu") if device is None else torch.device(device)
    out = torch.ones(n, dtype=torch.float32, device=device)
    buf = torch.empty(n, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device=None: None)
    arrived = []
    for step in (1, -1):                                  # to the next rank, then to the previous one
        dst, src = (rank + step) % world, (rank - step) % world
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        recv = dist.irecv(buf, src=_global(src, group), group=group)
        if hold is not None:
            hold(nbytes, dst)
        send = dist.isend(out, dst=_global(dst, group), group=group)
        recv.wait()
        sync(device)
        arrived.append(time.perf_counter() - t0)
        send.wait()
    return (float(arrived[0]), float(arrived[1]))


def _global(rank: int, group) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def egress_times(arrivals: Sequence[Sequence[float]]) -> np.ndarray:
    """Per rank, its egress time of one probe: ``arrivals[r]`` is rank r's (from previous, from
    next); rank r's message to its next neighbour arrives there as that one's "from previous", its
    message to its previous neighbour as that one's "from next". The smaller of the two."""
    a = np.asarray(arrivals, dtype=float)
    w = a.shape[0]
    if w < 2:
        return np.zeros(w)
    to_next = a[(np.arange(w) + 1) % w, 0]
    to_prev = a[(np.arange(w) - 1) % w, 1]
    return np.minimum(to_next, to_prev)


class NicDetector(ExcessWatch):
    """``observe(arrivals, members, iteration)`` once per probe on the detector's rank (the gathered
    ``ring_probe`` results, one row per rank); returns the probe's ``slow_nic`` / ``nic_recovered``
    verdicts. Devices by launch rank (``members[r]``), so a device keeps its record across re-layouts."""

    name = "NicDetector"

    def __init__(self, *, nbytes: int, warmup: int = 20, window: int = 8, zscore: float = 4.0,
                 floor_s: float = 0.01) -> None:
        if nbytes < 4:
            raise ValueError(f"NicDetector: need nbytes >= 4, got {nbytes}")
        super().__init__(warmup=warmup, window=window, zscore=zscore, floor_s=floor_s)
        self.nbytes = nbytes
        self.last: dict[int, float] = {}

    def observe(self, arrivals: Sequence[Sequence[float]], members: Sequence[int], iteration: int) -> list[Verdict]:
        if len(arrivals) != len(members):
            raise ValueError(f"NicDetector.observe: {len(arrivals)} probe rows for {len(members)} ranks")
        eg = egress_times(arrivals)
        self.last = {int(members[r]): float(t) for r, t in enumerate(eg)}
        if len(members) < 2:
            self.seen += 1
            return []
        if self._calibrating(self.last.values()):
            return []
        out = []
        for r, (dev, t) in enumerate(self.last.items()):
            change = self._step(dev, t)
            if change is not None:
                out.append(self._verdict("slow_nic" if change == "slow" else "nic_recovered", r, dev, iteration, t))
        return out

    def _verdict(self, kind: str, rank: int, dev: int, iteration: int, t: float) -> Verdict:
        detail = {"launch_rank": dev, "egress_s": round(t, 6), "baseline_s": round(self.base_s, 6),
                  "probe_bytes": self.nbytes}
        if kind == "slow_nic":
            extra = self._extra(self.watched[dev])
            detail["extra_s_per_message"] = round(extra, 6)
            detail["mbps"] = round(self.nbytes / extra / 1e6, 3) if extra > 0 else None
        return Verdict(kind=kind, rank=rank, stage=None, iteration=iteration, factor=None, confidence=1.0,
                       detector="resihp-nic", detail=detail)

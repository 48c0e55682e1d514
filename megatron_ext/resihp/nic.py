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

The same probe names a slow *path* between two ring neighbours (``PathDetector``): a path between
devices a and b slows a's message to b and b's to a, and neither device's message to its other
neighbour, so the egress rule above flags neither device. Per pair of ring neighbours and probe its
value is the smaller of its two directions' times; the pair is flagged when that value exceeds the
threshold (both directions slow) while neither end's egress does (a slow NIC at an end explains
it), and named ``slow_path`` / ``path_recovered`` by the same persistence rule. On a ring of two
devices both messages of each device go to the one neighbour: a path and a NIC look alike there,
and no path verdict is given. A pair no longer adjacent on the probe ring (a re-layout moved them
apart) is not observed: its verdict stands, as a link's does.
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


def path_times(arrivals: Sequence[Sequence[float]]) -> dict[tuple[int, int], tuple[float, float]]:
    """Per pair of ring neighbours (rank r, rank r + 1 modulo the ring), the times of r's message to
    r + 1 (there, "from previous") and of r + 1's message to r (at r, "from next"). Empty for a ring
    of fewer than three ranks (with two, both messages of a rank go to the same neighbour)."""
    a = np.asarray(arrivals, dtype=float)
    w = a.shape[0]
    if w < 3:
        return {}
    return {(r, (r + 1) % w): (float(a[(r + 1) % w, 0]), float(a[r, 1])) for r in range(w)}


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
                 floor_s: float = 0.01, severe_factor: float = 0.0, severe_window: int = 4) -> None:
        if nbytes < 4:
            raise ValueError(f"NicDetector: need nbytes >= 4, got {nbytes}")
        super().__init__(warmup=warmup, window=window, zscore=zscore, floor_s=floor_s, severe_factor=severe_factor,
                         severe_window=severe_window)
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
            detail["rule"] = self.watched[dev].rule
        return Verdict(kind=kind, rank=rank, stage=None, iteration=iteration, factor=None, confidence=1.0,
                       detector="resihp-nic", detail=detail)


Pair = tuple[int, int]


class PathDetector(ExcessWatch):
    """``observe(arrivals, members, iteration)`` once per probe on the detector's rank (the same rows
    as ``NicDetector``); returns the probe's ``slow_path`` / ``path_recovered`` verdicts. Pairs of
    devices by launch rank, smaller first. The baseline is the pooled pair values (the smaller of a
    pair's two message times) of the warm-up probes; an end's egress is judged against the same
    threshold. Picklable: it travels with the detector when the logging rank moves."""

    name = "PathDetector"

    def __init__(self, *, nbytes: int, warmup: int = 20, window: int = 8, zscore: float = 4.0,
                 floor_s: float = 0.01, severe_factor: float = 0.0, severe_window: int = 4) -> None:
        if nbytes < 4:
            raise ValueError(f"PathDetector: need nbytes >= 4, got {nbytes}")
        super().__init__(warmup=warmup, window=window, zscore=zscore, floor_s=floor_s, severe_factor=severe_factor,
                         severe_window=severe_window)
        self.nbytes = nbytes
        self.last: dict[Pair, float] = {}          # this probe's pair values (for the log)

    def observe(self, arrivals: Sequence[Sequence[float]], members: Sequence[int], iteration: int) -> list[Verdict]:
        if len(arrivals) != len(members):
            raise ValueError(f"PathDetector.observe: {len(arrivals)} probe rows for {len(members)} ranks")
        times = path_times(arrivals)
        if not times:              # a ring of two (or one): a path cannot be told from a NIC
            self.last = {}
            return []
        eg = egress_times(arrivals)
        rank_of = {int(m): r for r, m in enumerate(members)}
        pairs = {}
        for (r, s), (there, back) in times.items():
            a, b = int(members[r]), int(members[s])
            key = (min(a, b), max(a, b))
            fwd, bwd = (there, back) if a < b else (back, there)
            pairs[key] = (min(fwd, bwd), (fwd, bwd), (eg[r], eg[s]))
        self.last = {k: v[0] for k, v in pairs.items()}
        if self._calibrating(self.last.values()):
            return []
        limit = self.threshold_s()
        out = []
        for key, (t, both, ends) in sorted(pairs.items()):
            # an end whose own sends are slow explains both directions: not the path's (the pair's
            # value is kept out of its record, neither flagged nor clean)
            if max(ends) > limit:
                continue
            change = self._step(key, t)
            if change is not None:
                out.append(self._verdict("slow_path" if change == "slow" else "path_recovered", key, rank_of,
                                         iteration, t, both))
        return out

    def _verdict(self, kind: str, pair: Pair, rank_of: dict[int, int], iteration: int, t: float,
                 both: tuple[float, float]) -> Verdict:
        a, b = pair
        detail = {"launch_rank": a, "peer_launch_rank": b, "path_s": round(t, 6),
                  "message_s": [round(x, 6) for x in both], "baseline_s": round(self.base_s, 6),
                  "probe_bytes": self.nbytes}
        if kind == "slow_path":
            extra = self._extra(self.watched[pair])
            detail["extra_s_per_message"] = round(extra, 6)
            detail["mbps"] = round(self.nbytes / extra / 1e6, 3) if extra > 0 else None
            detail["rule"] = self.watched[pair].rule
        return Verdict(kind=kind, rank=rank_of.get(a, a), stage=None, iteration=iteration, factor=None,
                       confidence=1.0, detector="resihp-path", detail=detail)

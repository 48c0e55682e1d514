"""Pipeline bubbles as a low-priority GPU resource (Hydro's Bubble Squeezer, modelled).

A running pipeline-parallel job leaves each of its GPUs idle for a fraction ``b`` of the time: the
1F1B / GPipe bubble (p-1)/(m+p-1) for p stages and m micro-batches, or a measured fraction. Each of
its GPUs becomes a *bubble slot* that one bubble-tolerant job (a 1-GPU HPO trial) may use:

* the guest runs at ``min(bubble_speed, b)`` of its exclusive speed — Hydro measured about 15 % of
  exclusive throughput for fused trials in bubbles, and a guest cannot get more than the idle share;
  or, with ``--bubble-speed-from`` a Bubble Squeezer run's figures, at the measured work per
  bubble-second times ``b``;
* the guest must fit the host GPU's spare memory. Under 1F1B, stage ``s`` of ``p`` holds
  ``min(p - s, m)`` micro-batches of activations, so early stages have less room:
  ``spare = gpu_mem - (mem_gb + act_mem_gb * min(p - s, m))``;
* the host is not slowed (Hydro observed no visible slowdown of the GPT job); when the host stops,
  its guests are displaced and re-queued with the restart cost.
"""
from __future__ import annotations

import logging
from typing import Iterable

from megatron_ext.cluster.state import BubbleSlot, JobState
from megatron_ext.pipeline.bubbles import idle_fraction

logger = logging.getLogger(__name__)


def bubble_fraction_from_timeline(busy: "Iterable[tuple[float, float]]", start: float, end: float) -> float:
    """Idle share of one GPU over ``[start, end)`` from its busy intervals (e.g. the forward/backward
    events of one pipeline stage over a few iterations): a measured value for a trace's
    ``bubble_fraction`` column. The definition the timeline and the squeezer use."""
    return idle_fraction(busy, start, end)


def host_slots(host: "JobState", bubble_speed: float, gpu_mem_gb: float,
               work_per_bubble_s: float | None = None) -> list[BubbleSlot]:
    """The bubble slots a running pipeline job offers, one per GPU. A guest runs at
    ``min(bubble_speed, b)``, or at ``work_per_bubble_s * b`` when that was measured."""
    job = host.job
    speed = work_per_bubble_s * job.bubble if work_per_bubble_s is not None else min(bubble_speed, job.bubble)
    if speed <= 0:
        return []
    p, m = max(1, job.pp_stages), max(1, job.micro_batches)
    per_stage = max(1, job.gpus // p)
    slots = []
    for stage in range(p):
        spare = gpu_mem_gb - (job.mem_gb + job.act_mem_gb * min(p - stage, m))
        slots.extend(BubbleSlot(host, stage, spare, speed) for _ in range(per_stage))
    return slots


class BubblePool:
    """Bubble slots of the running pipeline jobs of one VC."""

    def __init__(self, bubble_speed: float, gpu_mem_gb: float, work_per_bubble_s: float | None = None):
        self.bubble_speed = bubble_speed
        self.gpu_mem_gb = gpu_mem_gb
        self.work_per_bubble_s = work_per_bubble_s
        self.by_host: dict[int, list[BubbleSlot]] = {}
        self.free: list[BubbleSlot] = []

    def add_host(self, host: "JobState") -> None:
        slots = host_slots(host, self.bubble_speed, self.gpu_mem_gb, self.work_per_bubble_s)
        if slots:
            self.by_host[id(host)] = slots
            self.free.extend(slots)

    def remove_host(self, host: "JobState") -> list["JobState"]:
        """Drop a stopped host's slots; returns the guests that lose their slot."""
        slots = self.by_host.pop(id(host), None)
        if not slots:
            return []
        gone = {id(s) for s in slots}
        self.free = [s for s in self.free if id(s) not in gone]
        return [s.guest for s in slots if s.guest is not None]

    def acquire(self, guest: "JobState", mem_gb: float) -> BubbleSlot | None:
        """The fastest free slot with room for ``mem_gb``; among equals the tightest fit, so that
        roomy slots stay for bigger guests."""
        best = None
        for slot in self.free:
            if slot.spare_gb >= mem_gb and (best is None or (slot.speed, -slot.spare_gb) > (best.speed, -best.spare_gb)):
                best = slot
        if best is not None:
            self.free.remove(best)
            best.guest = guest
        return best

    def release(self, slot: BubbleSlot) -> None:
        slot.guest = None
        if id(slot.host) in self.by_host:
            self.free.append(slot)

    def has_room(self) -> bool:
        return bool(self.free)

"""Fail-stop detection from heartbeats, as pure bookkeeping.

A stopped rank does not report that it stopped, and a hung collective would block any report that
travels through one. So every rank publishes a heartbeat on a side channel (the lead's loop uses
the rendezvous store) and one tracker compares the last time it saw each rank with the clock.
This module is only the tracker: feed it ``beat(rank, now)`` and ask ``check(now)``; it names each
silent rank once, ``timeout_s`` after its last beat, at the first ``check`` after that.
"""
from __future__ import annotations

import logging
from typing import Iterable

from megatron_ext.resihp.verdicts import Verdict

logger = logging.getLogger(__name__)


class HeartbeatTracker:
    """Last-seen time per rank -> ``fail_stop`` verdicts after ``timeout_s`` of silence."""

    def __init__(self, ranks: Iterable[int], timeout_s: float, *, start_s: float,
                 stage_of: dict[int, int] | None = None, detector: str = "heartbeat"):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        # Every rank counts as seen at start, so a rank that never beats is named after timeout_s.
        self.last_seen = {int(r): float(start_s) for r in ranks}
        self.stopped: set[int] = set()
        self.stage_of = dict(stage_of or {})
        self.detector = detector
        self.iteration = 0

    def beat(self, rank: int, now_s: float) -> None:
        """Record a heartbeat. Beats from a rank already declared stopped are ignored (it will
        rejoin through a relayout, not by beating again), and clocks never go backwards."""
        if rank not in self.last_seen:
            raise KeyError(f"heartbeat from rank {rank}, which is not tracked (ranks {sorted(self.last_seen)})")
        if rank in self.stopped:
            return
        self.last_seen[rank] = max(self.last_seen[rank], float(now_s))

    def set_iteration(self, iteration: int) -> None:
        """The training iteration verdicts should carry."""
        self.iteration = iteration

    def silent_for(self, rank: int, now_s: float) -> float:
        return float(now_s) - self.last_seen[rank]

    def check(self, now_s: float) -> list[Verdict]:
        """Verdicts for ranks silent for more than ``timeout_s``; each rank is named once."""
        out = []
        for rank, seen in sorted(self.last_seen.items()):
            if rank in self.stopped or now_s - seen <= self.timeout_s:
                continue
            self.stopped.add(rank)
            v = Verdict(kind="fail_stop", rank=rank, stage=self.stage_of.get(rank), iteration=self.iteration,
                        factor=None, confidence=1.0, detector=self.detector, time_s=float(now_s),
                        detail={"last_seen_s": seen, "silent_s": round(now_s - seen, 6),
                                "timeout_s": self.timeout_s})
            logger.debug(v.describe())  # the caller reports it (once, from one rank)
            out.append(v)
        return out

    @property
    def alive(self) -> list[int]:
        return sorted(set(self.last_seen) - self.stopped)

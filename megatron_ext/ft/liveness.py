"""Liveness: which ranks of the current generation still run, independent of any (possibly hung)
collective.

A stopped rank does not report that it stopped, and a hung collective would block any report that
travels through one. So every rank runs two daemon threads over the job's store: a publisher that
increments its counter key every ``interval_s``, and a monitor that reads all counters every
``poll_s`` and feeds changes to the pure ``HeartbeatTracker`` on its own clock (clock skew between
hosts does not matter). A rank whose counter stops changing for ``timeout_s`` is reported once as a
``Silence``. The monitor also runs the core's ``watch`` callback each poll (exit reports, the job's
end), so a main thread stuck in a collective with a lost peer is freed from this thread.

Liveness is the job's (``ft/core.py`` starts one per generation, on that generation's keys), not
the detector's: ResiHP turns a ``Silence`` into its fail-stop verdict for its own log.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Silence:
    """Rank ``rank`` (of its generation) was silent for ``silent_s`` > ``timeout_s`` at ``time_s``."""

    rank: int
    iteration: int
    time_s: float
    last_seen_s: float
    silent_s: float
    timeout_s: float


class HeartbeatTracker:
    """Last-seen time per rank -> one ``Silence`` per rank after ``timeout_s`` without a beat.
    Pure bookkeeping: feed it ``beat(rank, now)`` and ask ``check(now)``."""

    def __init__(self, ranks: Iterable[int], timeout_s: float, *, start_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        # Every rank counts as seen at start, so a rank that never beats is named after timeout_s.
        self.last_seen = {int(r): float(start_s) for r in ranks}
        self.stopped: set[int] = set()
        self.iteration = 0

    def beat(self, rank: int, now_s: float) -> None:
        """Record a heartbeat. Beats from a rank already declared stopped are ignored (it comes back
        as a new process through a later generation, not by beating again), and clocks never go
        backwards."""
        if rank not in self.last_seen:
            raise KeyError(f"heartbeat from rank {rank}, which is not tracked (ranks {sorted(self.last_seen)})")
        if rank in self.stopped:
            return
        self.last_seen[rank] = max(self.last_seen[rank], float(now_s))

    def set_iteration(self, iteration: int) -> None:
        """The training iteration a report should carry."""
        self.iteration = iteration

    def silent_for(self, rank: int, now_s: float) -> float:
        return float(now_s) - self.last_seen[rank]

    def check(self, now_s: float) -> list[Silence]:
        """Ranks silent for more than ``timeout_s``; each rank is reported once."""
        out = []
        for rank, seen in sorted(self.last_seen.items()):
            if rank in self.stopped or now_s - seen <= self.timeout_s:
                continue
            self.stopped.add(rank)
            out.append(Silence(rank=rank, iteration=self.iteration, time_s=float(now_s), last_seen_s=seen,
                               silent_s=round(now_s - seen, 6), timeout_s=self.timeout_s))
        return out

    @property
    def alive(self) -> list[int]:
        return sorted(set(self.last_seen) - self.stopped)


KEY = "{rank}"


class Heartbeat:
    """The publisher and monitor threads of one rank in one generation. ``store``: that
    generation's ``heartbeat`` keys (a client of its own: a client serialises its calls).
    ``on_silent(silence, reporter)``: called on the monitor thread for each silent rank;
    ``reporter`` is true on the lowest rank still alive (the one that says it). ``watch()``: called
    on the monitor thread every poll."""

    def __init__(self, store: Any, *, rank: int, world_size: int, interval_s: float, timeout_s: float,
                 poll_s: float = 0.25, on_silent: Callable[[Silence, bool], None] | None = None,
                 watch: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.poll_s = min(poll_s, interval_s)
        self.clock = clock
        self.tracker = HeartbeatTracker(range(world_size), timeout_s, start_s=clock())
        self.on_silent = on_silent
        self.watch = watch
        self.silences: list[Silence] = []
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._publish, name="ft-heartbeat", daemon=True),
                         threading.Thread(target=self._monitor, name="ft-monitor", daemon=True)]

    def start(self) -> "Heartbeat":
        self._beat()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * self.interval_s + 1)

    def set_iteration(self, iteration: int) -> None:
        with self._lock:
            self.tracker.set_iteration(iteration)

    def _beat(self) -> None:
        self.store.add(KEY.format(rank=self.rank), 1)

    def _publish(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception as exc:  # the store is gone: the job is ending
                logger.debug("heartbeat publish failed: %s", exc)
                return

    def poll_once(self) -> list[Silence]:
        now = self.clock()
        with self._lock:
            for r in range(self.world_size):
                value = self.store.add(KEY.format(rank=r), 0)  # read without blocking on a missing key
                if value != self._last.get(r):
                    self._last[r] = value
                    self.tracker.beat(r, now)
            new = self.tracker.check(now)
            self.silences.extend(new)
        if new and self.on_silent is not None:
            alive = self.tracker.alive
            for s in new:
                self.on_silent(s, bool(alive) and self.rank == min(alive))
        return new

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
                if self.watch is not None:
                    self.watch()
            except Exception as exc:
                logger.debug("heartbeat monitor stopped: %s", exc)
                return

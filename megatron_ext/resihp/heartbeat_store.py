"""Fail-stop detection over the rendezvous store, independent of any (possibly hung) collective.

Every rank runs two daemon threads: a publisher that increments its counter key in the job's
key-value store (torchrun's / the c10d TCPStore) every ``interval_s``, and a monitor that reads all
counters every ``poll_s`` and feeds changes to the pure ``HeartbeatTracker`` on its own clock (so
clock skew between hosts does not matter). A rank whose counter stops changing for ``timeout_s``
is named in a ``fail_stop`` verdict by every surviving monitor; the lowest surviving rank is the one
that reports it. Threads keep beating while the main thread waits in a collective for a dead peer.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from megatron_ext.resihp.heartbeat import HeartbeatTracker
from megatron_ext.resihp.verdicts import Verdict

logger = logging.getLogger(__name__)

KEY = "megatron_ext/resihp/heartbeat/{rank}"


class StoreHeartbeat:
    def __init__(self, store: Any, *, rank: int, world_size: int, interval_s: float, timeout_s: float,
                 stage_of: dict[int, int] | None = None, poll_s: float = 0.25,
                 on_verdict: Callable[[Verdict, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.poll_s = min(poll_s, interval_s)
        self.clock = clock
        self.tracker = HeartbeatTracker(range(world_size), timeout_s, start_s=clock(), stage_of=stage_of)
        self.on_verdict = on_verdict
        self.verdicts: list[Verdict] = []
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._publish, name="resihp-heartbeat", daemon=True),
                         threading.Thread(target=self._monitor, name="resihp-monitor", daemon=True)]

    def start(self) -> "StoreHeartbeat":
        self._beat()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
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

    def poll_once(self) -> list[Verdict]:
        now = self.clock()
        new: list[Verdict] = []
        with self._lock:
            for r in range(self.world_size):
                value = self.store.add(KEY.format(rank=r), 0)  # read without blocking on a missing key
                if value != self._last.get(r):
                    self._last[r] = value
                    self.tracker.beat(r, now)
            new = self.tracker.check(now)
            self.verdicts.extend(new)
        if new and self.on_verdict is not None:
            alive = self.tracker.alive
            for v in new:
                self.on_verdict(v, bool(alive) and self.rank == min(alive))
        return new

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception as exc:
                logger.debug("heartbeat monitor stopped: %s", exc)
                return

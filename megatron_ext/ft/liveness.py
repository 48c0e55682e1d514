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

A beat says the process lives, not that it trains: the publisher beats whatever the training
thread does. So the training thread also marks **progress** (``Progress.mark``: iteration start
and end, each micro-batch's forward, the optimizer step, a checkpoint save), which costs a clock
read and no store call, and the monitor thread of the same process checks it every poll
(``Progress.check``). A training thread without progress for the hang timeout, that is not waiting
on a peer (its innermost Python frame is not in a communication module: a rank blocked in a
collective with a hung peer is that peer's victim, not hung itself), is **hung** (``Hang``: the
last progress point, how long, and where its stack is). The timeout is ``--ft-hang-timeout-s``, or
derived: ``HANG_FACTOR`` times the median of the recent iteration times, at least
``HANG_FLOOR_S``, so a slow rank (fail-slow, ResiHP's) is never called hung; it is armed once
``ARM_AFTER`` iterations ran since the layout was built (the first ones compile and warm up), and
before that only the cap applies where there is one (under ``--ft-on-stop continue``).
"""
from __future__ import annotations

import dataclasses
import linecache
import logging
import os
import statistics
import sys
import sysconfig
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


HANG_FLOOR_S = 60.0
"""The derived hang timeout is never below this (a healthy rank's longest gap between progress
points: a first-iteration compile after a change, a long evaluation batch)."""
HANG_FACTOR = 10.0
"""The derived hang timeout is this many times the median recent iteration time."""
ARM_AFTER = 2
"""Iterations since the layout was built before a hang can be named."""

COMM_MODULES = ("torch.distributed", "megatron.core.pipeline_parallel.p2p_communication",
                "megatron.core.distributed", "megatron_ext.ft.", "megatron_ext.runtime.transport",
                "deepspeed.comm", "deepspeed.runtime.pipe.p2p")
"""A thread whose innermost Python frame is in one of these modules waits on a peer (a collective, a
pipeline message, the job's store): when it makes no progress, the peer is to blame."""
WAIT_LINE_MODULES = ("torch.", "megatron.", "deepspeed.", "megatron_ext.")
_STDLIB = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
"""In these packages a line calling ``.wait(`` waits on an asynchronous collective's handle (a user's
own ``event.wait()`` elsewhere is not taken for one)."""


@dataclasses.dataclass(frozen=True)
class Hang:
    """This process's training thread made no progress for ``stalled_s`` > ``timeout_s`` after
    ``point`` of ``iteration``, while not waiting on a peer; ``where``: its innermost frames."""

    point: str
    iteration: int
    stalled_s: float
    timeout_s: float
    where: str

    def describe(self) -> str:
        return (f"hung: no progress for {self.stalled_s:.1f} s since {self.point} (iteration {self.iteration}; "
                f"hang timeout {self.timeout_s:g} s); its training thread is in {self.where}")


def frames_of(ident: int | None) -> Any:
    """The innermost frame of thread ``ident`` (None if it does not run)."""
    return sys._current_frames().get(ident) if ident is not None else None


def waits_on_peer(frame: Any) -> bool:
    """Whether a thread stopped at ``frame`` waits on a peer: inside a communication module, or on
    the line of a ``.wait()`` call (an asynchronous collective's handle, e.g. megatron's tensor-parallel
    backward waiting for its gradient all-reduce)."""
    if frame is None:
        return False
    module = str(frame.f_globals.get("__name__", ""))
    if module.startswith(COMM_MODULES):
        return True
    if module.startswith(WAIT_LINE_MODULES) and ".wait(" in linecache.getline(frame.f_code.co_filename,
                                                                               frame.f_lineno):
        return True
    # A standard-library helper (an environment lookup, a condition's wait) called from a
    # communication module: the caller says where the thread is. A rank waiting for its hung peer,
    # caught inside ``os.environ`` as the job's store keys were read, was named hung itself.
    outer = frame
    while outer is not None and _in_stdlib(outer):
        outer = outer.f_back
    return outer is not frame and outer is not None and \
        str(outer.f_globals.get("__name__", "")).startswith(COMM_MODULES)


def _in_stdlib(frame: Any) -> bool:
    path = frame.f_code.co_filename
    return path.startswith("<frozen ") or (path.startswith(_STDLIB) and "site-packages" not in path)


def stack_summary(frame: Any, depth: int = 3) -> str:
    """``file:line function`` of the innermost ``depth`` frames, innermost first."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " <- ".join(out) or "(no Python frame)"


class Progress:
    """The training thread's progress marks, checked by the monitor thread of the same process.
    ``timeout_s`` 0: derived from the iteration times (module docstring), capped at ``cap_s``
    (under ``--ft-on-stop continue`` the collectives' own timeout: a longer hang would end them
    first); ``long_s``: the timeout of a gap that starts at a ``long`` mark (a checkpoint save)."""

    def __init__(self, *, timeout_s: float = 0.0, cap_s: float | None = None, long_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.timeout_s, self.cap_s, self.long_s, self.clock = float(timeout_s), cap_s, float(long_s), clock
        self.thread: int | None = None
        self.point, self.iteration, self.long = "setup", 0, False
        self.at = clock()
        self.iterations_since_arm = 0
        self.iteration_times: list[float] = []

    def mark(self, point: str, iteration: int | None = None, *, long: bool = False) -> None:
        """Training thread: it got to ``point`` (of ``iteration``, else the current one)."""
        self.thread = threading.get_ident()
        self.point, self.long = point, long
        if iteration is not None:
            self.iteration = iteration
        self.at = self.clock()

    def iteration_done(self, seconds: float) -> None:
        self.iteration_times = (self.iteration_times + [float(seconds)])[-20:]
        self.iterations_since_arm += 1
        self.mark("iteration end")

    def rearm(self) -> None:
        """The layout was (re)built: the next iterations compile and warm up again."""
        self.iterations_since_arm = 0
        self.at = self.clock()

    def timeout(self) -> float | None:
        """The hang timeout now; None while not armed. Before ``ARM_AFTER`` iterations of a layout
        (a compile, a warm-up) the cap alone, where there is one: under ``continue`` the survivors'
        collectives with a rank hung in its first iterations would time out first."""
        if self.iterations_since_arm < ARM_AFTER:
            return None if self.cap_s is None else max(self.cap_s, self.timeout_s)
        if self.timeout_s > 0:
            t = self.timeout_s
        else:
            t = max(HANG_FLOOR_S, HANG_FACTOR * statistics.median(self.iteration_times or [0.0]))
            if self.cap_s is not None:
                t = min(t, self.cap_s)
        return max(t, self.long_s) if self.long else t

    def stalled_s(self, now: float | None = None) -> float:
        return (self.clock() if now is None else now) - self.at

    def check(self, now: float | None = None) -> Hang | None:
        """Monitor thread: a ``Hang`` when the training thread has been without progress past the
        timeout and is not waiting on a peer; else None."""
        timeout = self.timeout()
        if timeout is None:
            return None
        stalled = self.stalled_s(now)
        if stalled <= timeout:
            return None
        frame = frames_of(self.thread)
        if frame is None or waits_on_peer(frame):
            return None
        return Hang(point=self.point, iteration=self.iteration, stalled_s=round(stalled, 3), timeout_s=timeout,
                    where=stack_summary(frame))

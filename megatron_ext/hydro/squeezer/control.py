"""The control block between a training rank and its bubble guest: shared memory plus a wake pipe.

One small file-backed shared-memory record per guest (``CONTROL_DTYPE``): the rank writes the
window (open flag, deadline, close time) and its requests (fusion limit, stop); the guest writes
its state (parked, running, ...), its measured pause-point unit, counters and recent pause
latencies. Plain stores on both sides: the rank's cost per window is a few field writes and, when
the guest is parked, one byte into a non-blocking pipe that wakes it. No lock is shared, so a guest
that dies or stops anywhere can never block the rank.

Times are ``time.perf_counter`` seconds (CLOCK_MONOTONIC: one clock for every process of a host).
The guest's CPU clock (``cpu_clock_s``: what the guest itself reads as ``time.process_time``) is
what the guest's work and pause latency are measured in: the rank reads it at each window's open and
close, where the wall clock would also count time the guest waited for a lock or for the core.
"""
from __future__ import annotations

import math
import os
import select
import tempfile
import time

import numpy as np

RING = 4096         # pause latencies the guest measured, not yet read by the rank (it reads them every iteration)
RUNS = 512          # recent guest run intervals kept (for timelines)
WINDOWS = 1024      # recent windows (open, close) kept: what a guest's run overlapped

# guest states
STARTING, PARKED, RUNNING, FINISHED, NO_ROOM, FAILED, STOPPED, SUSPENDED = range(8)
STATE_NAMES = ("starting", "parked", "running", "finished", "no room", "failed", "stopped", "suspended")
# Why the rank asks its guest to stop (the ``stop`` field): the guest says so on the trials it gives back.
STOP_END, STOP_MONITOR = 1, 2
# A window closed while the guest ran: the rank signals it (CPU), the guest suspends itself at once.
CLOSE_SIGNAL = "SIGUSR1"

CONTROL_DTYPE = np.dtype([
    # rank -> guest
    ("window_seq", "i8"),       # windows opened so far (a new number per window)
    ("window_open", "i8"),
    ("t_open", "f8"),
    ("deadline", "f8"),         # park before this (the forecast end minus the margin)
    ("t_close", "f8"),
    ("max_trials", "i8"),       # fusion limit (the squeezer lowers it when backing off)
    ("stop", "i8"),             # >0 (STOP_END, STOP_MONITOR): finish the unit, give back the trials, exit
    ("win", "f8", (WINDOWS, 2)),  # (open, close) of window number seq at [seq % WINDOWS]; close inf while open
    ("win_cpu", "f8", (WINDOWS, 2)),  # the guest's CPU clock at that open and close (NaN: not read)
    ("stops_n", "i8"),
    ("stops", "f8", (WINDOWS, 2)),  # (SIGSTOP, SIGCONT) the rank sent a guest still running at a close
    # guest -> rank
    ("pid", "i8"),
    ("state", "i8"),
    ("critical", "i8"),         # >0 while the guest is inside a storage call
    ("t_parked", "f8"),
    ("min_unit_s", "f8"),       # the guest's shortest measured unit between pause points
    ("units", "i8"),
    ("long_units", "i8"),       # units started although longer than most windows (they overrun)
    ("windows_used", "i8"),
    ("windows_skipped", "i8"),  # opened, but shorter than the guest's next unit
    ("steps", "i8"),            # fused training steps done
    ("trial_steps", "i8"),      # trial-steps done (steps x trials in the bundle)
    ("trials_done", "i8"),      # trials this guest finished (complete or pruned)
    ("fusion", "i8"),           # its fusion count (from its memory model and the free memory)
    ("bundle_trials", "i8"),    # trials in its bundle now
    ("heartbeat", "f8"),
    ("lat_n", "i8"),
    ("lat", "f8", (RING,)),     # its CPU time from a window's close until it stopped (see WindowGate._account)
    ("runs_n", "i8"),
    ("runs", "f8", (RUNS, 2)),  # (start, end) of its recent run intervals
    ("message", "S240"),
])


def cpu_clock_s(pid: int) -> float | None:
    """Seconds process ``pid`` has run on a CPU (all its threads): its CPU-time clock, the one it
    reads itself as ``time.process_time``. One system call, no file read: Linux encodes a process's
    CPU clock as a clock id (what ``clock_getcpuclockid(3)`` returns). None once it is gone."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)     # CPUCLOCK_SCHED of the whole process
    except OSError:
        return None


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class Control:
    """One side's view of a control block. ``create`` (the rank) makes the file and the pipe;
    ``attach`` (the guest) maps the file and keeps the pipe's read end."""

    def __init__(self, path: str, wake_r: int | None, wake_w: int | None) -> None:
        self.path = path
        self._mm = np.memmap(path, dtype=CONTROL_DTYPE, mode="r+", shape=(1,))
        self.rec = self._mm[0]
        self.wake_r, self.wake_w = wake_r, wake_w
        # Column views: a field store on a 1-element array is cheaper than on a record.
        self._cols = {name: self._mm[name] for name in CONTROL_DTYPE.names}

    @classmethod
    def create(cls, prefix: str = "megatron-ext-squeeze-") -> "Control":
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".ctl", dir=_shm_dir())
        os.ftruncate(fd, CONTROL_DTYPE.itemsize)
        os.close(fd)
        r, w = os.pipe()
        os.set_blocking(w, False)
        ctl = cls(path, r, w)
        ctl["max_trials"] = 1 << 30
        ctl["t_close"] = ctl["t_open"] = ctl["deadline"] = 0.0
        return ctl

    @classmethod
    def attach(cls, path: str, wake_r: int) -> "Control":
        return cls(path, wake_r, None)

    def __getitem__(self, name: str):
        return self._cols[name][0]

    def __setitem__(self, name: str, value) -> None:
        self._cols[name][0] = value

    @property
    def message(self) -> str:
        return bytes(self._cols["message"][0]).decode("utf-8", "replace")

    @message.setter
    def message(self, text: str) -> None:
        self._cols["message"][0] = text.encode("utf-8", "replace")[:CONTROL_DTYPE["message"].itemsize]

    # --- rank side ------------------------------------------------------------------------------
    def wake(self) -> None:
        """One byte into the pipe; a full pipe (a guest not reading) is not the rank's problem."""
        try:
            os.write(self.wake_w, b"w")
        except BlockingIOError:
            pass

    def open_window(self, t_open: float, deadline: float, cpu: float | None = None) -> None:
        """``cpu``: the guest's CPU clock now (``cpu_clock_s``), None when not read."""
        seq = int(self["window_seq"]) + 1
        self._cols["win"][0][seq % WINDOWS] = (t_open, float("inf"))
        self._cols["win_cpu"][0][seq % WINDOWS] = (math.nan if cpu is None else cpu, math.nan)
        self["deadline"] = deadline
        self["t_open"] = t_open
        self["window_seq"] = seq
        self["window_open"] = 1        # last: the guest reads the flag, then the deadline

    def close_window(self, t_close: float, cpu: float | None = None) -> None:
        k = int(self["window_seq"]) % WINDOWS
        self._cols["win_cpu"][0][k][1] = math.nan if cpu is None else cpu
        self._cols["win"][0][k][1] = t_close
        self["t_close"] = t_close
        self["window_open"] = 0

    def windows_since(self, seq0: int) -> list[tuple[float, float]]:
        """(open, close) of windows seq0 .. now (close inf while open; the oldest may be lost)."""
        return [(w0, w1) for w0, w1, _ in self.closes_since(seq0)]

    def closes_since(self, seq0: int) -> list[tuple[float, float, float]]:
        """(open, close, the guest's CPU clock at the close) of windows seq0 .. now."""
        seq = int(self["window_seq"])
        win, cpu = self._cols["win"][0], self._cols["win_cpu"][0]
        return [(float(win[k % WINDOWS][0]), float(win[k % WINDOWS][1]), float(cpu[k % WINDOWS][1]))
                for k in range(max(seq0, seq - WINDOWS + 1, 1), seq + 1)]

    def stopped(self, t: float) -> None:
        n = int(self["stops_n"])
        self._cols["stops"][0][n % WINDOWS] = (t, float("inf"))
        self["stops_n"] = n + 1

    def continued(self, t: float) -> None:
        n = int(self["stops_n"])
        if n:
            self._cols["stops"][0][(n - 1) % WINDOWS][1] = t

    def stops_since(self, t0: float) -> list[tuple[float, float]]:
        """The rank's stops of the guest that end after ``t0``, oldest first."""
        n = int(self["stops_n"])
        st = self._cols["stops"][0]
        out = [(float(st[k % WINDOWS][0]), float(st[k % WINDOWS][1])) for k in range(max(0, n - WINDOWS), n)]
        return [iv for iv in out if iv[1] > t0]

    def latencies_from(self, k: int) -> tuple[list[float], int, int]:
        """The guest's latencies number ``k`` onwards: (values, the next number to read, how many
        were overwritten before they were read)."""
        n = int(self["lat_n"])
        lost = max(0, n - k - RING)
        lat = self._cols["lat"][0]
        return [float(lat[i % RING]) for i in range(k + lost, n)], n, lost

    def run_intervals(self) -> list[tuple[float, float]]:
        n = int(self["runs_n"])
        runs = self._cols["runs"][0]
        order = range(n) if n <= RUNS else [(n + i) % RUNS for i in range(RUNS)]
        return [(float(runs[i][0]), float(runs[i][1])) for i in order]

    # --- guest side -----------------------------------------------------------------------------
    def drain(self) -> None:
        os.set_blocking(self.wake_r, False)
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def wait_wake(self, timeout_s: float) -> None:
        select.select([self.wake_r], [], [], timeout_s)

    def add_latency(self, seconds: float) -> None:
        n = int(self["lat_n"])
        self._cols["lat"][0][n % RING] = seconds
        self["lat_n"] = n + 1

    def add_run(self, t0: float, t1: float) -> None:
        n = int(self["runs_n"])
        self._cols["runs"][0][n % RUNS] = (t0, t1)
        self["runs_n"] = n + 1

    def close(self, unlink: bool = False) -> None:
        for fd in (self.wake_r, self.wake_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.wake_r = self.wake_w = None
        self._mm.flush()
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass

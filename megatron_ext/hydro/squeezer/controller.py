"""The rank's side of the Bubble Squeezer: its guest process, and the windows it hands over.

``GuestProcess`` starts, watches and stops one guest (``guest.py``) beside the rank: a separate
process, so a guest crash, OOM kill or hang can never take the rank down; pinned to the rank's
cores at nice 19; killed by the kernel if the rank dies (``PR_SET_PDEATHSIG``). A guest that dies
is restarted (its unfinished trials are given back by the next guest before it starts)
up to ``max_restarts`` times.

``Squeezer`` listens to the rank's bubble windows (``pipeline/windows.BubbleWindows``) and runs on
the training thread inside the p2p calls, so it only stores, signals and reads the guest's CPU
clock: on a window's open, the deadline (the forecast end, less the back-off share and the margin)
and a wake-up byte when the guest is parked (SIGCONT when it is suspended); on its close, the close
time, and, when the guest is still running, SIGSTOP on CPU (``Squeezer._halt``). A window is not offered
when there is no forecast yet, when the guests are off (a control iteration, or stopped), or when it
is shorter than the guest's smallest unit.

What the guest did is measured on its CPU clock (``control.cpu_clock_s``, one system call), read at
each offered window's open and close: its work inside windows is the clock's growth from open to
close (time it waited for a lock, or for the core, does not count), its overrun the growth from a
close that found it running to the next open, and the pause latency of a window at whose close it
was halted is the clock at the SIGCONT (still stopped: the moment it stopped running) less the clock
at the close. The guest measures the latency of every other window it ran in (``WindowGate``); the
rank reads those every iteration, so every window of the run is kept.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from megatron_ext.hydro.squeezer.control import (CLOSE_SIGNAL, FAILED, FINISHED, NO_ROOM, PARKED, RUNNING,
                                                STARTING, STATE_NAMES, STOP_END, STOPPED, SUSPENDED, Control,
                                                cpu_clock_s)
from megatron_ext.pipeline.windows import Window

logger = logging.getLogger(__name__)

# The rank's launcher environment: a guest must never join the training job's process group.
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class GuestProcess:
    def __init__(self, *, tune_config: str, rank: int, device: str, log_dir: str, budget_bytes: int,
                 cpus: set[int] | None = None, max_restarts: int = 3, sampler_key: tuple[int, ...] = ()) -> None:
        """``sampler_key``: with the rank and the restart count, what the guest's sampler seed is
        derived from (the run's first iteration: a resumed run draws afresh)."""
        self.tune_config, self.rank, self.device = tune_config, rank, device
        self.sampler_key = sampler_key
        self.log_dir, self.budget_bytes = log_dir, budget_bytes
        self.cpus = cpus if cpus is not None else _affinity()
        self.max_restarts = max_restarts
        self.ctl = Control.create()
        self.proc: subprocess.Popen | None = None
        self.reaper: subprocess.Popen | None = None   # a last guest that only gives trials back
        self.restarts = 0
        self.deaths: list[tuple[int, int]] = []     # (pid, exit code) of guests that died
        self.gone = False                            # no guest any more (died too often, or ended)
        self._err = None

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, reap: tuple[int, ...] = (), reap_only: bool = False) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "megatron_ext.hydro.squeezer.guest", "--control", self.ctl.path,
               "--wake-fd", str(self.ctl.wake_r), "--config", self.tune_config, "--rank", str(self.rank),
               "--budget-bytes", str(int(self.budget_bytes)), "--device", self.device, "--log-dir", self.log_dir,
               "--sampler-key", *map(str, (*self.sampler_key, self.restarts))]
        if reap:
            cmd += ["--reap", *map(str, reap)]
        if reap_only:
            cmd.append("--reap-only")
        if self._err is None:
            self._err = open(os.path.join(self.log_dir, f"guest_rank{self.rank}.stderr"), "ab")
        self.ctl["state"] = STARTING
        self.ctl["stop"] = 0
        # A new session: a Ctrl-C of the job reaches the rank, which stops its guest in order.
        self.proc = subprocess.Popen(cmd, pass_fds=(self.ctl.wake_r,), env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._err, stderr=self._err, start_new_session=True)
        try:   # the guest lowers its own priority too; this covers its first instructions
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, 19)
            if self.cpus:
                os.sched_setaffinity(self.proc.pid, self.cpus)
        except (OSError, AttributeError):
            pass

    @property
    def state(self) -> int:
        return int(self.ctl["state"])

    @property
    def ready(self) -> bool:
        """Parked, running in a window, or suspended: it takes windows."""
        return self.state in (PARKED, RUNNING, SUSPENDED)

    def signal(self, sig: int) -> None:
        """Signal the live guest (no error if it just died: ``check`` sees that)."""
        if self.proc is not None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def check(self) -> str | None:
        """Called between iterations: restart a guest that died. Returns a line to log, or None."""
        if self.proc is None or self.gone:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        pid, state = self.proc.pid, self.state
        self.proc = None
        if state in (FINISHED, NO_ROOM, STOPPED) and code == 0:
            self.gone = True
            return f"guest of rank {self.rank} ended: {STATE_NAMES[state]}" + (
                f" ({self.ctl.message})" if self.ctl.message else "")
        self.deaths.append((pid, code))
        what = f"exit code {code}" if code >= 0 else f"signal {-code}"
        why = f" ({self.ctl.message})" if state == FAILED and self.ctl.message else ""
        if self.restarts >= self.max_restarts:
            self.gone = True
            self.start(reap=(pid,), reap_only=True)   # gives its trials back, then exits
            self.reaper, self.proc = self.proc, None
            return (f"guest of rank {self.rank} died ({what}){why}; its trials are given back; no more "
                    f"restarts ({self.restarts} of {self.max_restarts} used): the rank goes on without a guest")
        self.restarts += 1
        self.start(reap=(pid,))
        return (f"guest of rank {self.rank} died ({what}){why}; its trials are given back; restarted "
                f"({self.restarts} of {self.max_restarts})")

    def stop(self, timeout_s: float = 20.0, wait: bool = True, why: int = STOP_END) -> None:
        """Ask the guest to give its trials back and exit; with ``wait``, kill it after ``timeout_s``.
        ``why`` (``STOP_END``, ``STOP_MONITOR``) is what its given-back trials say: the first
        request's (the job's end does not rename a stop the monitor asked for)."""
        self.ctl["stop"] = int(self.ctl["stop"]) or why
        self.ctl.wake()
        self.signal(signal.SIGCONT)      # a suspended guest must run to see the request
        if not wait:
            return
        procs = [p for p in (self.proc, self.reaper) if p is not None]
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                while True:      # SIGCONT again: it may have suspended itself just after the first
                    try:
                        p.wait(min(0.2, max(0.01, deadline - time.monotonic())))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= deadline:
                            raise
                        self.signal(signal.SIGCONT)
            except subprocess.TimeoutExpired:
                logger.warning("squeeze: guest %d of rank %d did not stop in %.0f s: killed", p.pid, self.rank,
                               timeout_s)
                p.kill()
                p.wait()
        self.proc = self.reaper = None
        if self._err is not None:
            self._err.close()
            self._err = None

    def close(self) -> None:
        self.ctl.close(unlink=True)


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return None


class Squeezer:
    """A ``WindowListener``: hands this rank's windows to its guest (see the module docstring)."""

    def __init__(self, guest: GuestProcess, *, margin_s: float = 0.0005, suspend: bool = True) -> None:
        self.guest, self.ctl = guest, guest.ctl
        self.suspend = suspend        # halt a guest still running at a window's close (CPU)
        self._stopped = False
        self._close_signal = getattr(signal, CLOSE_SIGNAL)
        self.margin_s = margin_s
        self.keep_back = 0.0          # share of each forecast not offered (back-off)
        self.active = False           # guests on in this iteration
        self.window_s = 0.0           # window time seen while guests were on
        self.offered = 0
        self.too_short = 0
        self.no_forecast = 0
        self._opened = False
        self.busy_s = 0.0             # the guest's CPU time inside windows
        self.overrun_s = 0.0          # its CPU time after a window closed under it, until the next open
        self.halts = 0                # SIGSTOPs sent at a close
        self.outlived = 0             # windows whose close found the guest running (a unit outlived it)
        self.latencies: list[float] = []   # every pause latency of the run, seconds of the guest's CPU
        self.latencies_lost = 0       # guest-measured ones overwritten before they were read (none expected)
        self._lat_next = 0
        self._open_cpu: tuple[int, float] | None = None    # (pid, the guest's CPU clock) at the open
        self._close_cpu: tuple[int, float] | None = None   # at a close that found it running
        self._halt_cpu: tuple[int, float] | None = None    # at the close that halted it

    def _guest_cpu(self) -> tuple[int, float] | None:
        proc = self.guest.proc
        if proc is None:
            return None
        c = cpu_clock_s(proc.pid)
        return None if c is None else (proc.pid, c)

    def window_open(self, w: Window) -> None:
        if not self.active:
            return
        ctl = self.ctl
        state = ctl["state"]
        if state != PARKED and state != RUNNING and state != SUSPENDED:
            if self._stopped:     # it ended between the close's read and the stop: let it exit
                self._continue(w.t_open, self._guest_cpu())
            return
        if w.forecast_s is None:
            self.no_forecast += 1
            return
        deadline = w.t_open + w.forecast_s * (1.0 - self.keep_back) - self.margin_s
        if deadline - w.t_open < ctl["min_unit_s"] or deadline <= w.t_open:
            self.too_short += 1
            return
        cpu = self._guest_cpu()
        ctl.open_window(w.t_open, deadline, None if cpu is None else cpu[1])
        self._opened = True
        self.offered += 1
        if cpu is not None and self._close_cpu is not None and self._close_cpu[0] == cpu[0]:
            self.overrun_s += cpu[1] - self._close_cpu[1]
        self._close_cpu = None
        self._open_cpu = cpu
        # A halt is ended whatever the state says: the close read RUNNING, but the guest may have
        # parked before the SIGSTOP landed (it then sits stopped and PARKED; a wake-up byte alone
        # would never reach it).
        if self._stopped:
            self._continue(w.t_open, cpu)
        elif state == SUSPENDED:
            self.guest.signal(signal.SIGCONT)
        if state == PARKED:
            ctl.wake()

    def _continue(self, t: float, cpu: tuple[int, float] | None) -> None:
        """End the halt of the last close: its latency is read first, on the stopped clock."""
        self._halted_latency(cpu)
        self.ctl.continued(t)
        self.guest.signal(signal.SIGCONT)

    def _halted_latency(self, cpu: tuple[int, float] | None) -> None:
        """The guest is still stopped: its CPU clock now is the clock when it stopped running."""
        if cpu is not None and self._halt_cpu is not None and self._halt_cpu[0] == cpu[0]:
            self.latencies.append(max(0.0, cpu[1] - self._halt_cpu[1]))
        self._stopped = False
        self._halt_cpu = None

    def before_stop(self) -> None:
        """Record the latency of a halt still in force (call before ``GuestProcess.stop``, whose
        SIGCONT ends it)."""
        if self._stopped:
            self._halted_latency(self._guest_cpu())

    def window_close(self, w: Window, t_close: float) -> None:
        if self.active:
            self.window_s += t_close - w.t_open
        if self._opened:
            cpu = self._guest_cpu()
            self.ctl.close_window(t_close, None if cpu is None else cpu[1])
            self._opened = False
            if cpu is not None and self._open_cpu is not None and self._open_cpu[0] == cpu[0]:
                self.busy_s += cpu[1] - self._open_cpu[1]
            self._open_cpu = None
            if self.ctl["state"] == RUNNING:
                self.outlived += 1
                self._close_cpu = cpu
                if self.suspend:
                    self._halt(t_close, cpu)

    def _halt(self, t: float, cpu: tuple[int, float] | None) -> None:
        """The window closed under a running guest (CPU). At nice 19 beside its busy rank it would
        crawl to its next pause point; SIGSTOP halts it at once instead (SIGCONT at the next window
        it is offered). Not inside a storage call (``critical``): there it is asked to suspend
        itself once the call returns. After the stop the flag is read again -- the kernel stops a
        process at its next scheduling point, and it may have entered a call meanwhile."""
        ctl = self.ctl
        if not ctl["critical"]:
            self.guest.signal(signal.SIGSTOP)
            if not ctl["critical"]:
                ctl.stopped(t)
                self._stopped = True
                self._halt_cpu = cpu
                self.halts += 1
                return
            self.guest.signal(signal.SIGCONT)
        self.guest.signal(self._close_signal)

    def read_latencies(self) -> None:
        """Move the latencies the guest measured into ``latencies`` (every iteration: its ring
        holds ``control.RING``)."""
        new, self._lat_next, lost = self.ctl.latencies_from(self._lat_next)
        self.latencies += new
        self.latencies_lost += lost

    def stats(self) -> dict[str, Any]:
        ctl = self.ctl
        self.read_latencies()
        busy, over = self.busy_s, self.overrun_s
        return {"window_s": self.window_s, "busy_s": busy, "overrun_s": over,
                "halts": self.halts, "units_outlived": self.outlived, "latencies_lost": self.latencies_lost,
                "used": busy / self.window_s if self.window_s > 0 else 0.0,
                "windows_offered": self.offered, "windows_used": int(ctl["windows_used"]),
                "windows_skipped": int(ctl["windows_skipped"]) + self.too_short, "no_forecast": self.no_forecast,
                "steps": int(ctl["steps"]), "trial_steps": int(ctl["trial_steps"]),
                "trials_done": int(ctl["trials_done"]), "fusion": int(ctl["fusion"]),
                "bundle_trials": int(ctl["bundle_trials"]),
                "min_unit_s": float(ctl["min_unit_s"]), "units": int(ctl["units"]),
                "long_units": int(ctl["long_units"]), "latencies": list(self.latencies), "state": STATE_NAMES[int(ctl["state"])],
                "restarts": self.guest.restarts, "deaths": list(self.guest.deaths)}

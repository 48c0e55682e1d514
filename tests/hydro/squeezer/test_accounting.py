"""What the rank counts of its guest is the guest's CPU time, read on the guest's own clock: work in a
window is what the guest ran there (not the wall time it was marked running), a halted guest's pause
latency is what it ran from the close until it stopped, and no latency of a run is dropped."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from megatron_ext.hydro.squeezer.control import FINISHED, NO_ROOM, PARKED, RING, RUNNING, Control, cpu_clock_s
from megatron_ext.hydro.squeezer.controller import Squeezer
from megatron_ext.pipeline.windows import Window


def _kernel_cpu_s(pid: int) -> float:
    """The kernel's count of the time ``pid`` ran (scheduler statistics, independent of the squeezer)."""
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as fh:
        return int(fh.read().split()[0]) / 1e9


class _Guest:
    """A stand-in guest: a real process (spinning, or asleep as if waiting on a lock) and a control
    block that says it is running."""

    def __init__(self, code: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        self.ctl = Control.create()
        self.ctl["state"] = RUNNING
        self.restarts, self.deaths = 0, []

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.ctl.close(unlink=True)


SPIN = "while True: pass"
ASLEEP = "import time; time.sleep(600)"


@pytest.fixture
def guest(request):
    g = _Guest(request.param)
    time.sleep(0.2)                       # started
    yield g
    g.close()


def _window(sq: Squeezer, k: int, open_s: float) -> None:
    t0 = time.perf_counter()
    w = Window((k, 3, 1), t0, open_s)
    sq.window_open(w)
    time.sleep(open_s)
    sq.window_close(w, time.perf_counter())


@pytest.mark.parametrize("guest", [ASLEEP], indirect=True)
def test_a_guest_marked_running_but_asleep_did_no_work_in_the_window(guest):
    sq = Squeezer(guest, suspend=False)
    sq.active = True
    _window(sq, 0, 0.3)
    s = sq.stats()
    assert s["window_s"] >= 0.3
    assert s["busy_s"] < 5e-3, s["busy_s"]          # the wall time it was "running" would be 0.3 s
    assert s["units_outlived"] == 1 and s["halts"] == 0


@pytest.mark.parametrize("guest", [SPIN], indirect=True)
def test_work_in_a_window_is_the_guests_cpu_time_as_the_kernel_counts_it(guest):
    sq = Squeezer(guest, suspend=False)
    sq.active = True
    pid = guest.proc.pid
    k0 = _kernel_cpu_s(pid)
    _window(sq, 0, 0.3)
    k1 = _kernel_cpu_s(pid)
    busy = sq.stats()["busy_s"]
    # the kernel's count spans the window and a little more (the reads around it)
    assert 0 < busy <= k1 - k0 + 1e-3 and busy >= (k1 - k0) - 0.02, (busy, k1 - k0)


@pytest.mark.parametrize("guest", [SPIN], indirect=True)
def test_a_halted_guest_is_counted_and_its_latency_is_what_it_ran_until_it_stopped(guest):
    sq = Squeezer(guest, suspend=True)
    sq.active = True
    pid = guest.proc.pid
    _window(sq, 0, 0.05)                 # closes on a running guest: SIGSTOP
    time.sleep(0.2)
    c_stopped = cpu_clock_s(pid)
    time.sleep(0.2)
    assert cpu_clock_s(pid) == c_stopped     # halted: its clock stands still
    assert sq.stats()["halts"] == 1 and sq.latencies == []   # read when it is continued
    w = Window((1, 3, 1), time.perf_counter(), 0.05)
    sq.window_open(w)                    # SIGCONT: the latency is read first, on the stopped clock
    close_cpu = float(guest.ctl["win_cpu"][1][1])   # window 1 (the first): the clock at its close
    assert len(sq.latencies) == 1
    assert sq.latencies[0] == pytest.approx(c_stopped - close_cpu, abs=1e-9) and sq.latencies[0] >= 0
    sq.window_close(w, time.perf_counter())
    s = sq.stats()
    assert s["halts"] == 2 and s["units_outlived"] == 2
    sq.before_stop()                     # the halt still in force at the end is measured too
    assert len(sq.stats()["latencies"]) == 2


@pytest.mark.parametrize("wrote", [PARKED, NO_ROOM, FINISHED])
@pytest.mark.parametrize("guest", [SPIN], indirect=True)
def test_a_guest_halted_as_it_parked_or_ended_is_continued_at_the_next_window(guest, wrote):
    """The close read RUNNING and sent SIGSTOP, but the guest had meanwhile parked (the next open
    finds it PARKED: a wake-up byte alone would leave it stopped for the rest of the run) or ended
    (it takes no window any more, and must still run to exit)."""
    sq = Squeezer(guest, suspend=True)
    sq.active = True
    pid = guest.proc.pid
    _window(sq, 0, 0.05)                 # closes on a running guest: SIGSTOP
    assert sq.stats()["halts"] == 1
    guest.ctl["state"] = wrote           # what the guest wrote just before the stop took effect
    time.sleep(0.1)
    c_stopped = cpu_clock_s(pid)
    w = Window((1, 3, 1), time.perf_counter(), 0.3)
    sq.window_open(w)
    time.sleep(0.3)
    assert cpu_clock_s(pid) > c_stopped + 0.01, "the guest was left stopped"
    assert len(sq.latencies) == 1 and guest.ctl.stops_since(0.0)[-1][1] != float("inf")
    sq.window_close(w, time.perf_counter())


def test_every_latency_the_guest_measured_is_kept_not_the_last_ring_full():
    ctl = Control.create()
    try:
        sq = Squeezer(type("G", (), {"ctl": ctl, "proc": None, "restarts": 0, "deaths": []})())
        for k in range(3 * RING):
            ctl.add_latency(k * 1e-6)
            if k % 1000 == 999:
                sq.read_latencies()          # the rank reads them every iteration
        s = sq.stats()
        assert s["latencies"] == [k * 1e-6 for k in range(3 * RING)] and s["latencies_lost"] == 0
        for k in range(RING + 10):           # more than a ring between two reads: counted, not hidden
            ctl.add_latency(1.0)
        s = sq.stats()
        assert s["latencies_lost"] == 10 and len(s["latencies"]) == 4 * RING
    finally:
        ctl.close(unlink=True)

"""The run's time account (runtime/ettr.py): causes add up to the wall time, a redone iteration
counts once as productive, and an account carried in a checkpoint makes a later launch report the
whole run with the gap between launches as a restart."""
from __future__ import annotations

import pytest

from megatron_ext.runtime.ettr import CAUSES, WallAccount, describe


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_causes_add_up_to_the_wall_time_and_a_redone_iteration_counts_once():
    clock = Clock(100.0)
    w = WallAccount(start_s=90.0, clock=clock)
    w.charge("setup", 10.0)
    for it in (1, 2, 3):
        w.iteration(it, 2.0)
    w.charge("detection", 4.0)      # iteration 4 interrupted by a fault
    w.charge("pause", 1.0)          # the recovery
    w.iteration(3, 2.5)             # iteration 3 rolled back and computed again
    w.iteration(4, 2.0)
    w.charge("checkpoint", 1.5)
    clock.now = 90.0 + 30.0
    s = w.summary()
    assert s["wall_s"] == 30.0
    assert s["seconds"] == {"productive": 8.5, "detection": 4.0, "pause": 1.0, "redone": 2.0, "checkpoint": 1.5,
                            "evaluation": 0.0, "setup": 10.0, "restarts": 0.0, "other": 3.0}
    assert sum(s["seconds"].values()) == pytest.approx(30.0) and s["ettr"] == round(8.5 / 30, 4)
    line = describe(s)
    assert line.startswith("ETTR 0.283 (effective training time / wall time) over 30.0 s: productive 8.5 s (28.3 %), "
                           "detection 4.0 s (13.3 %)"), line
    assert "evaluation" not in line and "restarts" not in line          # causes that took no time
    with pytest.raises(ValueError, match="unknown cause 'lunch'"):
        w.charge("lunch", 1.0)


def test_a_later_launch_carries_the_account_and_counts_the_gap_as_a_restart():
    first_clock = Clock(1000.0)
    first = WallAccount(start_s=1000.0, clock=first_clock)
    for it in range(1, 11):
        first.iteration(it, 1.0)
    first_clock.now = 1012.0
    state = first.to_state(upto_iteration=8)   # a checkpoint of iteration 8, saved at 1012
    assert state["seconds"]["productive"] == 8.0 and state["seconds"]["redone"] == 2.0 and state["wall_s"] == 12.0
    # The job was preempted after the save; the next launch starts at 1100 and resumes from it.
    second_clock = Clock(1100.0)
    second = WallAccount(start_s=1100.0, clock=second_clock)
    second.resume(state)
    for it in range(9, 13):
        second.iteration(it, 1.0)
    second_clock.now = 1106.0
    s = second.summary()
    assert s["wall_s"] == 12.0 + 88.0 + 6.0
    assert s["seconds"]["productive"] == 12.0 and s["seconds"]["restarts"] == 88.0 and s["seconds"]["redone"] == 2.0
    assert sum(s["seconds"].values()) == pytest.approx(s["wall_s"])
    second.resume({"seconds": "garbled"})      # an account this version cannot read changes nothing
    assert second.summary()["seconds"]["restarts"] == 88.0
    assert set(s["seconds"]) == set(CAUSES)


def test_a_process_joining_the_job_takes_the_jobs_account():
    clock = Clock(200.0)
    job = WallAccount(start_s=100.0, clock=clock)
    job.charge("setup", 5.0)
    for it in range(1, 1006):
        job.iteration(it, 0.05)
    exported = job.export()
    assert len(exported["iterations"]) == WallAccount.KEEP   # older iterations travel as one total
    replacement = WallAccount(start_s=190.0, clock=clock)     # its own process started later
    replacement.adopt(exported)
    replacement.iteration(1005, 0.07)                         # a rollback redoes the job's last iteration
    s, j = replacement.summary(), job.summary()
    assert s["wall_s"] == j["wall_s"] == 100.0 and s["seconds"]["setup"] == 5.0
    assert s["seconds"]["productive"] == pytest.approx(j["seconds"]["productive"] + 0.02)
    assert s["seconds"]["redone"] == pytest.approx(0.05)

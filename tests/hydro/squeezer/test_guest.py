"""A real guest process driven by a stand-in rank: it works only inside windows, parks outside them,
computes what it computes alone, survives nothing but gives its trials back when killed or stopped."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import optuna
import pytest
from optuna.trial import TrialState

from megatron_ext.hydro.squeezer.control import PARKED, RUNNING, STOPPED, SUSPENDED
from megatron_ext.hydro.distinct import COUNTED, distinct_sets
from megatron_ext.hydro.squeezer.controller import GuestProcess, Squeezer
from megatron_ext.hydro.squeezer.guest import study_summary
from megatron_ext.hydro.squeezer.replay import read_oplog, replay
from megatron_ext.hydro.tuner import GIVEN_BACK_ATTR
from tests.hydro.squeezer.squeezer_helpers import WindowDriver, tiny_study, wait_for


def _cpu_s(pid: int) -> float:
    """Seconds process ``pid`` has run on a CPU, from the kernel's scheduler statistics."""
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as fh:
        return int(fh.read().split()[0]) / 1e9


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _halted(guest) -> bool:
    """The rank sent SIGSTOP at the last close and has not continued it; the kernel says stopped."""
    stops = guest.ctl.stops_since(0.0)
    return bool(stops) and stops[-1][1] == float("inf") and _proc_state(guest.proc.pid) == "T"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One guest life story: windows until it trained, a SIGKILL in a window, the restart, more
    windows, a stop. Everything the tests below look at is kept."""
    tmp = tmp_path_factory.mktemp("squeeze_guest")
    cfg = tiny_study(tmp, n_trials=40, trial_steps=20)
    log_dir = os.path.join(str(tmp), "logs")
    guest = GuestProcess(tune_config=cfg, rank=0, device="cpu", log_dir=log_dir, budget_bytes=1 << 30)
    sq = Squeezer(guest, margin_s=0.001)
    sq.active = True
    drive = WindowDriver(sq, open_s=0.03, closed_s=0.02, early_every=4)
    out = {"cfg": cfg, "log_dir": log_dir, "guest": guest}
    guest.start()
    first_pid = guest.proc.pid
    assert wait_for(lambda: guest.ready, 120), f"the guest never reached a pause point: {guest.ctl.message}"
    # until it trained and was halted at least once at a window's close (the early closes)
    assert drive.until(lambda: guest.ctl["steps"] >= 25 and guest.ctl.stops_since(0.0), 180), \
        "the guest trained too little in windows, or was never halted at a close"
    # between windows it is parked, halted by the rank (a stop not yet ended by a SIGCONT) or
    # suspended by itself after a storage call
    out["parked_between"] = wait_for(lambda: guest.state in (PARKED, SUSPENDED)
                                     or guest.ctl.stops_since(0.0)[-1][1] == float("inf"), 5)
    out["runs_before_kill"] = guest.ctl.run_intervals()
    out["stops_before_kill"] = guest.ctl.stops_since(0.0)
    out["windows_before_kill"] = list(drive.windows)
    # The guest's own CPU time (the kernel's count, not the squeezer's records) across an interval
    # in which the rank holds it halted, and, for contrast, across a window in which it runs.
    assert drive.until(lambda: _halted(guest), 120), "the rank never held the guest halted after a close"
    pid = guest.proc.pid
    c0 = _cpu_s(pid)
    time.sleep(0.3)
    out["cpu_across_stop"] = (_cpu_s(pid) - c0, _proc_state(pid))
    w = drive._window((10 ** 6 + 1, 3, 1), time.perf_counter(), 0.3)
    sq.window_open(w)
    # The control: the same clock moves while a window is open. Waited for (up to 30 s), not read
    # after a fixed sleep: a nice-19 guest on a loaded host may get little CPU in any 0.3 s.
    c0, deadline = _cpu_s(pid), time.monotonic() + 30
    while _cpu_s(pid) - c0 <= 3e-3 and time.monotonic() < deadline:
        time.sleep(0.05)
    out["cpu_across_window"] = _cpu_s(pid) - c0
    sq.window_close(w, time.perf_counter())
    # SIGKILL while it runs inside a window, in the middle of a trial (not between a trial's tell
    # and the next ask, when it owns no running trial to be marked failed): a trial of this guest is
    # running and its operation log shows at least 5 of its 20 steps still to go, so that the guest
    # cannot reach the trial's tell between this look and the kill (a look at the state alone lost
    # that race now and then on a loaded host).
    study = optuna.load_study(study_name="sq", storage=f"sqlite:///{tmp}/hydro/sq.db")
    oplog = os.path.join(log_dir, f"oplog_rank0_pid{first_pid}.jsonl")

    def mid_trial() -> bool:
        mine = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.user_attrs.get("squeeze_guest", {}).get("pid") == first_pid]
        if guest.state != RUNNING or not mine or not os.path.exists(oplog):
            return False
        steps = [op["ids"] for op in read_oplog(oplog) if op["op"] == "step"]
        return any(sum(n in ids for ids in steps) <= 15 for n in mine)

    w = drive._window((10 ** 6, 3, 1), time.perf_counter(), 5.0)
    sq.window_open(w)
    assert wait_for(mid_trial, 5), "the guest never ran a trial in the long window"
    os.kill(first_pid, signal.SIGKILL)
    guest.proc.wait()
    sq.window_close(w, time.perf_counter())
    out["restart_line"] = guest.check()
    out["first_pid"] = first_pid
    assert wait_for(lambda: guest.ready, 120), f"the restarted guest never reached a pause point: {guest.ctl.message}"
    steps = guest.ctl["steps"]
    assert drive.until(lambda: guest.ctl["steps"] >= steps + 10, 180)
    out["second_pid"] = guest.proc.pid
    guest.stop()
    out["final_state"] = guest.state
    out["stats"] = sq.stats()
    out["trials"] = study.get_trials(deepcopy=False)
    guest.close()
    return out


def test_the_guest_starts_work_only_inside_an_open_window(run):
    windows = run["windows_before_kill"]
    runs = [r for r in run["runs_before_kill"] if r[1] > r[0]]
    assert len(runs) >= 5
    for t0, t1 in runs:
        assert any(w0 <= t0 <= w1 for w0, w1 in windows), (t0, t1)


def test_a_guest_running_at_a_windows_close_is_halted_and_resumed_in_a_later_window(run):
    # the stand-in rank computes between windows: a unit still running at the close is stopped
    stops = run["stops_before_kill"]
    assert stops, "the guest never outlived a window"
    windows = run["windows_before_kill"]
    for s0, s1 in stops[:-1]:
        assert any(abs(s0 - w1) < 1e-9 for _, w1 in windows)         # stopped at a window's close
        assert any(abs(s1 - w0) < 1e-9 for w0, _ in windows)         # resumed at a window's open



def test_a_halted_guest_uses_no_cpu_until_it_is_continued(run):
    # measured on the guest's own CPU clock in the kernel, not derived from the squeezer's records
    halted_s, state = run["cpu_across_stop"]
    assert state == "T" and halted_s <= 1e-3, run["cpu_across_stop"]
    # the same measurement sees the guest work when a window is open (it can fail)
    assert run["cpu_across_window"] > 3e-3, run["cpu_across_window"]


def test_the_guest_is_parked_when_no_window_is_open(run):
    assert run["parked_between"]


def test_a_killed_guest_is_restarted_and_its_trials_are_marked_failed(run):
    assert "died (signal 9)" in run["restart_line"] and "restarted (1 of 3)" in run["restart_line"]
    failed = [t for t in run["trials"] if t.state == TrialState.FAIL
              and t.user_attrs["squeeze_guest"]["pid"] == run["first_pid"]]
    assert failed and all(t.user_attrs[GIVEN_BACK_ATTR] == {"why": "died", "reason": "its guest process died",
                                                            "steps": None, "trial_steps": 20} for t in failed)
    # the second guest trained new trials of its own
    assert any(t.user_attrs.get("squeeze_guest", {}).get("pid") == run["second_pid"] for t in run["trials"])


def test_stop_gives_the_unfinished_trials_back(run):
    assert run["final_state"] == STOPPED
    mine = [t for t in run["trials"] if t.user_attrs.get("squeeze_guest", {}).get("pid") == run["second_pid"]]
    assert all(t.state != TrialState.RUNNING for t in mine)
    stopped = [t for t in mine if t.state == TrialState.FAIL]
    assert stopped
    # each says why and how far it got: the steps its guest's operation log shows it trained
    with open(os.path.join(run["log_dir"], f"oplog_rank0_pid{run['second_pid']}.jsonl"), encoding="utf-8") as fh:
        ops = [json.loads(line) for line in fh]
    for t in stopped:
        trained = sum(t.number in op["ids"] for op in ops if op["op"] == "step")
        given = t.user_attrs[GIVEN_BACK_ATTR]
        assert given == {"why": "end", "steps": trained, "trial_steps": 20,
                         "reason": f"the main job ended before the trial finished ({trained} of 20 steps)"}


def test_the_summary_counts_given_back_trials_apart_from_failures_with_why(run):
    trials = run["trials"]
    line = study_summary(trials)
    died = sum(t.user_attrs.get(GIVEN_BACK_ATTR, {}).get("why") == "died" for t in trials)
    ended = sum(t.user_attrs.get(GIVEN_BACK_ATTR, {}).get("why") == "end" for t in trials)
    assert re.search(rf"{ended + died} given back unfinished \({ended} when the main job ended, at \d+(-\d+)? of "
                     rf"20 steps; {died} when their guest process died\), 0 failed, 0 running", line), line


def test_the_trials_of_a_guest_and_its_restarted_successor_hold_distinct_parameter_sets(run):
    counted = [t for t in run["trials"] if t.state in COUNTED]
    assert len(counted) >= 2 and len(distinct_sets(counted, ["lr"])) == len(counted)


def test_a_study_given_back_whole_says_the_run_was_too_short_for_one_trial():
    """13 of 13 trials handed back at a 150-iteration run's end: before, 13 failed and nothing more."""
    import optuna

    study = optuna.create_study()
    for k in range(13):
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.FAIL, params={"lr": 1e-3 * (k + 1)},
            distributions={"lr": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True)},
            user_attrs={GIVEN_BACK_ATTR: {"why": "end", "steps": 20 + 5 * (k % 5), "trial_steps": 120,
                                          "reason": "the main job ended before the trial finished"}}))
    assert study_summary(study.get_trials()) == (
        "0 complete, 0 pruned, 13 given back unfinished (13 when the main job ended, at 20-40 of 120 steps), "
        "0 failed, 0 running; no trial has finished yet: a trial trains 120 steps (trial_steps) and the furthest "
        "given back reached 40, so the run was too short for one; a longer run (--train-iters) or shorter trials "
        "finish some")


def test_time_in_windows_and_pause_latencies_are_accounted(run):
    s = run["stats"]
    assert s["busy_s"] > 0 and s["windows_used"] > 0
    assert 0 < s["used"] <= 1.0 + 1e-9      # inside windows only: never more than the windows' time
    assert len(s["latencies"]) > 0 and min(s["latencies"]) >= 0
    # every halt at a close is counted, and each (but one the kill or the stop ended) has its latency:
    # the guest's CPU time from the close until it stopped, which is not always 0
    assert s["halts"] >= 1 and s["units_outlived"] >= s["halts"] and s["latencies_lost"] == 0
    assert len(s["latencies"]) >= s["halts"] - 2 and max(s["latencies"]) > 0, (s["halts"], s["latencies"])


@pytest.mark.parametrize("which", ["first_pid", "second_pid"])
def test_what_a_guest_computed_in_windows_equals_a_replay_alone(run, which):
    path = os.path.join(run["log_dir"], f"oplog_rank0_pid{run[which]}.jsonl")
    res = replay(run["cfg"], read_oplog(path))
    assert res["steps"] >= 10
    assert res["max_abs_loss_diff"] <= 1e-6 and res["max_abs_val_diff"] <= 1e-6, res


def test_a_rank_without_room_for_one_trial_gets_no_guest(tmp_path):
    cfg = tiny_study(tmp_path, n_trials=2)
    guest = GuestProcess(tune_config=cfg, rank=3, device="cpu", log_dir=str(tmp_path / "logs"), budget_bytes=1024)
    sq = Squeezer(guest)
    sq.active = True
    drive = WindowDriver(sq, open_s=0.03, closed_s=0.0)
    guest.start()
    try:
        assert drive.until(lambda: guest.proc.poll() is not None, 120), \
            (f"the guest did not end: state {guest.state}, kernel state {_proc_state(guest.proc.pid)}, "
             f"{drive.n} windows, halts {sq.halts}")
        line = guest.check()
        assert line.startswith("guest of rank 3 ended: no room (one trial needs ")
        assert "MiB, the rank leaves 0.0 MiB free (--squeeze-memory-budget-mb" in line
        assert guest.gone and guest.check() is None
    finally:
        guest.stop()
        guest.close()

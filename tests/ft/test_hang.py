"""Hung ranks, live: a rank whose process lives (its heartbeat beats) but whose training thread stops
for good (``--inject-hang RANK:ITER:WHERE``) is named hung -- never stopped, never slow -- by its
own hang watch, with where it stopped and its stack, within the hang timeout plus a poll; then the
policy of a lost rank applies. Jobs through the project's launcher, single-rank straight runs as
the reference curve.

* "compute", "p2p", "data" (PP2 x DP2, ``continue``): the hang in a forward hook, inside a pipeline
  send/receive, in the data fetch; the survivors go on without the hung rank on the straight
  run's curve (a replica survives).
* "tp_collective" (TP2 x DP2, ``continue``): the hang inside a tensor-parallel all-reduce; its TP
  peer, blocked in the same collective, is its victim and is not named.
* "abort" (PP2 x DP2, ``--ft``): exit 75 on every rank, one line naming the rank and the place.
* "grace" (DP2 on 2 ranks, ``continue``): rank 1 hangs in its data fetch while a collective fails on
  rank 0 with no rank lost; rank 0 ends the job (exit 1) before rank 1's hang timeout, and rank 1,
  which cannot follow, is ended ``--ft-grace-s`` later by its own monitor thread with the job's
  code: no job waits forever.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_ext.config.defaults import former_default_flags
from tests.conftest import ROOT, run_python

MODEL = [*former_default_flags(), "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-iters", "0",
         "--log-interval", "1", "--train-iters", "8"]
HANG_TIMEOUT_S = 4.0
FT = ["--ft-heartbeat-interval-s", "0.5", "--ft-heartbeat-timeout-s", "4", "--ft-hang-timeout-s", str(HANG_TIMEOUT_S)]
CONTINUE = ["--ft-on-stop", "continue", "--ft-continue-timeout-s", "60", *FT]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
SCENARIOS = {
    "compute": [*PP2, "--resihp", *CONTINUE, "--inject-hang", "2:5:compute"],
    "p2p": [*PP2, *CONTINUE, "--inject-hang", "1:5:p2p"],
    "data": [*PP2, *CONTINUE, "--inject-hang", "3:5:data"],
    "tp_collective": [*TP2, *CONTINUE, "--inject-hang", "1:5:collective"],
    "abort": [*PP2, "--ft", *FT, "--inject-hang", "2:5:compute"],
    # DP2 on 2 ranks (NPROC); the hang watch at 30 s, after the job's end.
    "grace": ["--ft-on-stop", "continue", "--ft-continue-timeout-s", "60", "--ft-heartbeat-interval-s", "0.5",
              "--ft-heartbeat-timeout-s", "4", "--ft-hang-timeout-s", "30", "--ft-grace-s", "2",
              "--inject-hang", "1:5:data", "--inject-error", "0:5:collective"],
}
NPROC = {"grace": 2}
WHERE = {"compute": "the forward of micro-batch", "p2p": "the forward of micro-batch", "data": "the data fetch",
         "tp_collective": "the forward of micro-batch"}


def rows(path, kind):
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind] if os.path.exists(path) else []


def _launch(out, name: str) -> dict:
    from megatron_ext.ft.launch import job_exit_code, launch_ranks

    d = out / name
    argv = ["pretrain_gpt.py", *MODEL, *SCENARIOS[name], "--metrics-file", str(d / "metrics.jsonl"),
            "--resihp-verdicts-out", str(d / "verdicts.jsonl")]
    ranks = launch_ranks(argv, NPROC.get(name, 4), cwd=ROOT, timeout_s=300, grace_s=10.0)
    return {"codes": [r.returncode for r in ranks], "logs": [r.output for r in ranks], "job": job_exit_code(ranks),
            "metrics": d / "metrics.jsonl", "verdicts": d / "verdicts.jsonl", "stopped": [r.stopped for r in ranks]}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = tmp_path_factory.mktemp("hang")
    ref = out / "straight.jsonl"
    with ThreadPoolExecutor(2) as pool:
        jobs = {name: pool.submit(_launch, out, name) for name in SCENARIOS}
        jobs["straight"] = pool.submit(run_python, "pretrain_gpt.py", *MODEL, "--metrics-file", str(ref))
        result = {name: job.result() for name, job in jobs.items()}
    result["straight"] = {r["iteration"]: r["loss"] for r in rows(ref, "train")}
    return result


def tail(run) -> str:
    return "\n".join("\n".join(log.splitlines()[-30:]) for log in run["logs"])


def hung_line(log: str) -> str:
    return next(line for line in log.splitlines() if line.startswith("ft: rank ") and " hung: " in line)


@pytest.mark.multirank
@pytest.mark.parametrize("name,rank", [("compute", 2), ("p2p", 1), ("data", 3), ("tp_collective", 1)])
def test_a_hung_rank_is_named_hung_where_it_stopped_and_the_survivors_go_on(launches, name, rank):
    run = launches[name]
    assert run["job"] == 0 and run["codes"][rank] == -9, tail(run)
    assert [c for r, c in enumerate(run["codes"]) if r != rank] == [0, 0, 0], tail(run)
    log = run["logs"][rank]
    line = hung_line(log)
    # Named by its own hang watch within the timeout plus a poll, with the last progress point and the
    # innermost frames of its training thread; its stack follows in its log (faulthandler).
    stalled = float(line.split("no progress for ")[1].split(" s")[0])
    assert HANG_TIMEOUT_S <= stalled <= HANG_TIMEOUT_S + 1.0, line  # printed to 0.1 s
    assert f"since {WHERE[name]}" in line and "(iteration 5; hang timeout 4 s)" in line, line
    assert "its training thread is in injection.py:" in line and "hang_forever" in line, line
    assert "Thread 0x" in log and "in hang_forever" in log, "faulthandler's stack dump"
    # Only the hung rank is named: its peers, blocked in collectives with it, are its victims.
    everything = "".join(run["logs"])
    named = {x.split()[2] for x in everything.splitlines() if x.startswith("ft: rank ") and " hung: " in x}
    assert named == {str(rank)}, tail(run)
    assert "is silent for" not in everything and "fail-slow" not in everything, tail(run)
    (change,) = rows(run["metrics"], "layout_change")
    assert change["cause"] == "fail_stop" and change["lost_ranks"] == [rank], change
    assert change["lost_why"][str(rank)].startswith("hung: no progress for "), change
    assert (change["rolled_back"], change["lost_iterations"]) == (5, 0), change
    train = {r["iteration"]: r["loss"] for r in rows(run["metrics"], "train")}
    ref = launches["straight"]
    assert sorted(train) == sorted(ref) == list(range(1, 9))
    assert max(abs(train[i] - ref[i]) / abs(ref[i]) for i in ref) < 1e-5


@pytest.mark.multirank
def test_a_hang_is_a_hang_verdict_for_resihp(launches):
    run = launches["compute"]
    verdicts = rows(run["verdicts"], "hang")
    assert [v["detail"]["launch_rank"] for v in verdicts] == [2] and verdicts[0]["detector"] == "hang", verdicts
    assert not rows(run["verdicts"], "fail_stop") and not rows(run["verdicts"], "fail_slow")
    assert "resihp: injected: rank 2 hung at iteration 5 (compute); named hung: hung: no progress" in "".join(run["logs"])


@pytest.mark.multirank
def test_under_abort_a_hang_ends_the_job_with_75_naming_the_rank_and_the_place(launches):
    run = launches["abort"]
    assert run["job"] == 75 and run["codes"] == [75, 75, 75, 75], tail(run)
    everything = "".join(run["logs"])
    (line,) = [x for x in everything.splitlines() if x.startswith("resihp: aborting the job")]
    assert line.startswith("resihp: aborting the job: rank(s) 2 (hung: no progress for ") and \
        "since the forward of micro-batch" in line and "; resume from the last checkpoint" in line, line


@pytest.mark.multirank
def test_a_rank_that_cannot_follow_the_jobs_end_is_ended_after_the_grace(launches):
    run = launches["grace"]
    # Rank 0's collective fails at the start of iteration 5 while no rank is lost: after its wait for a
    # loss (about 7 s, before rank 1's 30 s hang timeout) it ends the job with 1. Rank 1, hung in its
    # data fetch, cannot follow: its monitor ends it with the job's code once the 2 s grace has
    # passed. The launcher had nothing to stop.
    assert run["job"] == 1 and run["codes"] == [1, 1] and not any(run["stopped"]), tail(run)
    log = run["logs"][1]
    assert "[fault injection] rank 1: hanging at iteration 5 (data)" in log and "hung: no progress" not in log
    assert "ft: rank 1 ends: the job ended (rank 0: RuntimeError: " in log and \
        "2 s ago, and its training thread did not follow" in log, tail(run)

"""What happens when a rank dies, errs or comes back, live: jobs launched through the project's
launcher (the store in the launcher, no torchrun agent) under ``--ft-on-stop continue``, with
injected faults, and single-rank straight runs as the reference curves.

* "dp" (PP2 x DP2): rank 3 is SIGKILLed in its optimizer step of iteration 3 -- the survivors roll
  iteration 3 back and go on (the planner reshapes them; rank 3's stage lives on in its replica),
  the curve stays the straight run's -- and rank 0 one iteration later, at the start of iteration
  4: two losses one iteration apart.
* "pp" (PP4, no replica): rank 2 dies inside the checkpoint save of iteration 4, so its stage has
  no copy in memory: every stage goes back to the checkpoint of iteration 2 and redoes 3 and 4 (the
  model stays one iteration's model). Then rank 3 dies at the start of iteration 7, and rank 1
  while the survivors change their layout for that: a second fault during a regroup, absorbed by the
  next round; rank 0 trains alone to the end.
* "plain" (PP2 x DP2, no ``--resihp``): the core alone -- rank 3 dies in its optimizer step, and
  the core's own chooser keeps the shape: one replica over two survivors, the third a spare; the
  curve stays the straight run's.
* "ds" (``--engine deepspeed`` PP2 x DP2): rank 3 dies in its optimizer step: DP shrink on
  DeepSpeed's engine, the curve within 1e-5.
* "ds_tp" (``--engine deepspeed`` TP2 x DP2): rank 3 dies in its optimizer step: its replica has lost
  a TP rank; the survivors take a layout without it on DeepSpeed's engine, the curve within 1e-5.
* "perm": a live rank permutation after iteration 2 during which rank 1 is SIGKILLed (a loss in the
  middle of a planned re-layout): the survivors recover from the state held before it.
* "error" (PP2 x DP2): an ordinary ``ValueError`` in rank 2's step at iteration 5 ends rank 2 only;
  the others go on; one line names the rank and the exception, no connection-reset traceback.
* "same_error" (DP2 on 2 ranks): the same exception on rank 1 at 5 and on rank 0 at 7: a bug, not a
  lost device -- the job ends on every rank with that one line and exit 1.
* "collective" (DP2 on 2 ranks): a collective fails on rank 1 while no rank is lost: re-raised as
  itself, every rank exits 1 within seconds.
* "regrow" (PP2 x DP2, ``--ft-respawn 1``): rank 3 dies, the survivors shrink, the launcher
  starts rank 3 again, it rejoins at an iteration boundary with its state from its holders, and the
  planner re-expands the layout to use it; the curve through shrink and regrow is the straight run's.
* "no_copy" (PP2 on 2 ranks, no checkpoint): the lost stage has no copy anywhere: exit 75 with one
  line, the only case a restart remains for.
* "keep_newer" (PP2 on 2 ranks, ``--ft-keep-newer-stages``): the lost stage alone comes from
  the checkpoint and the other keeps its newer state, as that option promises.
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_ext.config.defaults import former_default_flags
from tests.conftest import ROOT, run_python

# No dropout (the former defaults): the survivors' layouts compute the straight run's loss.
MODEL = [*former_default_flags(), "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-iters", "0",
         "--log-interval", "1"]
FT_CONTINUE = ["--ft-on-stop", "continue", "--ft-heartbeat-interval-s", "0.5", "--ft-heartbeat-timeout-s", "4",
               "--ft-continue-timeout-s", "60"]
CONTINUE = ["--resihp", *FT_CONTINUE]
PP2 = ["--pipeline-model-parallel-size", "2"]
SCENARIOS = {
    "dp": (4, [*PP2, "--train-iters", "8", "--save-interval", "2", "--inject-stop", "3:3:step", "0:4"], None),
    # No --resihp: the core alone, its own chooser (the same shape over the survivors).
    "plain": (4, [*PP2, "--train-iters", "8", "--save-interval", "100", "--inject-stop", "3:3:step"], None),
    "pp": (4, ["--pipeline-model-parallel-size", "4", "--train-iters", "10", "--save-interval", "2",
               "--inject-stop", "2:4:save", "3:7", "1:7:relayout"], None),
    "ds": (4, ["--engine", "deepspeed", *PP2, "--train-iters", "5", "--lr-decay-iters", "8", "--save-interval", "100",
               "--inject-stop", "3:3:step"], None),
    "ds_tp": (4, ["--engine", "deepspeed", "--tensor-model-parallel-size", "2", "--train-iters", "5",
                  "--lr-decay-iters", "8", "--save-interval", "100", "--inject-stop", "3:3:step"], None),
    # A live rank permutation after iteration 2 (launch ranks 2, 0, 3, 1 take ranks 0..3) in which
    # rank 1 dies once the new process groups exist.
    "perm": (4, [*PP2, "--train-iters", "5", "--lr-decay-iters", "8", "--save-interval", "100",
                 "--inject-stop", "1:3:relayout"], {"FORCE_RANK_ORDER": "2:2,0,3,1"}),
    "error": (4, [*PP2, "--train-iters", "8", "--inject-error", "2:5"], None),
    "same_error": (2, ["--train-iters", "8", "--inject-error", "1:5", "0:7"], None),
    "collective": (2, ["--train-iters", "8", "--inject-error", "1:5:collective"], None),
    "regrow": (4, [*PP2, "--train-iters", "150", "--log-interval", "10", "--inject-stop", "3:3:step",
                   "--ft-respawn", "1"], None),
    # PP2 on 2 ranks, no replica and no checkpoint: what truly cannot continue (exit 75).
    "no_copy": (2, [*PP2, "--train-iters", "8", "--inject-stop", "1:4"], None),
    # PP2 on 2 ranks (no replica), the explicit option: only the lost stage from the checkpoint.
    "keep_newer": (2, [*PP2, "--train-iters", "8", "--save-interval", "2", "--inject-stop", "1:6",
                       "--ft-keep-newer-stages"], None),
}


def rows(path, kind):
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind] if os.path.exists(path) else []


def curve(path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in rows(path, "train")}


# Two launches at a time: most of a scenario is waiting (a heartbeat timeout, a respawned rank's
# imports, a survivor's continue timeout), and each launch has its own store, port and directory.
# The longest first, so that the short ones fill in beside it.
CONCURRENT = 2
LONGEST_FIRST = ("regrow", "pp", "dp", "ds", "ds_tp", "perm", "plain", "error", "keep_newer", "same_error",
                 "collective", "no_copy")
assert sorted(LONGEST_FIRST) == sorted(SCENARIOS)
STRAIGHT = (("straight150", 150, 150), ("straight10", 10, 10), ("straight8", 8, 8))


def _launch(out, name: str) -> dict:
    from megatron_ext.ft.launch import job_exit_code, launch_ranks

    nproc, args, env = SCENARIOS[name]
    d = out / name
    script = "tests/runtime/permute_scenario.py" if name == "perm" else "pretrain_gpt.py"
    save = [] if name == "no_copy" else ["--save", str(d / "ck")]
    argv = [script, *MODEL, *(FT_CONTINUE if name == "plain" else CONTINUE), *args, *save,
            "--metrics-file", str(d / "metrics.jsonl"), "--resihp-verdicts-out", str(d / "verdicts.jsonl")]
    t0 = time.monotonic()
    ranks = launch_ranks(argv, nproc, cwd=ROOT, timeout_s=600, env=env, respawn=int(args[-1]) if
                         "--ft-respawn" in args else 0)
    return {"dir": d, "codes": [r.returncode for r in ranks], "logs": [r.output for r in ranks],
            "incarnations": [r.incarnations for r in ranks], "job": job_exit_code(ranks),
            "wall_s": time.monotonic() - t0, "metrics": d / "metrics.jsonl"}


def _straight(out, iters: int, decay: int) -> dict[int, float]:
    """A single-rank straight run of the same model and data, with a launch's LR schedule."""
    ref = out / f"straight{iters}.jsonl"
    run_python("pretrain_gpt.py", *MODEL, "--train-iters", str(iters), "--lr-decay-iters", str(decay),
               "--metrics-file", str(ref))
    return curve(ref)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = tmp_path_factory.mktemp("recovery")
    with ThreadPoolExecutor(CONCURRENT) as pool:
        jobs = {name: pool.submit(_launch, out, name) for name in LONGEST_FIRST}
        jobs.update({name: pool.submit(_straight, out, iters, decay) for name, iters, decay in STRAIGHT})
        result = {name: job.result() for name, job in jobs.items()}
    # --train-iters 5 --lr-decay-iters 8 is the first five iterations of straight8 (same schedule,
    # same data order): one launch fewer.
    result["straight5"] = {i: loss for i, loss in result["straight8"].items() if i <= 5}
    return result


def tail(run) -> str:
    return "\n".join("\n".join(log.splitlines()[-25:]) for log in run["logs"])


def max_rel(live: dict[int, float], ref: dict[int, float]) -> float:
    assert sorted(live) == sorted(ref), (sorted(live), sorted(ref))
    return max(abs(live[i] - ref[i]) / abs(ref[i]) for i in ref)


def changes(run) -> list[dict]:
    return rows(run["metrics"], "layout_change")


CONNECTION_NOISE = ("Connection closed by peer", "Connection reset by peer", "Traceback")


@pytest.mark.multirank
def test_two_ranks_lost_one_iteration_apart_cost_no_iteration(launches):
    run = launches["dp"]
    assert run["codes"] == [-9, 0, 0, -9] and run["job"] == 0, tail(run)
    first, second = changes(run)
    # Nobody had updated for iteration 3 (the ledger never committed it): rolled back, redone in the
    # survivors' layout, whose state came from the lost rank's replica.
    assert (first["cause"], first["lost_ranks"], first["from"], first["iteration"], first["rolled_back"],
            first["lost_iterations"]) == ("fail_stop", [3], "tp1pp2dp2", 2, 3, 0)
    assert sorted(first["members"]) == [0, 1, 2] and first["generation"] == 1
    assert (second["lost_ranks"], second["iteration"], second["rolled_back"], second["lost_iterations"],
            second["generation"]) == ([0], 3, 4, 0, 2)
    assert "0" not in map(str, second["members"]) and second["restored_from_checkpoint"] == []
    assert [r["iteration"] for r in rows(run["metrics"], "train")] == list(range(1, 9))
    assert max_rel(curve(run["metrics"]), launches["straight8"]) < 1e-5
    log = "".join(run["logs"])
    assert ("layout change (lost rank(s) 3 (killed by signal 9)): tp1pp2dp2 -> " in log and
            "at iteration 2; iteration 3 rolled back; 0 iteration(s) lost" in log), tail(run)
    assert not any(n in log for n in CONNECTION_NOISE), tail(run)


@pytest.mark.multirank
def test_a_plain_job_without_resihp_survives_a_lost_rank_with_the_cores_own_chooser(launches):
    run = launches["plain"]
    assert run["codes"] == [0, 0, 0, -9] and run["job"] == 0, tail(run)
    (change,) = changes(run)
    # The whole replica (ranks 0 and 2) trains on; rank 1, whose stage-1 partner is gone, is a spare.
    assert (change["cause"], change["lost_ranks"], change["from"], change["iteration"], change["rolled_back"],
            change["members"]) == ("fail_stop", [3], "tp1pp2dp2", 2, 3, [0, 2])
    assert [r["iteration"] for r in rows(run["metrics"], "train")] == list(range(1, 9))
    assert max_rel(curve(run["metrics"]), launches["straight8"]) < 1e-5
    log = "".join(run["logs"])
    assert "tp1pp2dp2 -> tp1pp2dp1 on rank(s) 0,2 at iteration 2; iteration 3 rolled back" in log, tail(run)
    assert "ft: rank 1 has no place in the next layout (tp1pp2dp1 on rank(s) 0,2); it waits as a spare" in log
    assert not any(n in log for n in CONNECTION_NOISE), tail(run)


@pytest.mark.multirank
def test_a_stage_without_copy_rolls_every_stage_back_and_a_second_fault_in_a_regroup_is_absorbed(launches):
    run = launches["pp"]
    assert run["codes"] == [0, -9, -9, -9] and run["job"] == 0, tail(run)
    assert "[fault injection] rank 2: stopping at iteration 4 (save) (SIGKILL)" in run["logs"][2]
    assert "[fault injection] rank 1: stopping at iteration 7 (relayout) (SIGKILL)" in run["logs"][1]
    first, *_, last = changes(run)
    # The save of iteration 4 never completed and stage 2 had no replica: every stage back to the
    # checkpoint of iteration 2 (the model stays one iteration's model), iterations 3 and 4 redone.
    assert (first["lost_ranks"], first["from"], first["checkpoint_iteration"], first["rolled_back_to"],
            first["lost_iterations"]) == ([2], "tp1pp4dp1", 2, 2, 2), first
    assert first["restored_from_checkpoint"]
    # Rank 3 at the start of iteration 7, then rank 1 inside the change that followed: the next
    # round started without it, from the same held state; rank 0 trained on alone to the end.
    assert last["members"] == [0] and last["generation"] >= 3 and last["lost_iterations"] == 0, changes(run)
    assert sorted({m for c in changes(run)[1:] for m in c["lost_ranks"]}) == [1, 3]
    assert "round" in run["logs"][0] and "starts from the state held before it" in run["logs"][0]
    # One row per iteration: the redone ones replaced the rolled-back rows (as a resume does).
    assert [r["iteration"] for r in rows(run["metrics"], "train")] == list(range(1, 11))
    assert max_rel(curve(run["metrics"]), launches["straight10"]) < 1e-5
    assert (run["dir"] / "ck" / "latest_checkpointed_iteration.txt").read_text() == "10"


@pytest.mark.multirank
def test_a_loss_inside_a_planned_relayout_recovers_from_the_state_held_before_it(launches):
    run = launches["perm"]
    assert run["codes"] == [0, -9, 0, 0] and run["job"] == 0, tail(run)
    assert "[fault injection] rank 1: stopping at iteration 3 (relayout) (SIGKILL)" in run["logs"][1]
    (change,) = changes(run)
    assert (change["cause"], change["lost_ranks"], change["iteration"], change["lost_iterations"]) == (
        "fail_stop", [1], 2, 0)
    assert 1 not in change["members"] and change["generation"] == 2, "the permutation's generation was 1"
    assert max_rel(curve(run["metrics"]), launches["straight5"]) < 1e-5


@pytest.mark.multirank
def test_the_deepspeed_engine_continues_by_dp_shrink(launches):
    run = launches["ds"]
    assert run["job"] == 0 and run["codes"][3] == -9, tail(run)
    (change,) = changes(run)
    # The survivors' layout is the planner's (scaled to the measured iteration times: PP2 x DP1 or
    # PP3 on this host, both built by DeepSpeed's PipelineModule over the new world).
    assert change["from"] == "deepspeed pp2dp2" and change["to"] in ("deepspeed pp2dp1", "deepspeed pp3dp1"), change
    assert 3 not in change["members"] and change["lost_ranks"] == [3]
    assert (change["rolled_back"], change["lost_iterations"]) == (3, 0)
    assert max_rel(curve(run["metrics"]), launches["straight5"]) < 1e-5


@pytest.mark.multirank
def test_deepspeed_with_tensor_parallelism_continues_without_the_lost_rank(launches):
    run = launches["ds_tp"]
    assert run["job"] == 0 and run["codes"][3] == -9, tail(run)
    (change,) = changes(run)
    # rank 3's TP peer (rank 2) cannot form a TP2 replica alone: the planner's layout over the
    # survivors, built by DeepSpeed's PipelineModule over the new world
    assert change["from"] == "deepspeed tp2pp1dp2" and change["to"].startswith("deepspeed "), change
    assert 3 not in change["members"] and change["lost_ranks"] == [3]
    assert (change["rolled_back"], change["lost_iterations"]) == (3, 0)
    assert max_rel(curve(run["metrics"]), launches["straight5"]) < 1e-5


@pytest.mark.multirank
def test_an_ordinary_error_ends_only_its_rank_and_says_so_in_one_line(launches):
    run = launches["error"]
    assert run["codes"] == [0, 0, 1, 0] and run["job"] == 0, tail(run)
    own = run["logs"][2]
    first = next(line for line in own.splitlines() if line.startswith("pretrain_gpt.py:"))
    assert first == ("pretrain_gpt.py: error: rank 2 lost: ValueError: injected error (iteration 5); the other "
                     "ranks go on without it")
    assert own.count("Traceback") == 1, "its own traceback, once"
    others = "".join(log for i, log in enumerate(run["logs"]) if i != 2)
    assert not any(n in others for n in CONNECTION_NOISE), tail(run)
    assert "layout change (lost rank(s) 2 (ValueError: injected error))" in others
    (change,) = changes(run)
    assert (change["lost_ranks"], change["lost_why"], change["rolled_back"], change["lost_iterations"]) == (
        [2], {"2": "ValueError: injected error"}, 5, 0)
    assert max_rel(curve(run["metrics"]), launches["straight8"]) < 1e-5
    verdicts = [json.loads(line) for line in open(run["dir"] / "verdicts.jsonl")]
    assert [(v["kind"], v["detail"]["launch_rank"], v["detector"]) for v in verdicts] == [("fail_stop", 2, "self")]


@pytest.mark.multirank
def test_the_same_error_on_a_second_rank_ends_the_job_with_one_line(launches):
    run = launches["same_error"]
    assert run["codes"] == [1, 1] and run["job"] == 1, tail(run)
    # Rank 1 ended first (lost: the other went on); rank 0 then ended on the same error, which ends
    # the job. One line each, from the rank itself.
    assert [line for line in run["logs"][1].splitlines() if line.startswith("pretrain_gpt.py:")] == [
        "pretrain_gpt.py: error: rank 1 lost: ValueError: injected error (iteration 5); the other ranks go on "
        "without it"]
    assert [line for line in run["logs"][0].splitlines() if line.startswith("pretrain_gpt.py:")] == [
        "pretrain_gpt.py: error: rank 0: ValueError: injected error (iteration 7; rank 1 ended on the same error: a "
        "bug, not a lost device)"]


@pytest.mark.multirank
def test_a_collective_failing_with_no_rank_lost_is_reraised_on_every_rank_within_seconds(launches):
    run = launches["collective"]
    assert run["codes"] == [1, 1] and run["job"] == 1, tail(run)
    lines = [line for log in run["logs"] for line in log.splitlines() if line.startswith("pretrain_gpt.py:")]
    assert lines == ["pretrain_gpt.py: error: rank 1: RuntimeError: [gloo/transport/tcp/pair.cc] Connection closed "
                     "by peer (injected: a collective failing while no rank is lost) (no rank was lost, so the job "
                     "cannot continue past it)"]
    assert "Traceback" not in run["logs"][0], "the other rank ends quietly: the error is said once"
    assert changes(run) == [], "nothing was torn down or re-laid out"


@pytest.mark.multirank
def test_a_replaced_rank_rejoins_and_the_curve_is_the_straight_runs(launches):
    run = launches["regrow"]
    assert run["job"] == 0 and run["incarnations"][3] == [-9, 0], tail(run)
    shrink, grow = changes(run)
    assert (shrink["cause"], shrink["lost_ranks"], grow["cause"], grow["joined_ranks"]) == (
        "fail_stop", [3], "grow", [3])
    assert 3 not in shrink["members"] and 3 in grow["members"] and len(grow["members"]) == 4, (shrink, grow)
    assert grow["iteration"] < 150 and grow["lost_iterations"] == 0
    # Its state came point to point from its holders: it held nothing and received what it needs.
    assert [r["iteration"] for r in rows(run["metrics"], "train")] == list(range(1, 151))
    assert max_rel(curve(run["metrics"]), launches["straight150"]) < 1e-5
    assert "layout change (rank(s) 3 joined)" in "".join(run["logs"])


@pytest.mark.multirank
def test_keep_newer_stages_takes_only_the_lost_stage_from_the_checkpoint(launches):
    run = launches["keep_newer"]
    assert run["codes"] == [0, -9] and run["job"] == 0, tail(run)
    (change,) = changes(run)
    # Iteration 5 was committed, the checkpoint is of iteration 4: stage 1's shards from it, stage 0
    # keeps its state of iteration 5, nothing is redone (the stages are from different iterations:
    # one iteration lost on stage 1, counted).
    assert (change["iteration"], change["checkpoint_iteration"], change["rolled_back_to"]) == (5, 4, None), change
    assert change["restored_from_checkpoint"] and change["lost_iterations"] == 1
    assert [r["iteration"] for r in rows(run["metrics"], "train")] == list(range(1, 9))
    assert "the other stages kept theirs" in run["logs"][0]


@pytest.mark.multirank
def test_a_shard_with_no_copy_anywhere_is_the_one_restart(launches):
    run = launches["no_copy"]
    assert run["codes"] == [75, -9] and run["job"] == 75, tail(run)
    lines = [line for line in run["logs"][0].splitlines() if line.startswith("resihp: cannot continue")]
    assert len(lines) == 1 and "lost rank(s) 1:" in lines[0] and "there is no checkpoint (--save)" in lines[0], tail(run)
    assert lines[0].endswith("restart from the last checkpoint (none was saved: --save DIR)")
    assert changes(run) == []

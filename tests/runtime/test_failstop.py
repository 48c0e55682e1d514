"""--resihp-on-stop continue: survivors of SIGKILLed ranks keep training in the same processes.

Three 4-rank launches through the project's launcher (the store in the launcher, no torchrun agent),
several faults in two of them, plus a single-rank straight run as the reference curve:

* launch "dp": PP2 x DP2. Rank 3 (last stage) dies in its optimizer step of iteration 3, before
  the update: the survivors roll iteration 3 back, shrink DP (its stage has a replica in memory)
  and redo it; the curve stays the straight run's. Then rank 0 (rank 0, first stage) dies at the
  start of iteration 6: stage 0 has no replica left, so its shards come from the checkpoint of
  iteration 4 while stage 1 keeps its live state (1 iteration lost); the last rank trains alone.
* launch "pp": PP4. Rank 2 dies inside the checkpoint save of iteration 4: its stage comes from the
  checkpoint of iteration 2 (2 lost), the survivors re-save iteration 4 on PP3. Rank 3 dies at the
  start of iteration 7 and rank 1 while the survivors regroup from that: a second fault during a
  re-layout, which ends the job with a restart message instead of a hang.
* launch "ds": ``--engine deepspeed`` PP2 x DP2, rank 3 dies in its optimizer step of iteration 3:
  DP shrink on DeepSpeed's engine (PipelineModule and grid rebuilt over the new world).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from tests.conftest import ROOT, run_python

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-iters", "0", "--log-interval", "1"]
CONTINUE = ["--resihp", "--resihp-on-stop", "continue", "--resihp-heartbeat-interval-s", "0.5",
            "--resihp-heartbeat-timeout-s", "4", "--resihp-continue-timeout-s", "60"]


def rows(path, kind):
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind] if os.path.exists(path) else []


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    from megatron_ext.runtime.launch import launch_ranks

    out = tmp_path_factory.mktemp("failstop")
    runs = {
        "dp": (["--pipeline-model-parallel-size", "2", "--train-iters", "8", "--save-interval", "2",
                "--inject-stop", "3:3:step", "0:6"]),
        "pp": (["--pipeline-model-parallel-size", "4", "--train-iters", "10", "--save-interval", "2",
                "--inject-stop", "2:4:save", "3:7", "1:7:relayout"]),
        "ds": (["--engine", "deepspeed", "--pipeline-model-parallel-size", "2", "--train-iters", "5",
                "--lr-decay-iters", "8", "--save-interval", "100", "--inject-stop", "3:3:step"]),
    }
    # A live rank permutation after iteration 2 (launch ranks 2, 0, 3, 1 take ranks 0..3), then rank 1
    # (now stage 1 of replica 1) dies in its optimizer step of iteration 4.
    runs["perm"] = (["--pipeline-model-parallel-size", "2", "--train-iters", "5", "--lr-decay-iters", "8",
                     "--save-interval", "100", "--inject-stop", "1:4:step"])
    result = {}
    for name, args in runs.items():
        d = out / name
        script, env = "pretrain_gpt.py", None
        if name == "perm":
            script, env = "tests/runtime/permute_scenario.py", {"FORCE_RANK_ORDER": "2:2,0,3,1"}
        argv = [script, *MODEL, *CONTINUE, *args, "--save", str(d / "ck"),
                "--metrics-file", str(d / "metrics.jsonl"), "--resihp-verdicts-out", str(d / "verdicts.jsonl")]
        ranks = launch_ranks(argv, 4, cwd=ROOT, timeout_s=600, env=env)
        result[name] = {"dir": d, "codes": [r.returncode for r in ranks], "logs": [r.output for r in ranks]}
    ref = out / "straight.jsonl"
    # The same LR schedule as the 8-iteration launch, 5 iterations of it.
    run_python("pretrain_gpt.py", *MODEL, "--train-iters", "5", "--lr-decay-iters", "8", "--metrics-file", str(ref))
    result["straight"] = {r["iteration"]: r["loss"] for r in rows(ref, "train")}
    return result


def tail(run) -> str:
    return "\n".join("\n".join(log.splitlines()[-25:]) for log in run["logs"])


@pytest.mark.multirank
def test_survivors_train_on_after_the_last_stage_dies_in_its_optimizer_step(launches):
    run = launches["dp"]
    # Rank 3 and rank 0 were killed; rank 1 left as a spare after the first loss (DP shrink), rank 2
    # trained to the end.
    assert run["codes"] == [-9, 0, 0, -9], tail(run)
    assert "[fault injection] rank 3: stopping at iteration 3 (step) (SIGKILL)" in run["logs"][3]
    assert "rank 1 has no place in the survivors' layout" in run["logs"][1]
    first, second = rows(run["dir"] / "metrics.jsonl", "fail_stop_continue")
    assert (first["lost_ranks"], first["from"], first["to"], first["members"]) == ([3], "tp1pp2dp2", "tp1pp2dp1", [0, 2])
    # Nobody had updated for iteration 3 (the ledger never committed it): it is redone, nothing lost.
    assert (first["iteration"], first["rolled_back"], first["lost_iterations"]) == (2, 3, 0)
    assert first["restored_from_checkpoint"] == []
    trained = [r["iteration"] for r in rows(run["dir"] / "metrics.jsonl", "train")]
    assert trained == list(range(1, 9)), "every iteration logged once, none skipped"


@pytest.mark.multirank
def test_a_rolled_back_iteration_keeps_the_straight_curve(launches):
    # State of the lost rank came from its DP replica in memory, the half-done iteration was rolled
    # back and redone on the same samples: the curve through the loss is the straight run's.
    live = {r["iteration"]: r["loss"] for r in rows(launches["dp"]["dir"] / "metrics.jsonl", "train")}
    ref = launches["straight"]
    assert sorted(ref) == [1, 2, 3, 4, 5]
    assert max(abs(live[i] - ref[i]) / ref[i] for i in ref) < 1e-5


@pytest.mark.multirank
def test_a_stage_without_replica_comes_from_the_checkpoint_and_the_log_counts_the_loss(launches):
    run = launches["dp"]
    _, second = rows(run["dir"] / "metrics.jsonl", "fail_stop_continue")
    assert (second["lost_ranks"], second["to"], second["members"]) == ([0], "tp1pp1dp1", [2])
    assert (second["iteration"], second["checkpoint_iteration"], second["lost_iterations"]) == (5, 4, 1)
    assert second["restored_from_checkpoint"], "stage 0's tensors should come from the checkpoint"
    assert second["generation"] == 2
    assert ("resihp: continuing without rank(s) 0 after iteration 5: tp1pp2dp1 -> tp1pp1dp1 on rank(s) 2; "
            "iteration 6 rolled back, 1 iteration(s) lost") in run["logs"][2]


@pytest.mark.multirank
def test_a_rank_lost_inside_a_checkpoint_save(launches):
    run = launches["pp"]
    first = rows(run["dir"] / "metrics.jsonl", "fail_stop_continue")[0]
    assert (first["lost_ranks"], first["from"], first["to"]) == ([2], "tp1pp4dp1", "tp1pp3dp1"), tail(run)
    # The save of iteration 4 never completed: stage 2's state is the checkpoint of iteration 2's.
    assert (first["iteration"], first["checkpoint_iteration"], first["lost_iterations"]) == (4, 2, 2)
    meta = json.loads((run["dir"] / "ck" / "iter_0000004" / "meta.json").read_text())
    assert meta["world_size"] == 3 and meta["layout"]["pp"] == 3, "the survivors saved iteration 4 again"


@pytest.mark.multirank
def test_a_second_fault_during_the_regroup_ends_with_a_restart_message_not_a_hang(launches):
    run = launches["pp"]
    assert run["codes"] == [75, -9, -9, -9], tail(run)
    assert "[fault injection] rank 1: stopping at iteration 7 (relayout) (SIGKILL)" in run["logs"][1]
    ck = run["dir"] / "ck"
    assert (f"resihp: a second fault during the re-layout (rank 1 of generation 1 is gone too): cannot "
            f"continue; restart from the last checkpoint (--load {ck})") in run["logs"][0]
    assert (ck / "latest").read_text().strip() == "iter_0000006"


@pytest.mark.multirank
def test_a_rank_permutation_under_the_launcher_then_a_fail_stop(launches):
    # The permutation meets in the launcher's store (generation 1); the loss after it is settled in
    # that generation's ledger and the survivors regroup by launch rank: nothing lost, and the
    # curve through both is the straight run's.
    run = launches["perm"]
    assert run["codes"][1] == -9 and all(c == 0 for i, c in enumerate(run["codes"]) if i != 1), tail(run)
    metrics = run["dir"] / "metrics.jsonl"
    (moved,) = rows(metrics, "relayout")
    assert (moved["iteration"], moved["rank_order"], moved["members"]) == (2, [2, 0, 3, 1], [2, 0, 3, 1])
    (cont,) = rows(metrics, "fail_stop_continue")
    assert cont["lost_ranks"] == [1] and cont["generation"] == 2, cont
    assert (cont["rolled_back"], cont["lost_iterations"], cont["restored_from_checkpoint"]) == (4, 0, [])
    assert 1 not in cont["members"] and 3 in cont["members"], "stage 1 lives on in its replica (launch rank 3)"
    live = {r["iteration"]: r["loss"] for r in rows(metrics, "train")}
    ref = launches["straight"]
    assert sorted(live) == sorted(ref) == [1, 2, 3, 4, 5]
    assert max(abs(live[i] - ref[i]) / ref[i] for i in ref) < 1e-5


@pytest.mark.multirank
def test_the_deepspeed_engine_continues_by_dp_shrink(launches):
    run = launches["ds"]
    assert run["codes"] == [0, 0, 0, -9], tail(run)
    (cont,) = rows(run["dir"] / "metrics.jsonl", "fail_stop_continue")
    assert (cont["from"], cont["to"], cont["members"]) == ("deepspeed pp2dp2", "deepspeed pp2dp1", [0, 2])
    assert (cont["rolled_back"], cont["lost_iterations"]) == (3, 0)
    live = {r["iteration"]: r["loss"] for r in rows(run["dir"] / "metrics.jsonl", "train")}
    ref = launches["straight"]
    assert sorted(live) == sorted(ref)
    assert max(abs(live[i] - ref[i]) / ref[i] for i in ref) < 1e-5


# --- the pieces, without a launch ----------------------------------------------------------

@pytest.fixture
def store():
    from megatron_ext.runtime.store import connect, host

    server, addr = host()
    yield server, addr, connect
    del server


def test_an_iteration_commits_only_when_every_rank_voted(store):
    from megatron_ext.runtime.failover import CommitLedger, RankLost

    _, addr, connect = store
    lost = {"any": False}
    ledgers = [CommitLedger(connect(addr, timeout_s=5), world_size=3, timeout_s=5, lost=lambda: lost["any"])
               for _ in range(3)]
    outcome = {}

    def vote(r: int, it: int) -> None:
        try:
            ledgers[r].vote(it)
            outcome[(r, it)] = "commit"
        except RankLost:
            outcome[(r, it)] = "abort"

    threads = [threading.Thread(target=vote, args=(r, 1)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {outcome[(r, 1)] for r in range(3)} == {"commit"}
    # Iteration 2: rank 2 never votes (it is gone): the two that did read 'abort', and a late
    # settle of the lost rank's iteration agrees.
    threads = [threading.Thread(target=vote, args=(r, 2)) for r in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    lost["any"] = True
    for t in threads:
        t.join()
    assert outcome[(0, 2)] == outcome[(1, 2)] == "abort"
    assert ledgers[2].settle(2) is False
    assert ledgers[0].settle(1) is True  # a decided iteration stays decided


def test_a_late_vote_after_an_abort_reads_the_abort(store):
    # One rank aborts (it saw the loss) before the last vote arrives; the first decision wins for all.
    from megatron_ext.runtime.failover import CommitLedger, RankLost

    _, addr, connect = store
    a = CommitLedger(connect(addr, timeout_s=5), world_size=2, timeout_s=5, lost=lambda: True)
    b = CommitLedger(connect(addr, timeout_s=5), world_size=2, timeout_s=5, lost=lambda: False)
    with pytest.raises(RankLost, match="iteration 7 abandoned before its update"):
        a.vote(7)
    with pytest.raises(RankLost):
        b.vote(7)  # completes the count, but the decision is already 'abort'


def test_join_waits_for_every_old_member_or_its_loss(store):
    from megatron_ext.runtime.failover import RestartNeeded, join

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    got = {}
    t = threading.Thread(target=lambda: got.update(join(connect(addr, timeout_s=5), generation=1, member=0,
                                                         info={"iteration": 4}, expected=[0, 1, 2],
                                                         lost=lambda: {2}, timeout_s=10)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive(), "rank 1 is neither joined nor lost yet"
    join(base, generation=1, member=1, info={"iteration": 4}, expected=[0, 1, 2], lost=lambda: {2}, timeout_s=10)
    t.join(10)
    assert sorted(got) == [0, 1] and got[1] == {"iteration": 4}
    with pytest.raises(RestartNeeded, match=r"rank\(s\) 1, 2 neither rejoined nor were named lost within 0 s"):
        join(base, generation=2, member=0, info={}, expected=[0, 1, 2], lost=set, timeout_s=0.1)


def test_aborting_connections_unblocks_a_pending_receive(store):
    # gloo cannot abort a collective; shutting its sockets down is what gets a survivor out of one.
    from megatron_ext.runtime.failover import abort_connections

    _, addr, connect = store
    keep = connect(addr, timeout_s=5)  # a store connection must survive it
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("data", client.recv(10)))
    t.start()
    time.sleep(0.1)
    assert abort_connections(addr) >= 1
    t.join(5)
    assert not t.is_alive() and got["data"] == b""
    keep.set("still", "here")
    assert keep.get("still") == b"here"
    for s in (client, peer, server):
        s.close()


def test_the_job_exit_code_counts_lost_ranks_as_survivable():
    from megatron_ext.runtime.launch import job_exit_code

    assert job_exit_code([0, 0, -9, 0]) == 0
    assert job_exit_code([75, -9, -9, -9]) == 75
    assert job_exit_code([-9, -9]) == 1
    assert job_exit_code([0, 2]) == 2


@pytest.mark.parametrize("values,message", [
    ({"resihp_on_stop": "continue"}, "--resihp-on-stop continue needs --resihp (its heartbeat names the lost rank)"),
    ({"resihp": True, "resihp_on_stop": "continue", "use_distributed_optimizer": True},
     "--resihp-on-stop continue cannot be used with --use-distributed-optimizer: its optimizer state is sharded "
     "over the data-parallel ranks, so a lost rank's part has no copy in memory; drop the flag, or use "
     "--resihp-on-stop abort and resume with --load"),
    ({"resihp": True, "resihp_on_stop": "continue", "device": "cuda"},
     "--resihp-on-stop continue is built for gloo ranks: a survivor's NCCL collective with a lost rank is not "
     "unblocked yet (that needs the process group's abort); use --distributed-backend gloo, or --resihp-on-stop "
     "abort and resume with --load"),
])
def test_continue_is_refused_where_it_cannot_work(values, message):
    from megatron_ext.config.base import ConfigError
    from megatron_ext.config.run import config_from_values
    from megatron_ext.resihp.failstop import check

    with pytest.raises(ConfigError) as err:
        check(config_from_values(values), 4, launcher=True)
    assert str(err.value) == message


def test_continue_under_a_launcher_without_an_outside_store_is_one_line(monkeypatch):
    # Under torchrun (rank 0 hosts the store, the agent stops every rank when one dies) it cannot work.
    from megatron_ext.config.base import ConfigError
    from megatron_ext.config.run import config_from_values
    from megatron_ext.resihp.failstop import STORE_NEEDED, check

    monkeypatch.delenv("MEGATRON_EXT_STORE", raising=False)
    cfg = config_from_values({"resihp": True, "resihp_on_stop": "continue"})
    with pytest.raises(ConfigError) as err:
        check(cfg, 4, launcher=False)
    assert str(err.value) == STORE_NEEDED
    assert "\n" not in STORE_NEEDED and "--nproc-per-node" in STORE_NEEDED and "srun" in STORE_NEEDED
    check(cfg, 1, launcher=False)  # a lone process has nobody to lose
    monkeypatch.setenv("MEGATRON_EXT_STORE", "127.0.0.1:1")
    check(cfg, 4, launcher=False)

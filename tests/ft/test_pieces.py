"""The fault-tolerance core's pieces without a launch: the commit ledger's races, the rounds'
rendezvous, exit and error reports, the socket shutdown, the job's exit code, the refusals."""
from __future__ import annotations

import socket
import threading
import time

import pytest

@pytest.fixture
def store():
    from megatron_ext.ft.store import connect, host

    server, addr = host()
    yield server, addr, connect
    del server


def test_an_iteration_commits_only_when_every_rank_voted(store):
    from megatron_ext.ft.errors import RankLost
    from megatron_ext.ft.ledger import CommitLedger

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
    from megatron_ext.ft.errors import RankLost
    from megatron_ext.ft.ledger import CommitLedger

    _, addr, connect = store
    a = CommitLedger(connect(addr, timeout_s=5), world_size=2, timeout_s=5, lost=lambda: True)
    b = CommitLedger(connect(addr, timeout_s=5), world_size=2, timeout_s=5, lost=lambda: False)
    with pytest.raises(RankLost, match="iteration 7 abandoned before its update"):
        a.vote(7)
    with pytest.raises(RankLost):
        b.vote(7)  # completes the count, but the decision is already 'abort'


def test_join_waits_for_every_old_member_or_its_loss(store):
    from megatron_ext.ft.errors import RestartNeeded
    from megatron_ext.ft.membership import join

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    got = {}
    t = threading.Thread(target=lambda: got.update(join(connect(addr, timeout_s=5), round_=1, member=0,
                                                         info={"iteration": 4}, expected=[0, 1, 2],
                                                         lost=lambda: {2}, timeout_s=10)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive(), "rank 1 is neither joined nor lost yet"
    join(base, round_=1, member=1, info={"iteration": 4}, expected=[0, 1, 2], lost=lambda: {2}, timeout_s=10)
    t.join(10)
    assert sorted(got) == [0, 1] and got[1] == {"iteration": 4}
    with pytest.raises(RestartNeeded, match=r"rank\(s\) 1, 2 neither rejoined nor were named lost within 0 s"):
        join(base, round_=2, member=0, info={}, expected=[0, 1, 2], lost=set, timeout_s=0.1)


def test_aborting_connections_unblocks_a_pending_receive(store):
    # gloo cannot abort a collective; shutting its sockets down is what gets a survivor out of one.
    from megatron_ext.ft.unblock import abort_connections

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
    from megatron_ext.ft.launch import RankResult, job_exit_code

    def job(*codes, lost=(), end=None):
        return [RankResult(r, c, "", [c], lost=c < 0 or r in lost, job_end=end) for r, c in enumerate(codes)]

    assert job_exit_code(job(0, 0, -9, 0)) == 0
    assert job_exit_code(job(0, 0, 1, 0, lost=(2,))) == 0, "a rank that ended on its own exception is lost"
    assert job_exit_code(job(0, 0, 1, 0)) == 1, "exit 1 without its own report is a failure"
    assert job_exit_code(job(75, -9, -9, -9, end={"code": 75, "message": "x", "by": 0})) == 75
    assert job_exit_code(job(1, 1, 1, end={"code": 1, "message": "x", "by": 2})) == 1
    assert job_exit_code(job(-9, -9)) == 1
    assert job_exit_code(job(0, 2)) == 2


def test_a_vote_commits_and_says_when_a_replacement_arrived(store):
    # The rank completing the count writes the decision: every rank reads "grow" at the same
    # iteration once a replacement registered past what the generation has seen.
    from megatron_ext.ft import membership as ms
    from megatron_ext.ft.ledger import CommitLedger

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    ledgers = [CommitLedger(connect(addr, timeout_s=5), world_size=2, timeout_s=5, lost=lambda: False,
                            arrivals=lambda: ms.arrivals(base), arrivals_seen=0) for _ in range(2)]
    votes = [None, None]
    t = threading.Thread(target=lambda: votes.__setitem__(0, ledgers[0].vote(1)))
    t.start()
    votes[1] = ledgers[1].vote(1)
    t.join(5)
    assert votes[0] == votes[1] and votes[0].committed and not votes[0].grow
    ms.register_spare(base, 3, 1, kind="respawn")
    t = threading.Thread(target=lambda: votes.__setitem__(0, ledgers[0].vote(2)))
    t.start()
    votes[1] = ledgers[1].vote(2)
    t.join(5)
    assert votes[0] == votes[1] and votes[0].grow
    ms.register_spare(base, 1, 0, kind="idle")  # a rank left out of a layout triggers no growth
    assert ms.arrivals(base) == 1
    assert ms.waiting_spares(base) == {1: 0, 3: 1}
    ms.report_exit(base, 3, 1, code=-9, reason="killed by signal 9", by="launcher")
    assert ms.waiting_spares(base) == {1: 0}, "a spare that died is no spare"
    # Rank 3's first replacement was invited into round 4 and lost later; the next one it is replaced
    # with must not take round 4's (long past) invitation for its own.
    ms.invite(base, 3, 4)
    assert ms.register_spare(base, 3, 2, kind="respawn") == 4
    assert ms.wait_for_invite(base, 3, after_round=4, poll_s=0.0, give_up=lambda: True) is None
    ms.invite(base, 3, 7)
    assert ms.wait_for_invite(base, 3, after_round=4, poll_s=0.0, give_up=lambda: True) == 7


def test_exit_reports_name_each_process_once_and_the_first_report_wins(store):
    from megatron_ext.ft import membership as ms

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    watch = ms.ExitWatch(connect(addr, timeout_s=5))
    assert watch.exited({0: 0, 1: 0}) == {}
    assert ms.report_exit(base, 1, 0, code=1, reason="ValueError: boom", by="self")
    assert not ms.report_exit(base, 1, 0, code=1, reason="exited with code 1", by="launcher")
    assert watch.exited({0: 0, 1: 0}) == {1: {"code": 1, "reason": "ValueError: boom", "by": "self"}}
    # The launcher started rank 1 again: its incarnation 1 is a new process, not yet lost.
    assert watch.exited({0: 0, 1: 1}) == {}


def test_a_rank_that_learns_a_loss_from_a_heartbeat_report_names_the_reporters_silence(store):
    """The survivor whose own heartbeat watch had not yet timed out when the report arrived names the
    loss with the reporter's silence (its ``fail_stop`` verdict then carries the timeout), not as an
    unexplained launcher report."""
    import dataclasses
    import types

    from megatron_ext.ft import membership as ms
    from megatron_ext.ft.core import FaultTolerance
    from megatron_ext.ft.liveness import Silence

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    silence = Silence(rank=3, iteration=6, time_s=100.0, last_seen_s=96.5, silent_s=3.5, timeout_s=3.0)
    assert ms.report_exit(base, 3, 0, code=None, reason="heartbeat silent for 3.5 s", by="heartbeat",
                          silence=dataclasses.asdict(silence))
    ms.report_exit(base, 2, 0, code=-9, reason="killed by signal 9", by="launcher")
    ft = types.SimpleNamespace(_exits=ms.ExitWatch(connect(addr, timeout_s=5)),
                               _watch_exits=ms.ExitWatch(connect(addr, timeout_s=5)))
    assert FaultTolerance._reported_silence(ft, 3, 0) is None  # not read from the store yet
    assert set(ft._exits.exited({2: 0, 3: 0})) == {2, 3}
    assert FaultTolerance._reported_silence(ft, 3, 0) == silence
    assert FaultTolerance._reported_silence(ft, 2, 0) is None  # a launcher's report has no silence


def test_the_same_error_on_a_second_rank_is_counted_by_its_signature(store):
    from megatron_ext.ft import membership as ms

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    assert ms.report_error(base, 2, ValueError("boom"), "ValueError: boom (iteration 5)")[0] == 1
    assert ms.report_error(base, 0, ValueError("other"), "ValueError: other")[0] == 1
    count, first = ms.report_error(base, 1, ValueError("boom"), "ValueError: boom (iteration 7)")
    assert count == 2 and first == {"member": 2, "error": "ValueError: boom (iteration 5)"}
    assert ms.job_end(base) is None
    assert ms.declare_end(base, code=1, message="rank 1: ...", by=1)["by"] == 1
    assert ms.declare_end(base, code=75, message="later", by=0) == {"code": 1, "message": "rank 1: ...", "by": 1,
                                                                    "lost": {}}


def test_a_barrier_fails_as_soon_as_a_member_is_lost(store):
    from megatron_ext.ft import membership as ms

    _, addr, connect = store
    base = connect(addr, timeout_s=5)
    lost: set[int] = set()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("ok", ms.barrier(
        connect(addr, timeout_s=5), round_=3, name="ready", member=0, members=[0, 1, 2], lost=lambda: lost,
        timeout_s=10)))
    t.start()
    keys_set = threading.Thread(target=lambda: ms.barrier(base, round_=3, name="ready", member=1, members=[0, 1, 2],
                                                          lost=lambda: lost, timeout_s=10))
    keys_set.start()
    time.sleep(0.2)
    assert t.is_alive()
    lost.add(2)
    t.join(5)
    keys_set.join(5)
    assert out["ok"] is False
    both = [ms.barrier(base, round_=4, name="done", member=m, members=[0], lost=lambda: set(), timeout_s=1)
            for m in (0,)]
    assert both == [True]


from megatron_ext.ft.preflight import NCCL_UNTRIED  # noqa: E402


@pytest.mark.parametrize("values,message", [
    ({"ft_on_stop": "continue", "use_distributed_optimizer": True},
     "--ft-on-stop continue cannot be used with --use-distributed-optimizer: its optimizer state is sharded "
     "over the data-parallel ranks, so a lost rank's part has no copy in memory; drop the flag, or use "
     "--ft-on-stop abort and resume with --load"),
    ({"resihp": True, "ft_on_stop": "continue", "device": "cuda"},
     NCCL_UNTRIED),
    ({"resihp": True, "ft_respawn": 1}, "--ft-respawn needs --ft-on-stop continue (a replacement joins a "
                                        "job that went on without the lost rank)"),
])
def test_continue_is_refused_where_it_cannot_work(values, message):
    from megatron_ext.config.base import ConfigError
    from megatron_ext.config.run import config_from_values
    from megatron_ext.ft.preflight import check

    with pytest.raises(ConfigError) as err:
        check(config_from_values(values), 4, launcher=True)
    assert str(err.value) == message
    # The NCCL path is there behind an explicit flag until it has run on two GPUs.
    if values.get("device") == "cuda":
        check(config_from_values({**values, "ft_continue_experimental_nccl": True}), 4, launcher=True)


def test_continue_under_a_launcher_without_an_outside_store_is_one_line(monkeypatch):
    # Under torchrun (rank 0 hosts the store, the agent stops every rank when one dies) it cannot work.
    from megatron_ext.config.base import ConfigError
    from megatron_ext.config.run import config_from_values
    from megatron_ext.ft.preflight import STORE_NEEDED, check

    monkeypatch.delenv("MEGATRON_EXT_STORE", raising=False)
    cfg = config_from_values({"ft_on_stop": "continue"})
    with pytest.raises(ConfigError) as err:
        check(cfg, 4, launcher=False)
    assert str(err.value) == STORE_NEEDED
    assert "\n" not in STORE_NEEDED and "--nproc-per-node" in STORE_NEEDED and "srun" in STORE_NEEDED
    check(cfg, 1, launcher=False)  # a lone process has nobody to lose
    monkeypatch.setenv("MEGATRON_EXT_STORE", "127.0.0.1:1")
    check(cfg, 4, launcher=False)
    respawn = config_from_values({"ft_on_stop": "continue", "ft_respawn": 2})
    with pytest.raises(ConfigError, match="--ft-respawn needs the project's launcher"):
        check(respawn, 4, launcher=False)  # under srun nothing starts a process again
    check(respawn, 4, launcher=True)

"""Liveness: the heartbeat tracker names each silent rank once, and the threads over a real store."""
from __future__ import annotations

import time

import pytest

from megatron_ext.ft.liveness import Heartbeat, HeartbeatTracker


def test_silent_rank_named_once_after_timeout():
    hb = HeartbeatTracker(range(4), timeout_s=5.0, start_s=100.0)
    for t in (101.0, 102.0, 103.0):
        for r in (0, 1, 3):
            hb.beat(r, t)
    hb.set_iteration(7)
    assert hb.check(105.0) == []          # rank 2 silent 5.0 s: not yet past the timeout
    (s,) = hb.check(105.5)
    assert (s.rank, s.iteration, s.last_seen_s, s.silent_s, s.timeout_s) == (2, 7, 100.0, 5.5, 5.0)
    assert hb.check(200.0)[0].rank in (0, 1, 3) and 2 not in [x.rank for x in hb.check(300.0)]
    assert hb.alive == []


def test_beats_keep_ranks_alive_and_ignore_late_clocks():
    hb = HeartbeatTracker([0, 1], timeout_s=2.0, start_s=0.0)
    hb.beat(0, 3.0)
    hb.beat(0, 1.0)  # an out-of-order (older) beat must not rewind the clock
    assert [s.rank for s in hb.check(4.5)] == [1]
    assert hb.silent_for(0, 4.5) == 1.5
    hb.beat(1, 10.0)  # a declared-dead rank does not come back by beating
    assert hb.alive == [0]
    with pytest.raises(KeyError, match=r"heartbeat from rank 5, which is not tracked \(ranks \[0, 1\]\)"):
        hb.beat(5, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        HeartbeatTracker([0], timeout_s=0, start_s=0.0)


def test_threads_over_a_store_name_the_rank_that_stops_beating_and_run_the_watch():
    from megatron_ext.ft.store import connect, host

    _server, addr = host()
    seen, watched = [], []
    a = Heartbeat(connect(addr, timeout_s=10), rank=0, world_size=2, interval_s=0.05, timeout_s=0.4, poll_s=0.02,
                  on_silent=lambda s, reporter: seen.append((s.rank, reporter)), watch=lambda: watched.append(1))
    b = Heartbeat(connect(addr, timeout_s=10), rank=1, world_size=2, interval_s=0.05, timeout_s=0.4, poll_s=0.02)
    a.start(), b.start()
    time.sleep(0.6)
    assert seen == [] and watched, "both beat: nobody is silent"
    b.stop()   # rank 1's threads end, as its process would
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    a.stop()
    assert seen == [(1, True)], "rank 1 named once, by rank 0 (the lowest alive, so it reports)"

"""Heartbeat tracker (fail-stop) and verdict serialisation."""
from __future__ import annotations

import io
import json

import pytest

from megatron_ext.resihp.heartbeat import HeartbeatTracker
from megatron_ext.resihp.verdicts import Verdict, VerdictLog, read_verdicts


def test_silent_rank_named_once_after_timeout():
    hb = HeartbeatTracker(range(4), timeout_s=5.0, start_s=100.0, stage_of={0: 0, 1: 0, 2: 1, 3: 1})
    for t in (101.0, 102.0, 103.0):
        for r in (0, 1, 3):
            hb.beat(r, t)
    hb.set_iteration(7)
    assert hb.check(105.0) == []          # rank 2 silent 5.0 s: not yet past the timeout
    (v,) = hb.check(105.5)
    assert (v.kind, v.rank, v.stage, v.iteration, v.factor, v.confidence) == ("fail_stop", 2, 1, 7, None, 1.0)
    assert v.detail == {"last_seen_s": 100.0, "silent_s": 5.5, "timeout_s": 5.0}
    assert hb.check(200.0)[0].rank in (0, 1, 3) and 2 not in [x.rank for x in hb.check(300.0)]
    assert hb.alive == []


def test_beats_keep_ranks_alive_and_ignore_late_clocks():
    hb = HeartbeatTracker([0, 1], timeout_s=2.0, start_s=0.0)
    hb.beat(0, 3.0)
    hb.beat(0, 1.0)  # an out-of-order (older) beat must not rewind the clock
    assert [v.rank for v in hb.check(4.5)] == [1]
    assert hb.silent_for(0, 4.5) == 1.5
    hb.beat(1, 10.0)  # a declared-dead rank does not come back by beating
    assert hb.alive == [0]
    with pytest.raises(KeyError, match=r"heartbeat from rank 5, which is not tracked \(ranks \[0, 1\]\)"):
        hb.beat(5, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        HeartbeatTracker([0], timeout_s=0, start_s=0.0)


def test_verdict_json_roundtrip_and_log(tmp_path):
    v = Verdict(kind="fail_slow", rank=3, stage=1, iteration=42, factor=1.7, confidence=0.97, detector="resihp",
                time_s=12.5, detail={"dp": 0, "tp": 1})
    assert Verdict.from_dict(json.loads(v.to_json())) == v
    assert v.describe() == "resihp[resihp] iteration 42: rank 3 (stage 1) fail-slow x1.70, confidence 0.97"
    path = tmp_path / "v.jsonl"
    with VerdictLog(path) as log:
        log.write(v)
    with VerdictLog(path) as log:  # appends
        log.write(v)
    assert read_verdicts(path) == [v, v]
    path.write_text(v.to_json() + "\n{\"kind\": \"fail_slow\"}\n")
    with pytest.raises(ValueError, match=r"v.jsonl:2: not a verdict"):
        read_verdicts(path)
    buf = io.StringIO()
    VerdictLog(buf).write(v)
    assert json.loads(buf.getvalue())["rank"] == 3


def test_verdict_validation():
    with pytest.raises(ValueError, match="verdict kind must be one of fail_slow, fail_stop, recovered, got 'slow'"):
        Verdict(kind="slow", rank=0, stage=0, iteration=1, factor=1.0, confidence=0.5, detector="x")
    with pytest.raises(ValueError, match=r"verdict confidence must lie in \[0, 1\], got 1.5"):
        Verdict(kind="fail_stop", rank=0, stage=0, iteration=1, factor=None, confidence=1.5, detector="x")

"""Fail-stop verdicts from liveness silences, and verdict serialisation."""
from __future__ import annotations

import io
import json

import pytest

from megatron_ext.ft.liveness import Silence
from megatron_ext.resihp.verdicts import Verdict, VerdictLog, read_verdicts


def test_a_silence_becomes_a_fail_stop_verdict():
    silence = Silence(rank=2, iteration=7, time_s=105.5, last_seen_s=100.0, silent_s=5.5, timeout_s=5.0)
    v = Verdict.fail_stop(silence, stage=1)
    assert (v.kind, v.rank, v.stage, v.iteration, v.factor, v.confidence) == ("fail_stop", 2, 1, 7, None, 1.0)
    assert v.detail == {"last_seen_s": 100.0, "silent_s": 5.5, "timeout_s": 5.0}
    assert Verdict.fail_stop(silence, launch_rank=3).launch_rank == 3


def test_verdict_json_roundtrip_and_log(tmp_path):
    v = Verdict(kind="fail_slow", rank=3, stage=1, iteration=42, factor=1.7, confidence=0.97, detector="resihp",
                time_s=12.5, detail={"dp": 0, "tp": 1})
    assert Verdict.from_dict(json.loads(v.to_json())) == v
    assert v.describe() == "resihp iteration 42: rank 3 (stage 1) fail-slow x1.70, confidence 0.97"
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
    with pytest.raises(ValueError, match="verdict kind must be one of fail_slow, fail_stop, hang, recovered, slow_link, link_recovered, slow_nic, nic_recovered, slow_path, path_recovered, got 'slow'"):
        Verdict(kind="slow", rank=0, stage=0, iteration=1, factor=1.0, confidence=0.5, detector="x")
    with pytest.raises(ValueError, match=r"verdict confidence must lie in \[0, 1\], got 1.5"):
        Verdict(kind="fail_stop", rank=0, stage=0, iteration=1, factor=None, confidence=1.5, detector="x")

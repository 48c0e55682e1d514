"""Scoring verdicts against labels, and the replay command end to end."""
from __future__ import annotations

import json

import pytest

from megatron_ext.resihp import replay
from megatron_ext.resihp.metrics import DetectionMetrics, score
from megatron_ext.resihp.synthetic import SlowFault, SyntheticSpec, generate
from megatron_ext.resihp.trace import FaultLabel, write_trace
from megatron_ext.resihp.verdicts import Verdict


def slow(rank, it):
    return Verdict(kind="fail_slow", rank=rank, stage=0, iteration=it, factor=1.5, confidence=1.0, detector="t")


def test_score_counts_by_definition():
    f = FaultLabel(kind="slow", rank=2, since=10, factor=1.5)
    stop = FaultLabel(kind="stop", rank=0, since=30)
    labels = [(i, (f,) if 10 <= i <= 20 else ((stop,) if i == 30 else ())) for i in range(1, 41)]
    verdicts = [
        slow(1, 5),    # before any fault: false alarm
        slow(2, 13),   # correct, delay 3
        slow(3, 14),   # wrong rank during the fault: wrong, but not a healthy-time false alarm
        slow(2, 18),   # correct again (counts for precision, not twice for recall)
        slow(2, 25),   # after the fault ended: false alarm
        Verdict(kind="recovered", rank=2, stage=0, iteration=22, factor=None, confidence=1.0, detector="t"),
        Verdict(kind="fail_stop", rank=0, stage=0, iteration=33, factor=None, confidence=1.0, detector="t"),
    ]
    m = score(labels, verdicts)
    assert (m.verdicts, m.correct, m.faults, m.detected, m.false_alarms) == (6, 3, 2, 2, 2)
    assert m.wrong == 3   # the two false alarms and the wrong rank named during the fault
    assert m.healthy_iterations == 40 - 11 - 1
    assert m.precision == 0.5 and m.recall == 1.0 and m.f1 == pytest.approx(2 / 3)
    assert m.delays == [3, 3] and m.delay_iters == 3.0
    assert m.false_alarms_per_10k == pytest.approx(1e4 * 2 / 28)


def test_metrics_add_up_and_empty_cases():
    a = DetectionMetrics(verdicts=2, correct=2, faults=2, detected=1, delays=[4], healthy_iterations=100)
    b = DetectionMetrics(verdicts=1, correct=0, faults=0, false_alarms=1, healthy_iterations=900)
    c = a + b
    assert (c.precision, c.recall, c.delay_iters, c.false_alarms_per_10k) == (2 / 3, 0.5, 4.0, 10.0)
    empty = DetectionMetrics()
    assert empty.precision == 1.0
    assert empty.summary() == {"f1": None, "precision": 1.0, "recall": None, "wrong_verdicts": 0, "delay_iters": None,
                               "false_alarms_per_10k": None}


def test_the_table_counts_a_wrong_rank_named_during_a_fault():
    # The raw detector naming the slow rank's waiting peer while the fault is on: no false alarm in
    # a healthy iteration, but two wrong verdicts, and the table says so.
    from megatron_ext.resihp.replay import ReplayResult, metrics_table

    f = FaultLabel(kind="slow", rank=2, since=10, factor=2.0)
    labels = [(i, (f,) if i >= 10 else ()) for i in range(1, 31)]
    verdicts = [slow(2, 14), slow(3, 15), slow(3, 20)]
    m = score(labels, verdicts)
    assert (m.false_alarms, m.wrong, m.precision) == (0, 2, 1 / 3)
    table = metrics_table([ReplayResult("raw", verdicts, [], m)]).splitlines()
    assert table[0].split() == ["detector", "verdicts", "wrong", "precision", "recall", "f1", "delay_iters",
                                "false_alarms/10k_healthy"]
    assert table[1].split() == ["raw", "3", "2", "0.333", "1.000", "0.500", "4.0", "0.00"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    spec = SyntheticSpec(stages=4, microbatches=8, iterations=70, burst_prob=0.0, seed=21,
                         faults=(SlowFault(rank=2, since=40, factor=1.8),))
    records = generate(spec)
    # Rank 1 stops reporting at iteration 60 (fail-stop): its durations vanish from the trace.
    for r in records[59:]:
        r.fwd_s[1] = float("nan")
        r.bwd_s[1] = float("nan")
        r.faults = r.faults + (FaultLabel(kind="stop", rank=1, since=60),)
    path = tmp_path_factory.mktemp("replay") / "trace.jsonl"
    write_trace(path, records)
    return path


def test_replay_cli_prints_verdicts_and_scores(trace, capsys, tmp_path):
    out_v = tmp_path / "verdicts.jsonl"
    rc = replay.main([str(trace), "--ft-heartbeat-timeout-s", "5", "--resihp-verdicts-out", str(out_v),
                      "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "70 iterations (1..70)" in out
    assert "resihp iteration 4" in out and "resihp[resihp]" not in out and "rank 2 (stage 2) fail-slow" in out
    assert "rank 1 (stage 1) fail-stop (heartbeat lost)" in out
    result = json.loads(out.strip().splitlines()[-1])
    kinds = [(v["kind"], v["rank"]) for v in result["resihp"]["verdicts"]]
    assert kinds == [("fail_slow", 2), ("fail_stop", 1)]
    assert result["resihp"]["metrics"]["f1"] == 1.0 and result["resihp"]["metrics"]["false_alarms_per_10k"] == 0.0
    assert len(out_v.read_text().splitlines()) == len(result["resihp"]["verdicts"]) + len(result["raw"]["verdicts"])


def test_replay_plot_and_errors(trace, capsys, tmp_path):
    png = tmp_path / "fig.png"
    assert replay.main([str(trace), "--detector", "resihp", "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace.read_text().splitlines()[0] + "\n[1, 2]\n")
    assert replay.main([str(bad)]) == 2
    assert f"error: {bad}:2: a record must be a JSON object, got list" in capsys.readouterr().err
    assert replay.main([str(trace), "--resihp-threshold", "0.9"]) == 2
    assert "--resihp-threshold must be > 1 (a slowdown factor), got 0.9" in capsys.readouterr().err


def test_replay_function_without_labels():
    records = generate(SyntheticSpec(stages=2, microbatches=4, iterations=30, burst_prob=0.0, seed=2))
    res = replay.replay(records, replay.ResiHPConfig(), "resihp")
    assert res.metrics is None and res.verdicts == []

"""The run's outputs after a layout change: once the new layout has settled, one line and one
``layout_recovery`` row say whether throughput recovered (iteration time before the fault, during
it, after), for a fail-slow re-layout and a lost rank alike; and the layout-change line of a
same-shape regroup names the new rank order instead of ``tp1pp2dp2 -> tp1pp2dp2``."""
from __future__ import annotations

import json

from megatron_ext.config.run import LoggingConfig
from megatron_ext.ft.transaction import describe
from megatron_ext.runtime.extension import IterationMetrics
from megatron_ext.runtime.runlog import AFTER_ITERS, SETTLE_ITERS, RunLog


def _train(log, it, ms):
    log.train(IterationMetrics(iteration=it, loss=1.0, lr=1e-3, grad_norm=1.0, iter_time_s=ms / 1e3,
                               tokens_per_s=1.0, consumed_samples=it), avg_time=ms / 1e3)


def _change(cause, iteration, **kw):
    return {"cause": cause, "from": "tp1pp2dp2", "to": "tp1pp2dp2", "iteration": iteration, "members": [0, 1, 2, 3],
            "lost_ranks": [], "lost_why": {}, "joined_ranks": [], "rolled_back": None, "lost_iterations": 0,
            "rolled_back_to": None, "restored_from_checkpoint": [], "checkpoint_iteration": None,
            "stage_layers": None, "replica_microbatches": None, "rank_order": None, "pause_s": 0.5, **kw}


def test_a_relayout_reports_before_during_and_after_once_settled(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    log = RunLog(LoggingConfig(log_interval=100, metrics_file=str(metrics)), train_iters=100)
    log.open()
    for it in range(1, 31):            # healthy 100 ms until 25, then a slow rank: 300 ms
        _train(log, it, 100.0 if it <= 25 else 300.0)
    log.record("layout_change", _change("relayout", 30, rank_order=[2, 1, 0, 3]))
    last = 30 + SETTLE_ITERS + AFTER_ITERS
    for it in range(31, last):          # warm-up 2 iterations slow, then 120 ms
        _train(log, it, 400.0 if it <= 32 else 120.0)
    assert not [r for r in log.history if r["kind"] == "layout_recovery"]   # not settled yet
    _train(log, last, 120.0)
    _train(log, last + 1, 120.0)
    rows = [r for r in log.history if r["kind"] == "layout_recovery"]
    assert len(rows) == 1                                                   # once
    rep = rows[0]
    assert (rep["before_ms"], rep["during_ms"], rep["after_ms"]) == (100.0, 300.0, 120.0)
    assert rep["after_iterations"] == [33, 42] and rep["after_vs_before"] == round(100 / 120, 4)
    assert rep["iteration"] == 42   # every metrics row has one: when it was written
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(" iteration      1/   100 | loss 1.0000")   # the run's first iteration has a line
    assert out[1:] == [" layout change at iteration 30 (the re-layout, tp1pp2dp2 kept): iteration time 100.0 ms "
                   "before the fault, 300.0 ms during it, 120.0 ms after (median of iterations 33-42): throughput "
                   "83 % of before the fault"]
    log.close()
    kinds = [json.loads(line)["kind"] for line in metrics.read_text().splitlines()]
    assert kinds.count("layout_recovery") == 1


def test_a_loss_reports_the_pause_and_a_change_before_settling_reports_only_the_newer(capsys):
    log = RunLog(LoggingConfig(log_interval=100), train_iters=100)
    for it in range(1, 21):
        _train(log, it, 80.0)
    log.record("layout_change", _change("fail_stop", 20, to="tp1pp1dp3", lost_ranks=[3]))
    for it in range(21, 25):
        _train(log, it, 95.0)
    log.record("layout_change", _change("grow", 24, **{"from": "tp1pp1dp3", "to": "tp1pp2dp2"}))
    for it in range(25, 40):
        _train(log, it, 85.0)
    rows = [r for r in log.history if r["kind"] == "layout_recovery"]
    assert [(r["cause"], r["change_iteration"]) for r in rows] == [("grow", 24)]
    assert (rows[0]["before_ms"], rows[0]["during_ms"], rows[0]["after_ms"]) == (95.0, None, 85.0)
    assert "paused 0.50 s" in capsys.readouterr().out


def test_a_same_shape_regroup_names_the_new_order():
    line = describe(_change("relayout", 36, rank_order=[2, 1, 0, 3]))
    assert line.startswith("layout change (re-layout): tp1pp2dp2 kept, ranks regrouped (the new ranks 0,1,2,3 "
                           "were 2,1,0,3) on rank(s) 0,1,2,3 at iteration 36"), line
    assert "tp1pp2dp2 -> tp1pp2dp2" not in line
    assert "tp1pp2dp2 -> tp1pp1dp3" in describe(_change("fail_stop", 29, to="tp1pp1dp3", lost_ranks=[3]))

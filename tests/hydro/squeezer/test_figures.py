"""A rank's figures file keeps every run: a resumed run appends its record (zeros included) and never
replaces an earlier one; no figure is NaN, in the file or in the log line."""
from __future__ import annotations

import json

from megatron_ext.cluster.config import measured_work_per_bubble_s
from megatron_ext.hydro.squeezer.figures import append_run, end_line

NAN = float("nan")


def _record(**kw):
    rec = {"rank": 0, "layout": "TP1xPP2xDP1", "engine": "megatron", "first_iteration": 1, "iterations": 150,
           "window_s": 20.0, "guest_busy_s": 16.0, "guest_overrun_s": 0.5, "bubble_used": 0.8, "guest_steps": 300,
           "guest_trial_steps": 2400, "guest_steps_per_busy_s": 18.75, "fusion": 8, "windows_offered": 500,
           "windows_used": 450, "windows_skipped": 20, "units": 9000, "long_units": 3,
           "pause_latencies_s": [0.0, 0.0002], "forecast": {"windows": 600, "abs_err_p50": 0.1, "abs_err_p90": 0.3,
                                                            "over_forecast": 0.2},
           "blocks": [{"iterations": [4, 43], "action": "keep"}], "restarts": 0, "deaths": []}
    rec.update(kw)
    return rec


# What a resumed run whose guests found the study finished measures: nothing.
ZEROS = dict(first_iteration=151, iterations=200, window_s=0.0, guest_busy_s=0.0, guest_overrun_s=0.0,
             bubble_used=0.0, guest_steps=0, guest_trial_steps=0, guest_steps_per_busy_s=0.0, fusion=0,
             windows_offered=0, windows_used=0, windows_skipped=0, units=0, long_units=0, pause_latencies_s=[],
             forecast={"windows": 0, "abs_err_p50": NAN, "abs_err_p90": NAN, "over_forecast": 0.0}, blocks=[])


def _strict(path):
    def no_nan(c):
        raise AssertionError(f"{c} in {path}")
    return json.loads(path.read_text(), parse_constant=no_nan)


def test_a_resumed_run_appends_its_figures_and_keeps_the_earlier_run(tmp_path):
    path = tmp_path / "figures_rank0.json"
    append_run(str(path), _record())
    append_run(str(path), _record(**ZEROS))
    fig = _strict(path)
    assert [r["first_iteration"] for r in fig["runs"]] == [1, 151]
    assert fig["runs"][0] == _record()                             # the first run's record, untouched
    assert fig["runs"][1]["forecast"]["abs_err_p50"] is None       # no sample: null, not NaN
    # the top level is both runs together: the zeros changed no rate
    assert fig["window_s"] == 20.0 and fig["bubble_used"] == 0.8 and fig["guest_trial_steps"] == 2400
    assert fig["fusion"] == 8 and fig["forecast"]["windows"] == 600 and fig["iterations"] == 200
    assert fig["first_iteration"] == 1 and fig["pause_latencies_s"] == [0.0, 0.0002]
    # what the cluster simulator reads from the directory
    assert measured_work_per_bubble_s(str(tmp_path)) == 0.8
    # a third run with work adds up
    append_run(str(path), _record(first_iteration=201, iterations=300, window_s=10.0, guest_busy_s=2.0,
                                  guest_steps=50, blocks=[{"iterations": [204, 243], "action": "stop"}]))
    fig = _strict(path)
    assert len(fig["runs"]) == 3 and fig["window_s"] == 30.0 and fig["bubble_used"] == 0.6
    assert fig["guest_steps_per_busy_s"] == 350 / 18.0 and [b["action"] for b in fig["blocks"]] == ["keep", "stop"]


def test_a_file_from_before_runs_were_kept_becomes_the_first_run(tmp_path):
    path = tmp_path / "figures_rank1.json"
    path.write_text(json.dumps(_record(rank=1)))
    append_run(str(path), _record(rank=1, **ZEROS))
    fig = _strict(path)
    assert len(fig["runs"]) == 2 and fig["runs"][0] == _record(rank=1) and fig["bubble_used"] == 0.8


def test_an_unreadable_figures_file_is_moved_aside_not_overwritten(tmp_path):
    path = tmp_path / "figures_rank0.json"
    path.write_text('{"window_s": 3.0, ')
    append_run(str(path), _record())
    assert (tmp_path / "figures_rank0.json.unreadable").read_text() == '{"window_s": 3.0, '
    assert len(_strict(path)["runs"]) == 1


def _stats(**kw):
    s = {"used": 0.87, "window_s": 12.34, "windows_used": 120, "windows_offered": 140, "trial_steps": 400,
         "latencies": [0.0] * 98 + [0.0002, 0.0004], "restarts": 0}
    s.update(kw)
    return s


def test_the_end_line_says_n_a_where_there_is_no_sample():
    line = end_line(0, _stats(), "/x/figures_rank0.json", 1)
    assert line == ("squeeze: rank 0: guest used 87% of 12.3 s of bubbles (120 of 140 windows), 400 trial-steps, "
                    "pause latency p99 0.40 ms, 0 restarts; figures in /x/figures_rank0.json (1 run kept)")
    idle = end_line(1, _stats(used=0.0, window_s=0.0, windows_used=0, windows_offered=0, trial_steps=0, latencies=[]),
                    "/x/figures_rank1.json", 2)
    assert "nan" not in idle.lower()
    assert idle == ("squeeze: rank 1: guest used n/a of 0.0 s of bubbles (0 of 0 windows), 0 trial-steps, "
                    "pause latency p99 n/a, 0 restarts; figures in /x/figures_rank1.json (2 runs kept)")

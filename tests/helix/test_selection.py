"""Measured selection of the compiled schedule (helix/selection.py, --helix-select-rounds): the plan,
the decision on times a test controls, the extension switching graphs, and a real TP2 job."""
from __future__ import annotations

import types

import pytest

from megatron_ext.helix.config import HelixConfig
from megatron_ext.helix.extension import UNTILED, HelixExtension
from megatron_ext.helix.selection import MeasuredSelection
from megatron_ext.config.base import ConfigError


def run_plan(sel: MeasuredSelection, seconds: dict[str, float], jitter: dict[int, float] | None = None):
    for step in range(sel.done_after):
        name = sel.candidate(step)
        sel.record(step, seconds[name] + (jitter or {}).get(step, 0.0))
    return sel.decide()


def test_the_plan_warms_each_candidate_then_rotates_the_rounds():
    sel = MeasuredSelection(["untiled", "tiled"], rounds=4)
    names = [sel.candidate(i) for i in range(sel.done_after)]
    assert names == ["untiled", "tiled", "untiled", "tiled", "tiled", "untiled", "untiled", "tiled", "tiled", "untiled"]
    assert sel.candidate(sel.done_after) is None and sel.done_after == 10


def test_the_faster_schedule_is_kept_when_the_rounds_resolve_it():
    d = run_plan(MeasuredSelection(["untiled", "tiled"], rounds=4), {"untiled": 0.20, "tiled": 0.15})
    assert d.chosen == "tiled" and d.ratios["tiled"]["median"] == pytest.approx(0.75)
    assert d.iterations == 10 and "-> kept tiled" in d.line()


def test_a_slower_or_unresolved_schedule_keeps_the_untiled_graph():
    assert run_plan(MeasuredSelection(["untiled", "tiled"], rounds=4), {"untiled": 0.15, "tiled": 0.20}).chosen \
        == "untiled"
    # equal medians: a tie goes to the untiled graph
    assert run_plan(MeasuredSelection(["untiled", "tiled"], rounds=4), {"untiled": 0.2, "tiled": 0.2}).chosen \
        == "untiled"
    # faster in its median but one round the other way: the interval reaches 1, so not resolved
    sel = MeasuredSelection(["untiled", "tiled"], rounds=3)
    jitter = {i: 0.1 for i in range(sel.done_after) if sel.plan[i] == ("tiled", 1)}
    d = run_plan(sel, {"untiled": 0.20, "tiled": 0.19}, jitter)
    assert d.ratios["tiled"]["median"] < 1 and d.ratios["tiled"]["interval"][1] >= 1 and d.chosen == "untiled"


def test_the_decision_is_made_on_the_agreed_samples_and_warm_up_is_not_timed():
    sel = MeasuredSelection(["untiled", "tiled"], rounds=2)
    for step in range(sel.done_after):
        sel.record(step, 100.0 if sel.plan[step][1] is None else 0.2)   # compile-time warm-up: ignored
    agreed = [0.0 if r is None else (0.1 if n == "tiled" else 0.3) for n, r in sel.plan]
    assert sel.decide().chosen == "untiled" and sel.decide(agreed).chosen == "tiled"


def test_bad_selections_are_refused():
    with pytest.raises(ValueError, match="two or more distinct candidates"):
        MeasuredSelection(["untiled"], rounds=2)
    with pytest.raises(ValueError, match="rounds >= 1"):
        MeasuredSelection(["untiled", "tiled"], rounds=0)
    with pytest.raises(ConfigError, match="--helix-select-rounds must be >= 0"):
        HelixConfig(helix=True, helix_select_rounds=-1)
    with pytest.raises(ConfigError, match="--helix-mode baseline leaves nothing to compare"):
        HelixConfig(helix=True, helix_select_rounds=2, helix_mode="baseline")


def test_the_extension_runs_each_candidate_in_turn_and_keeps_the_faster(monkeypatch):
    """Two stand-in graphs whose iteration times the test sets: the extension switches every model's
    forward by the plan, then keeps the faster one on every model."""
    ext = HelixExtension(HelixConfig(helix=True, helix_mode="tiled", helix_select_rounds=3))
    models = [types.SimpleNamespace(forward=None) for _ in range(2)]
    graphs = {UNTILED: object(), ext.schedule_name: object()}
    ext.models, ext.candidates = models, [dict(graphs) for _ in models]
    ext.selection = MeasuredSelection([UNTILED, ext.schedule_name], 3)
    ext.backend = types.SimpleNamespace(summaries=[types.SimpleNamespace(tiled=True)])
    trainer = types.SimpleNamespace(ctx=types.SimpleNamespace(rank=0))
    speed = {UNTILED: 0.30, ext.schedule_name: 0.18}
    ran = []
    for it in range(1, 20):
        ext.before_iteration(trainer, it)
        running = next(n for n, g in graphs.items() if models[0].forward is g)
        assert all(m.forward is graphs[running] for m in models)
        ran.append(running)
        ext.after_iteration(trainer, types.SimpleNamespace(iter_time_s=speed[running]))
    assert ran[:8] == [UNTILED, ext.schedule_name, UNTILED, ext.schedule_name, ext.schedule_name, UNTILED,
                       UNTILED, ext.schedule_name]
    assert ext.decision.chosen == ext.schedule_name and set(ran[8:]) == {ext.schedule_name}
    # the other way round, the untiled graph stays
    ext.selection, ext.step = MeasuredSelection([UNTILED, ext.schedule_name], 3), 0
    speed = {UNTILED: 0.18, ext.schedule_name: 0.30}
    for it in range(8):
        ext.before_iteration(trainer, it)
        running = next(n for n, g in graphs.items() if models[0].forward is g)
        ext.after_iteration(trainer, types.SimpleNamespace(iter_time_s=speed[running]))
    assert ext.decision.chosen == UNTILED and models[1].forward is graphs[UNTILED]


def test_selection_is_the_default_of_auto_and_ends_at_once_where_no_graph_was_tiled():
    assert HelixConfig(helix=True).select_rounds == 8
    assert HelixConfig(helix=True, helix_mode="tiled").select_rounds == 0
    assert HelixConfig(helix=True, helix_mode="tiled", helix_select_rounds=2).select_rounds == 2
    assert HelixConfig(helix=True, helix_select_rounds=0).select_rounds == 0
    ext = HelixExtension(HelixConfig(helix=True))
    models = [types.SimpleNamespace(forward=None)]
    graphs = {UNTILED: object(), ext.schedule_name: object()}
    ext.models, ext.candidates = models, [dict(graphs)]
    ext.selection = MeasuredSelection([UNTILED, ext.schedule_name], 4)
    ext.backend = types.SimpleNamespace(summaries=[types.SimpleNamespace(tiled=False)] * 2)
    trainer = types.SimpleNamespace(ctx=types.SimpleNamespace(rank=0))
    ran = []
    for it in range(5):
        ext.before_iteration(trainer, it)
        ran.append(next(n for n, g in graphs.items() if models[0].forward is g))
        ext.after_iteration(trainer, types.SimpleNamespace(iter_time_s=0.1))
    # both candidates compiled once; the simulator tiled nothing: the untiled graph from then on
    assert ran == [UNTILED, ext.schedule_name, UNTILED, UNTILED, UNTILED]
    assert ext.selection is None and ext.decision is None


@pytest.mark.multirank
def test_a_tp2_job_measures_its_schedules_and_says_what_it_kept():
    from tests.conftest import run_python

    proc = run_python("pretrain_gpt.py", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
                      "--train-iters", "8", "--eval-iters", "0", "--helix", "--helix-mode", "tiled",
                      "--helix-select-rounds", "2", "--log-interval", "1")
    out = proc.stdout + proc.stderr
    line = next(l for l in out.splitlines() if "helix: measured selection over 6 iterations" in l)
    assert "median untiled" in line and "helix-tiled-k2/untiled" in line and "-> kept " in line
    assert "iteration      8/     8" in out

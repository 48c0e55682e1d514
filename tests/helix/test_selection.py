"""Measured selection of the compiled schedule (helix/selection.py, --helix-select-rounds): the plan,
the decision on times a test controls, the extension switching graphs, and a real TP2 job."""
from __future__ import annotations

import types

import pytest

from megatron_ext.helix.config import HelixConfig
from megatron_ext.helix.extension import UNTILED, HelixExtension
from megatron_ext.helix.selection import CandidateSpec, MeasuredSelection
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


def _summary(tiled: bool, makespan_s: float):
    return types.SimpleNamespace(tiled=tiled, prediction=types.SimpleNamespace(makespan_s=makespan_s))


def _stand_in(ext: HelixExtension, summaries: dict[str, list], measure: int | None = None, rounds: int = 3):
    """The extension with stand-in graphs and backends (their compiled graphs' summaries as given)."""
    ext.backends = {n: types.SimpleNamespace(summaries=list(v)) for n, v in summaries.items()}
    ext.specs = {n: spec for n, spec in ext.candidate_specs().items() if n in summaries}
    ext._summary_start = {n: 0 for n in summaries}
    models = [types.SimpleNamespace(forward=None)]
    graphs = {n: object() for n in summaries}
    ext.models, ext.candidates = models, [dict(graphs)]
    ext.selection = MeasuredSelection(list(summaries), rounds, measure=measure, ranked=True)
    ext.step = 0
    return models, graphs


def _run(ext, models, graphs, speed, iterations):
    trainer = types.SimpleNamespace(ctx=types.SimpleNamespace(rank=0))
    ran = []
    for it in range(iterations):
        ext.before_iteration(trainer, it)
        ran.append(next(n for n, g in graphs.items() if models[0].forward is g))
        ext.after_iteration(trainer, types.SimpleNamespace(iter_time_s=speed[ran[-1]]))
    return ran


def test_selection_is_the_default_of_auto_and_ends_at_once_where_no_graph_was_tiled():
    assert HelixConfig(helix=True).select_rounds == 8
    assert HelixConfig(helix=True, helix_mode="tiled").select_rounds == 0
    assert HelixConfig(helix=True, helix_mode="tiled", helix_select_rounds=2).select_rounds == 2
    assert HelixConfig(helix=True, helix_select_rounds=0).select_rounds == 0
    ext = HelixExtension(HelixConfig(helix=True))
    models, graphs = _stand_in(ext, {UNTILED: [_summary(False, 1.0)] * 2,
                                     ext.schedule_name: [_summary(False, 1.0)] * 2}, measure=2, rounds=4)
    ran = _run(ext, models, graphs, {UNTILED: 0.1, ext.schedule_name: 0.1}, 5)
    # both candidates compiled once; the simulator tiled nothing: the untiled graph from then on
    assert ran == [UNTILED, ext.schedule_name, UNTILED, UNTILED, UNTILED]
    assert ext.selection is None and ext.decision.chosen == UNTILED and ext.decision.iterations == 2
    assert "the simulator tiled no graph" in ext.decision.dropped[ext.schedule_name]


def test_the_simulator_ranks_the_candidates_and_the_best_few_are_timed():
    """Five candidates compile once each; the untiled twin and the duplicate are left out, the
    simulator's best two are timed against the untiled graph, and the measured fastest is kept --
    here the simulator's second choice, not its first."""
    ext = HelixExtension(HelixConfig(helix=True, helix_select_candidates=["tiled-k2", "tiled-k4", "inductor"]))
    assert ext.schedule_name == "helix-auto-k2"
    models, graphs = _stand_in(ext, {
        UNTILED: [_summary(False, 1.00)],
        ext.schedule_name: [_summary(True, 0.80)],   # auto at K=2 tiled: the same graphs as tiled-k2
        "tiled-k2": [_summary(True, 0.80)],
        "tiled-k4": [_summary(True, 0.70)],
        "inductor": [_summary(False, 1.00)],
    }, measure=2, rounds=3)
    speed = {UNTILED: 0.30, ext.schedule_name: 0.25, "tiled-k2": 0.25, "tiled-k4": 0.33, "inductor": 0.29}
    ran = _run(ext, models, graphs, speed, 5 + 3 * 3 + 2)
    assert ran[:5] == list(graphs)   # every candidate's warm-up (compile), in order
    assert set(ran[5:14]) == {UNTILED, "tiled-k4", ext.schedule_name}
    assert ext.decision.chosen == ext.schedule_name and set(ran[14:]) == {ext.schedule_name}
    d = ext.decision
    assert d.iterations == 14 and d.predicted_s["tiled-k4"] == pytest.approx(0.70)
    assert d.dropped == {"tiled-k2": f"the same graphs as {ext.schedule_name}",
                         "inductor": "ranked below the timed ones"}
    assert "not timed: tiled-k2 (the same graphs as helix-auto-k2)" in d.line() and "-> kept helix-auto-k2" in d.line()


def test_candidates_are_parsed_and_bad_ones_refused():
    from megatron_ext.helix.selection import parse_candidate

    assert parse_candidate("tiled-k4-unbucketed") == CandidateSpec("tiled-k4-unbucketed", "tiled", 4, False)
    assert parse_candidate("Inductor").mode == "inductor"
    for bad in ("tiled", "tiled-k1", "auto-k2-bucketed", "fast"):
        with pytest.raises(ConfigError, match=r"--helix-select-candidates .*expected tiled-kN, auto-kN"):
            HelixConfig(helix=True, helix_select_candidates=[bad])
    with pytest.raises(ConfigError, match="--helix-select-measure must be >= 1"):
        HelixConfig(helix=True, helix_select_measure=0)
    with pytest.raises(RuntimeError, match="rank the candidates"):
        MeasuredSelection(["untiled", "a", "b"], 2, measure=1).candidate(3)


@pytest.mark.multirank
def test_a_tp2_job_measures_its_schedules_and_says_what_it_kept():
    from tests.conftest import run_python

    proc = run_python("pretrain_gpt.py", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
                      "--train-iters", "13", "--eval-iters", "0", "--helix", "--helix-mode", "tiled",
                      "--helix-select-rounds", "2", "--log-interval", "1")
    out = proc.stdout + proc.stderr
    # five candidates compile once (tiled-k2 is the --helix-mode schedule itself); the simulator ranks
    # them and its best two are timed against the untiled graph in two rotated rounds: 5 + 2 x 3
    ranking = next(l for l in out.splitlines() if "the simulator's step makespan per candidate" in l)
    for name in ("untiled", "helix-tiled-k2", "tiled-k4", "tiled-k2-unbucketed", "inductor"):
        assert f"{name} " in ranking, ranking
    line = next(l for l in out.splitlines() if "helix: measured selection over 11 iterations" in l)
    assert "median untiled" in line and "/untiled" in line and "simulated untiled" in line and "-> kept " in line
    assert "not timed: " in line
    assert "iteration     13/    13" in out


def test_the_ranking_leaves_out_untiled_twins_and_every_copy_of_a_ranked_candidate():
    from megatron_ext.helix.selection import rank

    # a, b and c compiled the same graphs; b is the simulator's best of them, so a and c go
    ranked, dropped = rank(["untiled", "a", "b", "c", "inductor", "k4"], [1.0, 0.8, 0.7, 0.8, 0.9, 0.6],
                           [False, True, True, True, False, False],
                           same_as={"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}, always=["inductor"])
    assert ranked == ["b", "inductor"]
    assert dropped == {"k4": "the simulator tiled no graph: the untiled graph", "a": "the same graphs as b",
                       "c": "the same graphs as b"}

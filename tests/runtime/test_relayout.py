"""Live re-layout in the same processes continues the straight run (4 gloo ranks)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("relayout") / "result.json"
    run_torchrun("tests/runtime/relayout_scenarios.py", str(out))
    return json.loads(out.read_text())


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 20
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.multirank
@pytest.mark.parametrize("start,target", [("tp2pp2", "pp4"), ("pp2dp2", "tp2pp2"), ("tp2pp2", "tp2dp2"),
                                          ("pp2dp2", "pp2dp2_3+1"), ("pp2dp2_3+1", "tp2pp2_1+3"),
                                          ("pp2dp2", "pp2dp2_mb3+1")])
def test_relayout_at_iteration_10_continues_the_straight_run(result, start, target):
    # Weights, Adam moments and step counts moved to their new owners, the LR schedule's position
    # and the data position carried over: the curve is the straight 20-iteration run's.
    live = result[f"{start}->{target}"]
    assert max_rel_diff(live["losses"], result[f"straight_{start}"]) < 1e-5
    assert live["info"]["iteration"] == 10


@pytest.mark.multirank
def test_uneven_stages_train_the_same_model(result):
    # 3 + 1 layers on PP2 x DP2 from the start: the same curve as the even split.
    assert max_rel_diff(result["straight_pp2dp2_3+1"], result["straight_pp2dp2"]) < 1e-5


@pytest.mark.multirank
def test_uneven_replica_work_keeps_the_global_batch_gradient(result):
    # Replica 0 takes 3 of the 4 micro-batches, replica 1 one; per-token loss weighting keeps the
    # global batch's gradient, so the curve is the even split's.
    assert max_rel_diff(result["straight_pp2dp2_mb3+1"], result["straight_pp2dp2"]) < 1e-5


@pytest.mark.multirank
def test_relayout_destroys_the_old_groups(result):
    # Every group of the old layout is destroyed before the new ones are built: a re-layout to a
    # layout with as many groups leaves as many live groups, not twice as many.
    before, after = result["pp2dp2->tp2pp2"]["groups"]
    assert after == before


@pytest.mark.multirank
def test_pipeline_events_follow_the_relayout(result):
    tl = result["timeline"]
    assert max_rel_diff(tl["losses"], result["straight_pp2dp2"]) < 1e-5
    assert {"bubble_s0", "bubble_s1"} <= set(tl["keys_before"]) and "bubble_s2" not in tl["keys_before"]
    assert {"bubble_s0", "bubble_s1", "bubble_s2", "bubble_s3"} <= set(tl["keys_after"])
    assert tl["stages_recorded"] == 4

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
    # Point to point: what was sent was received, and each rank got the boxes it lacked, not the
    # job's whole state (an all-gather sends every rank's payload to the 3 others). A rank takes a
    # slice from its own replicas where it holds one: from PP2 x DP2 to TP2 x PP2 (each rank's new
    # TP half is in the stage replica it holds) and to another micro-batch split nothing moves.
    sent, received, held = (sum(col) for col in zip(*live["info"]["moved"]))
    assert sent == received and sent < 3 * held
    assert (sent == 0) == (target in ("tp2pp2", "pp2dp2_mb3+1") and start == "pp2dp2"), (start, target, sent)


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


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["tp2pp2->tp2pp2 [0, 3, 1, 2]", "tp2pp2->pp2dp2_3+1 [2, 0, 3, 1]"])
def test_rank_permutation_at_iteration_10_continues_the_straight_run(result, key):
    # The processes take new places (renumbered on a new default group, every rank kept), the
    # state follows the slots: the curve is the straight run's.
    live = result[key]
    assert max_rel_diff(live["losses"], result["straight_tp2pp2"]) < 1e-5
    order = live["info"]["rank_order"]
    before = live["members_before"]
    assert live["info"]["members"] == [before[r] for r in order]
    for who in live["who"]:
        # each process is now the rank the order gave it, in the next generation's world
        assert who["rank"] == live["info"]["members"].index(who["member"])
        assert who["generation"] == live["who"][0]["generation"]
    if key.startswith("tp2pp2->tp2pp2"):
        # launch ranks 1 and 2 (ranks 1 and 2 before) now share a TP group, on stage 0
        tp_groups = {tuple(w["tp_group"]) for w in live["who"]}
        assert tp_groups == {tuple(sorted((before[0], before[3]))), tuple(sorted((before[1], before[2])))}
    # every old group destroyed with the old world: no more live groups after than before (the new
    # default group included)
    before_groups, after_groups = live["groups"]
    if live["info"]["from"] == live["info"]["to"]:
        assert after_groups <= before_groups


@pytest.mark.multirank
def test_a_bad_rank_order_is_refused_before_anything_changes(result):
    live = result["tp2pp2->tp2pp2 [0, 3, 1, 2]"]
    assert live["refused"] == ("relayout rank_order [0, 0, 1, 2]: expected each rank 0..3 once (every rank of the "
                               "job keeps a place; only a fail-stop leaves ranks out)")


def test_a_rank_permutation_meets_in_a_store_outside_the_old_group(monkeypatch):
    # The job's own store (the launcher's, MEGATRON_EXT_STORE) first, else torchrun's agent store;
    # a store that lives in the old default group (plain env:// with rank 0 hosting) is none.
    import torch

    from megatron_ext.layout import Layout
    from megatron_ext.runtime.distributed import DistContext, rendezvous_address

    ctx = DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo",
                      layout=Layout(tp=1, pp=2, dp=1))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert rendezvous_address(ctx) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert rendezvous_address(ctx) == "node7:29511"
    ctx.store_addr = "launcher:4000"
    assert rendezvous_address(ctx) == "launcher:4000"

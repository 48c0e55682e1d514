"""ResiHP re-layout planner: invariants of every plan, quality against the capacity-proportional
optimum, each knob doing what it claims, state-move accounting, hysteresis, JSON, exact errors."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ext.models.flops import ModelSpec
from megatron_ext.resihp.planner import (Cluster, Plan, PlanLayout, Planner, PlannerConfig, PlanningError, Workload,
                                         capacity_optimum_s, layer_params, node_local_groups, predict_iteration_s,
                                         spans_nodes, state_move_bytes)
from megatron_ext.resihp.planner_policy import PlanPolicy
from megatron_ext.resihp.verdicts import Verdict

M350 = ModelSpec(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50304)
G175 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200)
WORKLOAD = Workload(seq_length=2048)
ONLY = dict(tp_regroup=False, pp_repartition=False, dp_migration=False, drop_replicas=False, grow_replicas=False,
            reshape=False)


def cluster(memory: float, **kw) -> Cluster:
    return Cluster(device_flops=150e12, memory_bytes=memory, link_bytes_per_s=25e9, relayout_pause_s=10.0,
                   tp_bytes_per_s=300e9, **kw)


def planner(spec=M350, memory=80e9, **cfg) -> Planner:
    base = dict(horizon_iterations=1000)
    base.update(cfg)
    return Planner(spec, cluster(memory), WORKLOAD, PlannerConfig(**base))


def tuned_start(p: Planner, tp: int, pp: int, dp: int, m: int) -> PlanLayout:
    """The healthy job as a user would tune it: megatron's even split, then the layer partition
    that balances the output layer on the last stage (what ``--decoder-last-pipeline-num-layers``
    is for)."""
    even = PlanLayout.even(num_layers=p.spec.num_layers, tp=tp, pp=pp, dp=dp, num_microbatches=m)
    tuner = Planner(p.spec, p.cluster, p.workload, PlannerConfig(**{**ONLY, "pp_repartition": True}))
    return tuner.best_layout(even, np.ones(even.world_size))[0]


def speeds_of(n: int, slow: dict[int, float]) -> np.ndarray:
    sp = np.ones(n)
    for r, v in slow.items():
        sp[r] = v
    return sp


def check_invariants(p: Planner, plan: Plan, sp: np.ndarray) -> None:
    new = plan.new
    assert new.num_layers == p.spec.num_layers
    assert all(n >= 1 for row in new.layers for n in row)
    assert new.num_microbatches == plan.old.num_microbatches
    assert all(m >= 1 for m in new.microbatches)
    assert len(set(new.devices)) == new.world_size
    assert set(new.devices) <= set(range(sp.shape[0]))
    assert all(sp[r] > 0 for r in new.devices), "a dead device got work"
    assert p.fits(new, p.cluster.memory_of(sp.shape[0]))
    assert plan.iteration_s_after == pytest.approx(p.iteration_s(new, sp), rel=1e-12)
    assert plan.iteration_s_after < plan.iteration_s_before


# ---- invariants on random inputs ----------------------------------------------------------

@st.composite
def jobs(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 4))
    m = dp * draw(st.integers(1, 8))
    n = tp * pp * dp
    spare = draw(st.integers(0, 2))
    hit = draw(st.lists(st.integers(0, n + spare - 1), min_size=1, max_size=3, unique=True))
    speeds = {r: draw(st.sampled_from([0.0, 0.25, 0.5, 1 / 1.3, 1 / 3])) for r in hit}
    return tp, pp, dp, m, spare, speeds


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_every_plan_keeps_the_invariants(job):
    tp, pp, dp, m, spare, slow = job
    p = planner(memory=12e9)
    lay = PlanLayout.even(num_layers=24, tp=tp, pp=pp, dp=dp, num_microbatches=m)
    sp = speeds_of(lay.world_size + spare, slow)
    try:
        plan = p.plan(lay, sp)
    except PlanningError as exc:
        # Only allowed when the job cannot run as it is and nothing else fits.
        assert math.isinf(p.iteration_s(lay, sp)) and str(exc).startswith("no layout runs without rank(s)")
        return
    if plan is None:
        assert not math.isinf(p.iteration_s(lay, sp)), "a job with a dead device must get a plan or an error"
        return
    check_invariants(p, plan, sp)
    assert plan.gain > min(p.config.min_gain, p.config.min_gain_healthy)
    if any(sp[r] != 1 for r in {*lay.devices, *plan.new.devices}) and not math.isinf(plan.iteration_s_before):
        assert plan.gain > p.config.min_gain
    assert Plan.from_json(plan.to_json()) == plan


# ---- quality against the capacity-proportional optimum -----------------------------------

QUALITY = [
    # name, spec, memory, (tp, pp, dp, micro-batches), {rank: speed}
    ("w4 pp4 one x2", M350, 12e9, (1, 4, 1, 32), {1: 0.5}),
    ("w4 pp4 last stage x4", M350, 12e9, (1, 4, 1, 32), {3: 0.25}),
    ("w4 tp2pp2 x1.5", M350, 8e9, (2, 2, 1, 32), {0: 1 / 1.5}),
    ("w8 tp2pp2dp2 x1.5", M350, 8e9, (2, 2, 2, 64), {5: 1 / 1.5}),
    ("w16 tp2pp4dp2 x1.3 x3", M350, 6e9, (2, 4, 2, 64), {3: 1 / 1.3, 12: 1 / 3}),
    ("w64 tp4pp4dp4 dead", M350, 3.5e9, (4, 4, 4, 128), {17: 0.0}),
    ("w64 tp4pp4dp4 two x2 one dead", M350, 3.5e9, (4, 4, 4, 128), {5: 0.5, 40: 0.5, 63: 0.0}),
    # GPT-3-175B-like, TP8 with the fastest pipeline depth that uses every device (as the benchmark).
    ("w1024 tp8pp8dp16 x2", G175, 80e9, (8, 8, 16, 1536), {500: 0.5}),
    ("w1024 x1.3 x4 dead", G175, 80e9, (8, 8, 16, 1536), {5: 1 / 1.3, 300: 0.25, 900: 0.0}),
    ("w4096 five slow 1.3-4x", G175, 80e9, (8, 8, 64, 1536), {1: 1 / 3, 1000: 0.5, 2000: 1 / 1.5, 3000: 0.25,
                                                                4000: 1 / 1.3}),
    ("w4096 two dead one x2", G175, 80e9, (8, 8, 64, 1536), {10: 0.0, 2500: 0.0, 700: 0.5}),
]


@pytest.mark.parametrize("name,spec,memory,shape,slow", QUALITY[-4:], ids=[q[0] for q in QUALITY[-4:]])
def test_same_shape_knobs_alone_reach_90_percent_at_scale(name, spec, memory, shape, slow):
    """Without any (tp, pp) change (regroup, layers, micro-batches, fewer replicas) the planner
    still gets 90 %: at this scale one replica is a small share of the job."""
    p = planner(spec, memory, reshape=False)
    start = tuned_start(p, *shape)
    n = start.world_size
    sp = speeds_of(n, slow)
    optimum = capacity_optimum_s(p.iteration_s(start, np.ones(n)), sp, n)
    best, best_s = p.best_layout(start, sp)
    assert (best.tp, best.pp) == (start.tp, start.pp) and optimum / best_s >= 0.9


def test_where_memory_forces_tp2_a_4x_device_costs_its_partner_too():
    """The limit of the 90 % claim: 8 devices whose memory needs TP >= 2, one of them 4x slow.
    Its TP partner idles 3/4 of the time whatever the layout (TP1 does not fit), so the best is
    (8 - 2 * 0.75) / 7.25 = 0.897 of the optimum before any bubble; the planner gets 0.875."""
    p = planner(M350, 8e9)
    start = tuned_start(p, 2, 2, 2, 64)
    sp = speeds_of(8, {5: 0.25})
    optimum = capacity_optimum_s(p.iteration_s(start, np.ones(8)), sp, 8)
    best, best_s = p.best_layout(start, sp)
    assert best.tp == 2 and 0.85 <= optimum / best_s <= (8 - 2 * 0.75) / 7.25
    assert best_s < 0.5 * p.iteration_s(start, sp)


@pytest.mark.parametrize("name,spec,memory,shape,slow", QUALITY, ids=[q[0] for q in QUALITY])
def test_plan_reaches_90_percent_of_the_capacity_optimum(name, spec, memory, shape, slow):
    p = planner(spec, memory)
    start = tuned_start(p, *shape)
    n = start.world_size
    assert p.plan(start, np.ones(n)) is None, "the healthy start must already be the planner's choice"
    sp = speeds_of(n, slow)
    optimum = capacity_optimum_s(p.iteration_s(start, np.ones(n)), sp, n)
    best, best_s = p.best_layout(start, sp)
    assert optimum / best_s >= 0.9, f"{name}: {optimum / best_s:.3f} of the optimum"
    plan = p.plan(start, sp)
    assert plan is not None and plan.new == best
    check_invariants(p, plan, sp)
    # Without any action the job is far from it (or cannot run): the plan is what closes the gap.
    assert p.iteration_s(start, sp) > best_s * 1.05


# ---- each knob -------------------------------------------------------------------------------

def test_pp_repartition_gives_the_slow_stage_fewer_layers():
    p = planner(memory=80e9, **{**ONLY, "pp_repartition": True})
    start = tuned_start(p, 1, 4, 1, 32)
    plan = p.plan(start, speeds_of(4, {1: 0.5}))
    assert plan.actions == ("pp_repartition",)
    assert plan.new.devices == start.devices
    layers = plan.new.stage_layers
    assert layers[1] < min(layers[0], layers[2]) and sum(layers) == 24


def test_dp_migration_gives_the_slow_replica_fewer_microbatches_and_keeps_the_global_count():
    p = planner(memory=80e9, **{**ONLY, "dp_migration": True})
    start = PlanLayout.even(num_layers=24, tp=1, pp=1, dp=4, num_microbatches=64)
    sp = speeds_of(4, {2: 0.5})
    plan = p.plan(start, sp)
    assert plan.actions == ("dp_migration",)
    mbs = plan.new.microbatches
    others = [mbs[i] for i in (0, 1, 3)]
    assert sum(mbs) == 64 and max(others) - min(others) <= 1 and abs(2 * mbs[2] - np.mean(others)) <= 2
    assert plan.bytes_to_move == 0
    # Pure data parallelism has no bubble: proportional work reaches the capacity optimum.
    optimum = capacity_optimum_s(p.iteration_s(start, np.ones(4)), sp, 4)
    assert optimum / plan.iteration_s_after >= 0.97


def test_tp_regroup_puts_the_slow_devices_in_one_tp_group():
    p = planner(memory=80e9, **{**ONLY, "tp_regroup": True, "dp_migration": True})
    start = PlanLayout.even(num_layers=24, tp=2, pp=1, dp=4, num_microbatches=64)
    sp = speeds_of(8, {0: 0.5, 2: 0.5, 4: 0.5})   # one in each of three TP groups
    plan = p.plan(start, sp)
    assert "tp_regroup" in plan.actions
    groups = [set(g) for g in np.asarray(plan.new.devices).reshape(-1, 2).tolist()]
    slow_groups = [g for g in groups if g & {0, 2, 4}]
    assert len(slow_groups) == 2 and any(len(g & {0, 2, 4}) == 2 for g in slow_groups)
    assert sorted(plan.new.devices) == list(range(8))


def test_tp_size_change_tp2_to_tp1_pp2():
    p = planner(memory=80e9)
    start = PlanLayout.even(num_layers=24, tp=2, pp=1, dp=1, num_microbatches=32)
    plan = p.plan(start, speeds_of(2, {1: 0.5}))
    assert (plan.new.tp, plan.new.pp, plan.new.dp) == (1, 2, 1)
    assert "reshape" in plan.actions
    check_invariants(p, plan, speeds_of(2, {1: 0.5}))


def test_fail_stop_with_replicas_shrinks_dp_without_moving_state():
    p = planner(memory=80e9, **{**ONLY, "drop_replicas": True, "dp_migration": True})
    start = PlanLayout.even(num_layers=24, tp=2, pp=2, dp=4, num_microbatches=64)
    sp = speeds_of(16, {5: 0.0})
    plan = p.plan(start, sp)
    assert math.isinf(plan.iteration_s_before)
    assert 5 not in plan.new.devices and plan.new.dp == 3 and plan.new.num_microbatches == 64
    assert plan.bytes_to_move == 0 and plan.actions[0] == "dp_shrink"
    assert plan.describe().startswith("resihp plan [dp_shrink] for 5:dead: tp2pp2dp4 -> tp2pp2dp3; ")


def test_dp_grows_back_onto_healthy_idle_devices():
    # TP1 x PP2 x DP2 on devices 0-3 of 8; 4-7 idle, 6 slow: one replica more on 4 and 5 (the
    # healthy idle devices, in rank order); the slow one is left idle. Without the knob: no plan.
    p = planner(memory=80e9, **{**ONLY, "grow_replicas": True})
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=24)
    sp = speeds_of(8, {6: 0.5})
    plan = p.plan(start, sp)
    assert plan.actions == ("dp_grow",) and plan.new.dp == 3 and plan.new.microbatches == (8, 8, 8)
    assert plan.new.grid()[:, :2, :].tolist() == start.grid().tolist() and sorted(plan.new.grid()[:, 2, 0]) == [4, 5]
    check_invariants(p, plan, sp)
    assert planner(memory=80e9, **ONLY).plan(start, sp) is None
    # Never more replicas than micro-batches.
    few = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=2)
    assert p.plan(few, np.ones(8)) is None


def test_a_tp_group_across_nodes_pays_the_nic_and_the_node_aware_planner_keeps_groups_inside_nodes():
    # 3 nodes of 4; a TP2 x PP2 x DP2 job on the first two, node 2 idle. Device 3 dies.
    nodes = Cluster(device_flops=150e12, memory_bytes=80e9, link_bytes_per_s=25e9, relayout_pause_s=10.0,
                    tp_bytes_per_s=300e9, devices_per_node=4)
    start = PlanLayout.even(num_layers=24, tp=2, pp=2, dp=2, num_microbatches=32)
    ones = np.ones(12)
    # The same layout with its groups shifted by one device: (1, 2) and (5, 6) stay inside nodes,
    # (3, 4) and (7, 8) span two; only the node-aware cost model sees it.
    shifted = dataclasses.replace(start, devices=(1, 2, 3, 4, 5, 6, 7, 8))
    assert spans_nodes(shifted, 4).tolist() == [[False, True], [False, True]]
    assert not spans_nodes(shifted, None).any() and not spans_nodes(start, 4).any()
    flat = Planner(M350, cluster(80e9), WORKLOAD)
    aware = Planner(M350, nodes, WORKLOAD)
    assert aware.iteration_s(shifted, ones) > 1.05 * aware.iteration_s(start, ones)
    assert flat.iteration_s(shifted, ones) == pytest.approx(flat.iteration_s(start, ones))
    sp = speeds_of(12, {3: 0.0})
    for p in (flat, aware):
        plan = p.plan(start, sp)
        assert 3 not in plan.new.devices
        groups = np.asarray(plan.new.devices).reshape(-1, plan.new.tp)
        if p is aware:
            assert all(len({int(d) // 4 for d in g}) == 1 for g in groups), plan.new.devices
            assert plan.iteration_s_after <= aware.iteration_s(plan.new, sp) * (1 + 1e-9)


def test_node_local_groups_rebuilds_only_the_groups_that_span_nodes():
    speed = np.ones(24)
    speed[3] = 0.0
    # Device 3 was left out and the reshape shifted every later TP pair across a node boundary.
    devices = (0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16)
    lay = PlanLayout(tp=2, pp=2, dp=4, layers=((12,), (12,)), microbatches=(2, 2, 2, 2), devices=devices)
    fixed = node_local_groups(lay, 8, speed)
    groups = np.asarray(fixed.devices).reshape(-1, 2)
    kept = [0, 1, 2, 4, 5, 6]
    assert all(len({d // 8 for d in g}) == 1 for g in groups)
    assert 3 not in fixed.devices
    # Groups that were inside a node keep their devices; only (7, 8) and (15, 16) spanned two.
    assert [groups[i].tolist() for i in kept] == [[0, 1], [2, 4], [5, 6], [9, 10], [11, 12], [13, 14]]
    assert sorted(groups[3].tolist() + groups[7].tolist()) != [7, 8, 15, 16]
    assert node_local_groups(fixed, 8, speed) == fixed


def test_fail_stop_without_room_is_an_error_naming_the_rank():
    p = planner(memory=6e9)
    start = PlanLayout.even(num_layers=24, tp=1, pp=4, dp=1, num_microbatches=8)
    with pytest.raises(PlanningError, match=re.escape(
            "no layout runs without rank(s) 2: the 3 usable devices cannot hold 24 layers in memory under the "
            "allowed knobs; restart from a checkpoint on more devices")):
        p.plan(start, speeds_of(4, {2: 0.0}))


def test_small_gain_is_not_worth_a_relayout():
    p = planner(G175, min_gain=0.05)
    start = tuned_start(p, 8, 8, 16, 1536)
    assert p.plan(start, speeds_of(1024, {3: 1 / 1.02})) is None


def test_a_plan_with_no_believed_slowness_needs_only_the_healthy_threshold():
    # TP1 x PP2 x DP8 on 16 of 18 healthy devices: one replica more saves 4.4 % after its pause,
    # under min_gain (5 %), over min_gain_healthy (2 %). The same grow with a device of the layout
    # believed slow (however little) or a slow NIC in it is held to min_gain.
    p = planner(memory=80e9, **{**ONLY, "grow_replicas": True})
    assert (p.config.min_gain, p.config.min_gain_healthy) == (0.05, 0.02)
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=8, num_microbatches=72)
    plan = p.plan(start, np.ones(18))
    assert plan.actions == ("dp_grow",) and plan.new.dp == 9 and 0.02 < plan.gain < 0.05
    assert p.plan(start, speeds_of(18, {3: 0.999})) is None
    assert p.plan(start, np.ones(18), nics={3: 20e9}) is None
    assert planner(memory=80e9, **{**ONLY, "grow_replicas": True, "min_gain_healthy": 0.05}).plan(start, np.ones(18)) is None


def test_horizon_decides_whether_a_costly_move_pays():
    # Same fault; a long horizon amortizes a full reshape, a one-iteration horizon does not.
    start = PlanLayout.even(num_layers=24, tp=2, pp=1, dp=1, num_microbatches=32)
    sp = speeds_of(2, {1: 0.5})
    assert planner(horizon_iterations=1000).plan(start, sp) is not None
    assert planner(horizon_iterations=1).plan(start, sp) is None


# ---- state moves -----------------------------------------------------------------------------

def test_state_move_bytes_of_one_layer_between_stages():
    wl = WORKLOAD
    old = PlanLayout.even(num_layers=24, tp=2, pp=2, dp=1, num_microbatches=8)
    new = dataclasses.replace(old, layers=((13,), (11,)))
    moved = state_move_bytes(old, new, M350, wl, 4)
    one = layer_params(M350) * wl.state_bytes_per_param / 2       # one layer, half of it per TP rank
    np.testing.assert_allclose(moved, [one, one, 0, 0])


def test_state_move_bytes_dp_and_replica_swaps_are_free_tp_change_is_not():
    old = PlanLayout.even(num_layers=24, tp=2, pp=2, dp=2, num_microbatches=8)
    swapped = dataclasses.replace(old, devices=(2, 3, 0, 1, 6, 7, 4, 5), microbatches=(5, 3))  # replicas swap
    assert state_move_bytes(old, swapped, M350, WORKLOAD, 8).sum() == 0
    tp_swap = dataclasses.replace(old, devices=(1, 0, 2, 3, 4, 5, 6, 7))                   # TP ranks swap
    moved = state_move_bytes(old, tp_swap, M350, WORKLOAD, 8)
    assert moved[0] > 0 and moved[1] > 0 and moved[2:].sum() == 0
    spare_in = dataclasses.replace(old, devices=(8, 1, 2, 3, 4, 5, 6, 7))                   # a spare joins
    moved = state_move_bytes(old, spare_in, M350, WORKLOAD, 9)
    stage0 = (12 * layer_params(M350) + M350.vocab_size * M350.hidden_size) * WORKLOAD.state_bytes_per_param / 2
    assert moved[:8].sum() == 0 and moved[8] == pytest.approx(stage0)


# ---- hysteresis ------------------------------------------------------------------------------

def slow(rank: int, it: int, factor: float) -> Verdict:
    return Verdict(kind="fail_slow", rank=rank, stage=None, iteration=it, factor=factor, confidence=1.0,
                   detector="resihp")


def other(kind: str, rank: int, it: int) -> Verdict:
    return Verdict(kind=kind, rank=rank, stage=None, iteration=it, factor=None, confidence=1.0, detector="resihp")


def test_flapping_verdict_does_not_relayout_back_and_forth():
    p = planner(memory=80e9)
    start = tuned_start(p, 1, 4, 1, 32)
    pol = PlanPolicy(p, start, 4, recover_after=30)
    plans = {}
    for it in range(200):
        vs = {10: [slow(1, 10, 2.0)], 20: [other("recovered", 1, 20)], 25: [slow(1, 25, 2.0)],
              40: [other("recovered", 1, 40)], 50: [slow(1, 50, 2.1)], 60: [other("recovered", 1, 60)]}.get(it, [])
        plan = pol.observe(it, vs)
        if plan is not None:
            plans[it] = plan
    # One re-layout at the fault, none while it flaps or when its factor is re-estimated, one back
    # to the healthy layout only after 30 healthy iterations from the last 'recovered'.
    assert sorted(plans) == [10, 90]
    assert plans[10].new.stage_layers[1] < start.stage_layers[1]
    assert plans[90].new == start
    assert pol.layout == start and pol.believed(1) == 1.0


def test_beliefs_handed_to_another_process_keep_the_hysteresis():
    # A rank permutation can move the deciding rank to another process: its policy starts from
    # the old one's beliefs, so a recovery in progress goes on where it was (the same plans as
    # one policy throughout), and a device known slow is not forgotten.
    p = planner(memory=80e9)
    start = tuned_start(p, 1, 4, 1, 32)
    pol = PlanPolicy(p, start, 4, recover_after=30)
    plans = {}
    for it in range(200):
        if it == 45:
            handed = json.loads(json.dumps(pol.beliefs()))
            assert handed == {"speeds": {"1": 0.5}, "recovering": {"1": 40}, "chosen": True}
            pol2 = PlanPolicy(p, pol.layout, 4, recover_after=30)
            pol2.restore(handed)
            pol = pol2
        vs = {10: [slow(1, 10, 2.0)], 20: [other("recovered", 1, 20)], 25: [slow(1, 25, 2.0)],
              40: [other("recovered", 1, 40)]}.get(it, [])
        plan = pol.observe(it, vs)
        if plan is not None:
            plans[it] = plan
    assert sorted(plans) == [10, 70] and plans[70].new == start
    with pytest.raises(PlanningError, match=re.escape("beliefs name device 7; the policy knows 4 devices")):
        pol.restore({"speeds": {"7": 0.5}})


def test_a_slow_device_left_out_of_the_job_is_readmitted_after_readmit_after_iterations():
    # TP1 x PP2 x DP3 on 6 devices; device 5 (replica 2, stage 1) goes 4x slow. The planner drops
    # its replica; out of the job it is not watched, so no 'recovered' can come. With
    # readmit_after=20 it counts as healthy 20 iterations later and DP grows back onto it.
    p = planner(memory=80e9, **{**ONLY, "drop_replicas": True, "grow_replicas": True})
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=3, num_microbatches=24)
    for readmit in (0, 20):
        pol = PlanPolicy(p, start, 6, readmit_after=readmit)
        plans = {it: plan for it in range(100) if (plan := pol.observe(it, [slow(5, 10, 4.0)] if it == 10 else []))}
        assert plans[10].actions[0] == "dp_shrink" and 5 not in plans[10].new.devices
        if not readmit:
            assert sorted(plans) == [10] and pol.believed(5) == 0.25
            continue
        assert sorted(plans) == [10, 31] and pol.believed(5) == 1.0
        assert plans[31].actions[0] == "dp_grow" and plans[31].new.dp == 3 and 5 in plans[31].new.devices
        # handed over mid-way, the clock goes on where it was
        pol = PlanPolicy(p, start, 6, readmit_after=readmit)
        for it in range(30):
            pol.observe(it, [slow(5, 10, 4.0)] if it == 10 else [])
        handed = json.loads(json.dumps(pol.beliefs()))
        assert handed["outside"] == {"5": 11}
        pol2 = PlanPolicy(p, pol.layout, 6, readmit_after=readmit)
        pol2.restore(handed)
        assert pol2.observe(30) is None and pol2.observe(31).actions[0] == "dp_grow"
    with pytest.raises(PlanningError, match=re.escape("readmit_after must be >= 0 iterations (0: never), got -1")):
        PlanPolicy(p, start, 6, readmit_after=-1)


def test_fail_stop_verdict_replans_at_once_and_log_only_mode_keeps_the_layout():
    p = planner(memory=80e9)
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=16)
    pol = PlanPolicy(p, start, 4)
    plan = pol.observe(3, [other("fail_stop", 2, 3)], adopt=False)
    assert plan is not None and 2 not in plan.new.devices
    assert pol.layout == start and pol.believed(2) == 0.0
    assert pol.observe(4, [other("recovered", 2, 4)]) is None     # a dead device does not come back


def test_policy_errors():
    p = planner()
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=1, num_microbatches=8)
    pol = PlanPolicy(p, start, 2)
    with pytest.raises(PlanningError, match=re.escape(
            "verdict at iteration 7 names rank 5; the policy knows 2 devices (0..1)")):
        pol.observe(7, [slow(5, 7, 2.0)])
    with pytest.raises(PlanningError, match=re.escape(
            "fail_slow verdict for rank 1 at iteration 7 has no usable factor (None)")):
        pol.observe(7, [Verdict(kind="fail_slow", rank=1, stage=0, iteration=7, factor=None, confidence=1.0,
                                detector="raw")])
    with pytest.raises(PlanningError, match=re.escape(
            "num_devices (1) must exceed the largest rank of the layout (1)")):
        PlanPolicy(p, start, 1)


# ---- JSON and the log line ------------------------------------------------------------------

def test_plan_json_round_trip_and_describe():
    p = planner(memory=80e9)
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=16)
    for sp in (speeds_of(4, {3: 0.5}), speeds_of(4, {3: 0.0})):
        plan = p.plan(start, sp)
        text = plan.to_json()
        assert json.loads(text)["format"] == "resihp-plan"
        assert Plan.from_json(text) == plan
        line = plan.describe()
        assert "\n" not in line and line.startswith("resihp plan [")
        assert re.search(r"iteration (inf|[0-9.]+ s) -> [0-9.]+ s predicted", line)
        assert f"for 3:{'dead' if sp[3] == 0 else 'x2.00'}" in line


def test_plan_json_errors():
    with pytest.raises(PlanningError, match=re.escape("plan: expected format 'resihp-plan', got None")):
        Plan.from_json("{}")
    with pytest.raises(PlanningError, match=r"^plan: not JSON: "):
        Plan.from_json("{")
    with pytest.raises(PlanningError, match=re.escape("plan: missing keys ['actions', ")):
        Plan.from_json({"format": "resihp-plan", "old": {}, "new": {}})
    with pytest.raises(PlanningError, match=re.escape("plan.old: unknown key colour")):
        PlanLayout.from_dict({"colour": 1}, "plan.old")


# ---- bad input ------------------------------------------------------------------------------

def test_layout_errors():
    good = dict(tp=1, pp=2, dp=1, layers=((3,), (3,)), microbatches=(4,), devices=(0, 1))
    cases = [
        (dict(tp=0), "layout.tp must be a positive integer, got 0"),
        (dict(layers=((3,),)), "layout.layers must be a 2 x 1 table (stages x chunks), got [[3]]"),
        (dict(layers=((6,), (0,))), "layout.layers[1][0] = 0: every stage and chunk needs at least one layer"),
        (dict(microbatches=(2, 2)), "layout.microbatches must list one count per DP replica (1), got 2"),
        (dict(microbatches=(0,)), "layout.microbatches[0] must be >= 1, got [0]"),
        (dict(devices=(0,)), "layout.devices must name 2 devices (tp 1 x pp 2 x dp 1), got 1"),
        (dict(devices=(1, 1)), "layout.devices must be distinct non-negative ranks; repeated or negative: [1]"),
        (dict(vp=2), "layout.vp = 2 does not fit schedule '1f1b' (vp > 1 needs 'interleaved', 'interleaved' "
                     "needs vp > 1)"),
        (dict(schedule="gpipe"), "layout.schedule must be one of 1f1b, interleaved, deepspeed, got 'gpipe'"),
    ]
    for change, msg in cases:
        with pytest.raises(PlanningError, match=re.escape(msg)):
            PlanLayout(**{**good, **change})
    with pytest.raises(PlanningError, match=re.escape("num_layers 3 is fewer than pp * vp = 4 virtual stages")):
        PlanLayout.even(num_layers=3, tp=1, pp=4, dp=1, num_microbatches=4)


def test_planner_input_errors():
    p = planner()
    lay = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=8)
    with pytest.raises(PlanningError, match=re.escape(
            "speeds: expected one speed per device (at least 4: the layout names rank 3), got 3")):
        p.plan(lay, [1, 1, 1])
    with pytest.raises(PlanningError, match=re.escape(
            "speeds[1] = -0.5: a speed must be finite and >= 0 (1 healthy, 1/factor slow, 0 dead)")):
        p.plan(lay, [1, -0.5, 1, 1])
    with pytest.raises(PlanningError, match=re.escape("speeds[2] = nan")):
        p.plan(lay, [1, 1, float("nan"), 1])
    short = PlanLayout.even(num_layers=12, tp=1, pp=2, dp=2, num_microbatches=8)
    with pytest.raises(PlanningError, match=re.escape("layout.layers hold 12 layers, the model has 24")):
        p.plan(short, np.ones(4))
    with pytest.raises(PlanningError, match=re.escape("cluster.link_bytes_per_s must be > 0, got 0")):
        Cluster(device_flops=1e12, memory_bytes=1e9, link_bytes_per_s=0)
    with pytest.raises(PlanningError, match=re.escape("cluster.devices_per_node must be an integer >= 1 or None, got 0")):
        Cluster(device_flops=1e12, memory_bytes=1e9, link_bytes_per_s=1e9, devices_per_node=0)
    with pytest.raises(PlanningError, match=re.escape("planner.min_gain and min_gain_healthy must be >= 0, got 0.05 and -0.1")):
        PlannerConfig(min_gain_healthy=-0.1)
    with pytest.raises(PlanningError, match=re.escape("planner.horizon_iterations must be >= 1, got 0")):
        PlannerConfig(horizon_iterations=0)
    with pytest.raises(PlanningError, match=re.escape("workload.seq_length must be >= 1, got 0")):
        Workload(seq_length=0)


def test_predicted_time_is_the_simulator_and_infinite_with_a_dead_device():
    lay = PlanLayout.even(num_layers=24, tp=1, pp=4, dp=1, num_microbatches=8)
    c = cluster(80e9)
    t = predict_iteration_s(lay, M350, np.ones(4), c, WORKLOAD)
    # Uniform middle stages, heavier last stage: at least (m + p - 1) times the middle stage's op pair.
    p = planner()
    f, b = p.costs.layer(1)
    assert t >= (8 + 3) * 6 * (f + b)
    assert predict_iteration_s(lay, M350, speeds_of(4, {2: 0.0}), c, WORKLOAD) == math.inf
    # A 4x slow stage of four becomes the bottleneck (the last stage, with the output layer, was:
    # about 10 layers' worth against 24 now).
    assert predict_iteration_s(lay, M350, speeds_of(4, {1: 0.25}), c, WORKLOAD) > 2 * t


# ---- the two inner solvers against brute force -----------------------------------------------

def compositions(total: int, parts: int, low: int = 1):
    if parts == 1:
        if total >= low:
            yield (total,)
        return
    for first in range(low, total - low * (parts - 1) + 1):
        for rest in compositions(total - first, parts - 1, low):
            yield (first,) + rest


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.2, 3.0), min_size=1, max_size=4), st.integers(4, 12), st.floats(0.0, 2.0),
       st.lists(st.integers(1, 12), min_size=4, max_size=4))
def test_layer_partition_is_the_min_max_optimum(unit, layers, head, cap):
    from megatron_ext.resihp.planner import _greedy_layers
    pp = len(unit)
    unit_a, cap_a = np.array(unit), np.array(cap[:pp])
    fixed = np.zeros(pp)
    fixed[-1] = head
    got = _greedy_layers(unit_a, fixed, layers, cap_a)
    feasible = [c for c in compositions(layers, pp) if all(n <= k for n, k in zip(c, cap_a))]
    if not feasible:
        assert got is None
        return
    best = min(max(n * u + f for n, u, f in zip(c, unit_a, fixed)) for c in feasible)
    assert sum(got) == layers and all(1 <= n <= k for n, k in zip(got, cap_a))
    assert max(n * u + f for n, u, f in zip(got, unit_a, fixed)) == pytest.approx(best)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 5.0), st.floats(0.1, 2.0)), min_size=1, max_size=4), st.integers(4, 16))
def test_microbatch_split_is_the_min_max_optimum(reps, total):
    from megatron_ext.resihp.planner import _allocate_microbatches
    a = np.array([r[0] for r in reps])
    b = np.array([r[1] for r in reps])
    got = _allocate_microbatches(a, b, total, 1)
    if total < len(reps):
        assert got is None
        return
    best = min(max(a + (np.array(c) - 1) * b) for c in compositions(total, len(reps)))
    assert sum(got) == total and min(got) >= 1
    assert max(a + (np.array(got) - 1) * b) == pytest.approx(best)


@pytest.mark.parametrize("schedule,vp", [("interleaved", 2), ("deepspeed", 1)])
def test_other_schedules_plan_with_their_own_simulation(schedule, vp):
    p = planner(memory=12e9)
    lay = PlanLayout.even(num_layers=24, tp=1, pp=4, dp=2, num_microbatches=32, vp=vp, schedule=schedule)
    sp = speeds_of(8, {1: 0.5})
    plan = p.plan(lay, sp)
    check_invariants(p, plan, sp)
    if plan.new.vp > 1:
        # Interleaved: micro-batches per replica stay multiples of the pipeline depth (megatron's
        # microbatch_group_size_per_vp_stage), every chunk keeps a layer.
        assert all(m % plan.new.pp == 0 for m in plan.new.microbatches)
    assert plan.new.schedule == schedule or plan.new.vp != vp


def test_an_moe_layer_holds_every_expert_and_the_router():
    moe = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, ffn_hidden_size=96,
                    gated_linear_unit=True, num_experts=8, moe_router_topk=2)
    dense = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, ffn_hidden_size=96,
                      gated_linear_unit=True)
    attention = 4 * 64 * 64
    assert layer_params(dense) == attention + 3 * 64 * 96
    assert layer_params(moe) == attention + 8 * 3 * 64 * 96 + 64 * 8
    # experts at their own width, and a shared expert beside them
    narrow = dataclasses.replace(moe, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=128)
    assert layer_params(narrow) == attention + 8 * 3 * 64 * 32 + 64 * 8 + 3 * 64 * 128


# ---- measured iteration times -----------------------------------------------------------------

def test_a_shape_measured_slower_than_predicted_is_priced_so_and_unknown_shapes_take_the_median():
    p = planner(memory=80e9, **{**ONLY, "grow_replicas": True})
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=8, num_microbatches=72)
    sp = np.ones(18)
    assert p.shape_factor(start) == 1.0
    plain = p.plan(start, sp)
    p.shape_factors[(1, 2)] = 1.5
    scaled = p.plan(start, sp)
    assert scaled.iteration_s_before == pytest.approx(1.5 * plain.iteration_s_before, rel=1e-12)
    assert scaled.iteration_s_after == pytest.approx(1.5 * plain.iteration_s_after, rel=1e-12)
    p.shape_factors[(2, 4)] = 1.1
    other = PlanLayout.even(num_layers=24, tp=4, pp=1, dp=4, num_microbatches=72)
    assert p.shape_factor(other) == pytest.approx(1.3)     # the median of 1.5 and 1.1


def test_measured_times_set_the_shape_factor_and_re_plan_only_a_layout_of_the_policy_s_own():
    p = planner(memory=80e9, **{**ONLY, "grow_replicas": True})
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=8, num_microbatches=72)
    pol = PlanPolicy(p, start, 18, measure_after=5)
    pred = p.iteration_s(start, np.ones(18))
    calls = []
    plan_of = p.plan
    p.plan = lambda *a, **k: calls.append(a[0]) or plan_of(*a, **k)
    # The first time after a change is dropped (it may hold the move); then the median of 5.
    for x in (9.0, 1.1, 1.2, 1.1, 1.0, 1.1):
        pol.record_time(x * pred)
    assert p.shape_factors == {(1, 2): pytest.approx(1.1)}
    # The user's own layout is not re-planned on a factor alone.
    assert pol.observe(10) is None and calls == []
    # A layout of the policy's own choosing is: the new shape's factor re-plans from it.
    grow = plan_of(start, np.ones(18))
    pol.plans.append((11, grow))
    pol.layout = grow.new
    for _ in range(6):
        pol.record_time(1.3 * pred)
    pol.observe(30)
    assert calls == [grow.new]
    # Measured again at the same factor (within 1 %) after a change: no re-plan.
    pol.observe(31, [slow(17, 31, 2.0)])
    for _ in range(6):
        pol.record_time(1.3 * pred)
    n = len(calls)
    pol.observe(40)
    assert len(calls) == n
    # Nothing is learned while a device of the layout is believed slow.
    pol.observe(41, [slow(3, 41, 2.0)])
    before = dict(p.shape_factors)
    for _ in range(10):
        pol.record_time(5 * pred)
    assert p.shape_factors == before
    # The factors travel with the beliefs, and so does whose layout is in force: a policy that
    # takes over a layout another chose (a live job's next decider) re-plans on a new factor too.
    beliefs = json.loads(json.dumps(pol.beliefs()))
    assert beliefs["chosen"] is True
    other = PlanPolicy(planner(memory=80e9), grow.new, 18, measure_after=5)
    other.restore(beliefs)
    assert other.planner.shape_factors == pytest.approx(p.shape_factors)
    assert beliefs["speeds"] == {"3": 0.5, "17": 0.5}
    other.speeds[[3, 17]] = 1.0   # both back (nothing is learned while a device of the layout is slow)
    for _ in range(6):
        other.record_time(1.6 * other.planner.iteration_s(grow.new, np.ones(18)))
    assert other._pending == [f"tp{grow.new.tp}pp{grow.new.pp} measured at x1.600 of the prediction"]
    # A fresh policy on the user's start says nothing of a choice; nor re-plans on a factor.
    fresh = PlanPolicy(planner(memory=80e9), start, 18, measure_after=5)
    assert "chosen" not in fresh.beliefs()
    for _ in range(6):
        fresh.record_time(1.6 * pred)
    assert fresh._pending == [] and fresh.planner.shape_factors == {(1, 2): pytest.approx(1.6)}


def test_bad_measured_times_and_windows_are_errors():
    p = planner()
    start = PlanLayout.even(num_layers=24, tp=1, pp=2, dp=2, num_microbatches=8)
    with pytest.raises(PlanningError, match=re.escape("measure_after must be >= 0 iterations (0: never), got -1")):
        PlanPolicy(p, start, 4, measure_after=-1)
    pol = PlanPolicy(p, start, 4)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(PlanningError, match="a measured iteration must take a finite time > 0 seconds"):
            pol.record_time(bad)

"""Pipeline simulator: closed forms for uniform work, parity with an independent event-driven
simulator on random work, critical-path and bubble invariants, deadlock detection."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.pipeline.schedule_orders import Op, ScheduleOrder, schedule_order
from megatron_ext.pipeline.pipesim import ScheduleDeadlock, compile_plan, simulate


def reference_times(order: ScheduleOrder, fwd, bwd, lat: float):
    """Straightforward event simulation: repeatedly run any stage whose next op has its input.
    Written independently of the level-compiled simulator, op by op."""
    pos = [0] * order.num_stages
    start, finish, free = {}, {}, [0.0] * order.num_stages
    total = sum(len(s) for s in order.stages)
    while len(finish) < total:
        progressed = False
        for s, ops in enumerate(order.stages):
            if pos[s] == len(ops):
                continue
            op = ops[pos[s]]
            src = order.producer(s, op)
            ready = 0.0
            if src is not None:
                ps, pop = src
                if (ps, pop.key) not in finish:
                    continue
                k = order.stages[ps].index(next(o for o in order.stages[ps] if o.key == pop.key))
                if order.stages[ps][k].deferred_send and k + 1 < len(order.stages[ps]):
                    nxt = order.stages[ps][k + 1]
                    if (ps, nxt.key) not in start:
                        continue
                    out = start[(ps, nxt.key)]
                else:
                    out = finish[(ps, pop.key)]
                ready = out + (lat if ps != s else 0.0)
            t0 = max(free[s], ready)
            d = (fwd if op.phase == "F" else bwd)[s, op.chunk, op.microbatch]
            start[(s, op.key)], finish[(s, op.key)] = t0, t0 + d
            free[s] = t0 + d
            pos[s] += 1
            progressed = True
        assert progressed, "reference deadlocked"
    return start, finish


CASES = [("1f1b", 4, 6, 1), ("1f1b", 1, 3, 1), ("1f1b", 5, 2, 1), ("interleaved", 4, 8, 2),
         ("interleaved", 3, 6, 3), ("deepspeed", 4, 6, 1), ("deepspeed", 3, 7, 1), ("deepspeed", 6, 3, 1)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_matches_reference_on_random_work(name, p, m, v):
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    order = schedule_order(name, p, m, v)
    plan = compile_plan(order)
    for lat in (0.0, 0.3):
        fwd = rng.uniform(0.5, 2.0, (p, v, m))
        bwd = fwd * rng.uniform(1.5, 2.5, (p, v, m))
        res = simulate(plan, fwd, bwd, p2p_latency_s=lat)
        ref_start, ref_finish = reference_times(order, fwd, bwd, lat)
        for j in range(plan.num_ops):
            key = (int(plan.stage[j]), plan.op(j).key)
            assert res.start[0, j] == pytest.approx(ref_start[key])
            assert res.finish[0, j] == pytest.approx(ref_finish[key])
        assert res.makespan_s[0] == pytest.approx(max(ref_finish.values()))


@pytest.mark.parametrize("name", ["1f1b", "deepspeed"])
@pytest.mark.parametrize("p,m", [(4, 8), (8, 3), (2, 2)])
def test_uniform_work_closed_form(name, p, m):
    f, b = 1.0, 2.0
    plan = compile_plan(schedule_order(name, p, m))
    res = simulate(plan, np.full((p, 1, m), f), np.full((p, 1, m), b))
    # Classic 1F1B: (m + p - 1) slots of (f + b), each stage idle (p - 1)(f + b).
    assert res.makespan_s[0] == pytest.approx((m + p - 1) * (f + b))
    np.testing.assert_allclose(res.idle_s[0], (p - 1) * (f + b))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 4), (2, 6, 3)])
def test_interleaved_shrinks_bubble_by_chunks(p, m, v):
    f, b = 1.0, 2.0  # per stage for the whole model share; each chunk does 1/v of it
    plan = compile_plan(schedule_order("interleaved", p, m, v))
    res = simulate(plan, np.full((p, v, m), f / v), np.full((p, v, m), b / v))
    assert res.makespan_s[0] == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


def test_batch_equals_single():
    plan = compile_plan(schedule_order("interleaved", 4, 8, 2))
    rng = np.random.default_rng(0)
    fwd, bwd = rng.uniform(1, 2, (5, 4, 2, 8)), rng.uniform(2, 4, (5, 4, 2, 8))
    tail = rng.uniform(0, 1, (5, 4))
    batch = simulate(plan, fwd, bwd, p2p_latency_s=0.1, tail_s=tail)
    for i in range(5):
        one = simulate(plan, fwd[i], bwd[i], p2p_latency_s=0.1, tail_s=tail[i])
        np.testing.assert_array_equal(one.start[0], batch.start[i])
        assert one.makespan_s[0] == batch.makespan_s[i]


def test_deepspeed_deferred_send_costs_a_round_trip():
    # Stage 0's forward of micro-batch 3 leaves only after stage 0 received the gradient for
    # backward 0, so stage 1 starts that forward a latency after stage 0 starts backward 0. Under
    # megatron's 1F1B it was already there. Without latency the two coincide.
    p, m, lat = 4, 6, 0.1
    fwd = np.ones((p, 1, m))
    bwd = 2 * fwd
    plan = compile_plan(schedule_order("deepspeed", p, m))
    ds = simulate(plan, fwd, bwd, p2p_latency_s=lat)
    mg = simulate(compile_plan(schedule_order("1f1b", p, m)), fwd, bwd, p2p_latency_s=lat)
    j_f3_s1 = next(j for j in range(plan.num_ops) if plan.stage[j] == 1 and plan.op(j).key == ("F", 3, 0))
    j_b0_s0 = next(j for j in range(plan.num_ops) if plan.stage[j] == 0 and plan.op(j).key == ("B", 0, 0))
    assert ds.start[0, j_f3_s1] == pytest.approx(ds.start[0, j_b0_s0] + lat)
    assert ds.makespan_s[0] > mg.makespan_s[0] + lat
    same_ds = simulate(plan, fwd, bwd).makespan_s[0]
    assert same_ds == simulate(compile_plan(schedule_order("1f1b", p, m)), fwd, bwd).makespan_s[0]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_critical_path_accounts_for_makespan(name, p, m, v):
    rng = np.random.default_rng(7)
    lat = 0.05
    plan = compile_plan(schedule_order(name, p, m, v))
    res = simulate(plan, rng.uniform(1, 2, (p, v, m)), rng.uniform(2, 4, (p, v, m)), p2p_latency_s=lat)
    path = res.critical_path()
    assert path[0].via == "start" and path[0].start_s == 0.0
    assert path[-1].finish_s == pytest.approx(res.finish[0].max())
    for a, b in zip(path, path[1:]):
        if b.via == "stage":
            assert b.start_s == pytest.approx(a.finish_s) and b.stage == a.stage
        else:
            assert b.via == "p2p" and b.start_s >= a.finish_s - 1e-12
    if name != "deepspeed":  # without deferred sends the path is contiguous compute + latency
        total = sum(s.finish_s - s.start_s for s in path) + lat * sum(s.via == "p2p" and
                                                                        s.stage != path[i].stage
                                                                        for i, s in enumerate(path[1:]))
        assert total == pytest.approx(res.makespan_s[0])


def test_critical_path_runs_through_slow_stage():
    p, m = 4, 8
    fwd = np.ones((p, 1, m))
    fwd[2] *= 3
    res = simulate(compile_plan(schedule_order("1f1b", p, m)), fwd, 2 * fwd)
    path = res.critical_path()
    on_slow = sum(s.finish_s - s.start_s for s in path if s.stage == 2)
    assert on_slow >= 0.8 * res.makespan_s[0]


def test_bubbles_sum_to_idle():
    rng = np.random.default_rng(3)
    p, m = 4, 5
    res = simulate(compile_plan(schedule_order("1f1b", p, m)), rng.uniform(1, 2, (p, 1, m)),
                   rng.uniform(2, 3, (p, 1, m)))
    for s in range(p):
        windows = res.bubbles(s)
        assert all(t0 < t1 for t0, t1 in windows)
        assert sum(t1 - t0 for t0, t1 in windows) == pytest.approx(res.idle_s[0, s])
    assert res.bubbles(0)[0][0] > 0  # stage 0 starts at once; its first bubble comes later
    assert res.bubbles(p - 1)[0][0] == 0.0  # the last stage waits for the first activation


def test_tail_extends_makespan():
    plan = compile_plan(schedule_order("1f1b", 2, 2))
    ones = np.ones((2, 1, 2))
    base = simulate(plan, ones, ones).makespan_s[0]
    assert simulate(plan, ones, ones, tail_s=[5.0, 0.0]).makespan_s[0] == pytest.approx(base + 5.0)


def test_deadlock_is_reported():
    # Stage 1 wants backward 0 before it ran forward 0 ... and forward 1 never reaches it first.
    bad = ScheduleOrder("bad", 2, 1, 1, ((Op("F", 0), Op("B", 0)), (Op("B", 0), Op("F", 0))))
    with pytest.raises(ScheduleDeadlock, match=r"schedule 'bad' deadlocks: stage 0 at B0; stage 1 at B0"):
        compile_plan(bad)


def test_shape_errors():
    plan = compile_plan(schedule_order("1f1b", 2, 3))
    with pytest.raises(ValueError, match=r"fwd_s must end in shape \(stages, chunks, microbatches\) = \(2, 1, 3\), got \(2, 3\)"):
        simulate(plan, np.ones((2, 3)), np.ones((2, 1, 3)))
    with pytest.raises(ValueError, match="durations must be finite and >= 0"):
        simulate(plan, -np.ones((2, 1, 3)), np.ones((2, 1, 3)))


def test_timeline_error_is_zero_on_own_output_and_sees_blocking_waits():
    from megatron_ext.pipeline.pipesim import timeline_error

    rng = np.random.default_rng(5)
    p, m = 3, 4
    plan = compile_plan(schedule_order("1f1b", p, m))
    fwd, bwd = rng.uniform(1, 2, (p, 1, m)), rng.uniform(2, 3, (p, 1, m))
    res = simulate(plan, fwd, bwd)
    timeline = {(int(plan.stage[j]),) + plan.op(j).key: (res.start[0, j], res.finish[0, j])
                for j in range(plan.num_ops)}
    assert timeline_error(res, timeline) == {"makespan_rel_error": 0.0, "start_mae_s": 0.0,
                                             "idle_max_abs_error_s": 0.0}
    # A real run that stalls 0.5 s (a blocking send) before everything that starts after t = 6.
    late = {k: ((t0 + 0.5, t1 + 0.5) if t0 >= 6.0 else (t0, t1)) for k, (t0, t1) in timeline.items()}
    shifted = sum(t0 >= 6.0 for t0, _ in timeline.values())
    err = timeline_error(res, late)
    end = max(t1 for _, t1 in timeline.values())
    assert err["makespan_rel_error"] == pytest.approx(-0.5 / (end + 0.5))
    assert err["start_mae_s"] == pytest.approx(0.5 * shifted / (2 * m * p))
    assert err["idle_max_abs_error_s"] == pytest.approx(0.5)
    del late[(0, "B", 3, 0)]
    with pytest.raises(KeyError, match="observed timeline lacks 1 op"):
        timeline_error(res, late)

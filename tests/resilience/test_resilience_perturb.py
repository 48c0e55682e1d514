"""Issue #47 item 2: the perturbed scorer, whose truths no policy is told."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.resilience import perturb, resihp_policy, setting
from megatron_ext.resilience.faults import FaultTrace
from megatron_ext.resilience.run import run_policy
from megatron_ext.resilience.sim import packed_documents


@pytest.fixture(scope="module")
def ctx():
    return setting.context("llama2-13b")


def test_each_run_draws_its_own_truths_from_the_seed(ctx):
    a, b = perturb.run_seed(0, "llama2-13b/gpu_lost"), perturb.run_seed(0, "llama2-13b/node_lost")
    assert a != b and a == perturb.run_seed(0, "llama2-13b/gpu_lost") and a != perturb.run_seed(1, "llama2-13b/gpu_lost")
    ta, tb = perturb.draw(ctx.num_devices, 0.2, a), perturb.draw(ctx.num_devices, 0.2, b)
    np.testing.assert_array_equal(ta.device_efficiency, perturb.draw(ctx.num_devices, 0.2, a).device_efficiency)
    assert not np.array_equal(ta.device_efficiency, tb.device_efficiency) and ta.nvlink != tb.nvlink
    for x in (ta.device_efficiency, ta.nic, np.array([ta.nvlink, ta.doc_median])):
        assert (x >= 0.8).all() and (x <= 1.2).all()
    assert ta.device_efficiency.std() > 0.05        # the spread is there, not one factor for all
    with pytest.raises(ValueError, match=r"--perturb must be a fraction in \[0, 1\), got 1.5"):
        perturb.draw(ctx.num_devices, 1.5, a)
    with pytest.raises(ValueError, match="the perturbation seed must be an int >= 0, got -1"):
        perturb.run_seed(-1, "x")


def test_the_scorer_runs_on_the_truths_and_the_policies_on_the_nominal_figures(ctx):
    assert ctx.data.sum_sq.tolist() == packed_documents(ctx.data.sum_sq.shape[0], seq_length=ctx.data.seq_length,
                                                        log_mean=perturb.LOG_MEAN).sum_sq.tolist()
    truths = perturb.draw(ctx.num_devices, 0.2, perturb.run_seed(0, "llama2-13b/gpu_slow_2x"))
    scorer = perturb.perturbed(ctx, truths)
    nominal, true = ctx.sim.healthy(ctx.start), scorer.healthy(ctx.start)
    assert abs(true.time_s / nominal.time_s - 1) > 0.02
    assert scorer.hw.nvlink_bytes_per_s == pytest.approx(ctx.hw.nvlink_bytes_per_s * truths.nvlink)
    # Without faults every policy runs at the scorer's healthy rate; the planner was built from
    # the nominal figures, never the drawn ones.
    tr = FaultTrace(ctx.num_devices, 8, [])
    pol = resihp_policy.make("resihp")
    r = run_policy(pol, ctx, tr, end_s=600.0, scorer=scorer)
    assert r.throughput_vs_healthy == pytest.approx(1.0, abs=1e-9)
    cl = pol.policy.planner.cluster
    assert (cl.device_flops, cl.link_bytes_per_s, cl.tp_bytes_per_s) == (
        ctx.hw.flops, ctx.hw.nic_bytes_per_s, ctx.hw.nvlink_bytes_per_s)
    assert pol.policy.planner.workload.attention_sq_per_sequence == pytest.approx(float(ctx.data.sum_sq.mean()))
    # Under a fault the two scorers give different throughputs for the same policy.
    sc = setting.scenarios(ctx)["gpu_slow_2x"]
    runs = [run_policy(resihp_policy.make("recycle"), ctx, setting.trace(ctx, sc), end_s=sc.end_s,
                       measure_from_s=sc.measure_from_s, scorer=s).throughput_vs_healthy for s in (ctx.sim, scorer)]
    assert runs[0] != pytest.approx(runs[1], abs=1e-4)

"""Issue #47 items 3 and 4: the oracle bounds every policy; held-out days from a commit hash; the
bench's flags and JSON."""
from __future__ import annotations

import json

import pytest

from megatron_ext.resilience import oracle, perturb, policies, resihp_policy, setting
from megatron_ext.resilience.faults import FaultTrace
from megatron_ext.resilience.run import run_policy
from tests.conftest import run_python

FAIR = policies.BASELINES + ("resihp",)


@pytest.fixture(scope="module")
def ctx():
    return setting.context("llama2-13b")


def test_the_oracle_is_at_least_every_policy_in_every_cell(ctx):
    planner = resihp_policy.ResiHP().planner(ctx)
    it_s = ctx.sim.healthy(ctx.start).time_s
    sc = setting.scenarios(ctx)
    for name in ("gpu_slow_2x", "gpu_lost", "node_lost", "nic_1/4"):
        s = sc[name]
        tr = setting.trace(ctx, s)
        truths = perturb.draw(ctx.num_devices, 0.2, perturb.run_seed(0, name))
        for scorer in (ctx.sim, perturb.perturbed(ctx, truths)):
            runs = [run_policy(resihp_policy.make(n), ctx, tr, end_s=s.end_s, measure_from_s=s.measure_from_s,
                               scorer=scorer) for n in FAIR]
            orc = oracle.run_oracle(ctx, tr, end_s=s.end_s, measure_from_s=s.measure_from_s, runs=runs,
                                    scorer=scorer, planner=planner)
            # A policy passes it by at most the iteration that straddles the fault's onset.
            slack = it_s / (s.end_s - s.measure_from_s)
            for r in runs:
                assert r.throughput_vs_healthy <= orc.throughput_vs_healthy + slack, (name, r.policy)
    # Without faults it runs the best of the start and the planner's healthy layout: no pause.
    tr = FaultTrace(ctx.num_devices, 8, [])
    orc = oracle.run_oracle(ctx, tr, end_s=600.0, planner=planner)
    assert orc.throughput_vs_healthy >= 1.0 and len(orc.choices) == 1
    assert oracle.run_oracle(ctx, tr, end_s=600.0).throughput_vs_healthy == pytest.approx(1.0)
    with pytest.raises(ValueError, match="the trace covers 16 devices, the context 264"):
        oracle.run_oracle(ctx, FaultTrace(16, 8, []), end_s=10.0)


def test_the_oracle_moves_off_a_lost_node_at_once_and_pays_nothing(ctx):
    s = setting.scenarios(ctx)["node_lost"]
    tr = setting.trace(ctx, s)
    orc = oracle.run_oracle(ctx, tr, end_s=s.end_s, measure_from_s=s.measure_from_s)
    # From the first second it runs the better of ReCycle's reroute and torchft's quorum (no runs
    # and no planner given): at that layout's rate, with no heartbeat wait, pause or rollback.
    (at, origin), = orc.choices
    assert at == s.measure_from_s and origin in ("reroute", "quorum")
    state = tr.state(s.measure_from_s)
    job = dict(oracle.candidates(ctx, ctx.sim, state, []))[origin]
    r, h = ctx.sim.iteration(job, state), ctx.sim.healthy(ctx.start)
    assert orc.throughput_vs_healthy == pytest.approx((r.tokens / r.time_s) / (h.tokens / h.time_s), rel=1e-9)
    recycle = run_policy(resihp_policy.make("recycle"), ctx, tr, end_s=s.end_s, measure_from_s=s.measure_from_s)
    assert recycle.throughput_vs_healthy < orc.throughput_vs_healthy


def test_held_out_seeds_derive_from_a_commit_hash():
    a, b = "0" * 39 + "1", "f" * 40
    assert setting.heldout_seeds(a, 5) == setting.heldout_seeds(a, 5) == setting.heldout_seeds(a.upper(), 5)
    assert setting.heldout_seeds(a, 3) == setting.heldout_seeds(a, 5)[:3]
    assert set(setting.heldout_seeds(a, 5)).isdisjoint(setting.heldout_seeds(b, 5))
    assert len(set(setting.heldout_seeds(a, 50))) == 50 and setting.STUDIED_SEED not in setting.heldout_seeds(a, 50)
    with pytest.raises(ValueError, match="a commit hash is 40 hex digits, got 'HEAD'"):
        setting.heldout_seeds("HEAD", 5)
    with pytest.raises(ValueError, match="--heldout-seeds must be a count >= 0, got -1"):
        setting.heldout_seeds(a, -1)
    ctx = setting.context("llama2-13b")
    seed = setting.heldout_seeds(a, 1)[0]
    day = setting.heldout_day(ctx, seed)
    assert day.name == f"mixed_day@{seed}" and day.faults != setting.scenarios(ctx)["mixed_day"].faults


def test_the_bench_names_bad_flags_and_its_json_carries_the_new_figures():
    proc = run_python("tools/bench_resilience.py", "--seed-from", "no-such-rev", "--no-validate", check=False)
    assert proc.returncode == 2 and "--seed-from 'no-such-rev': not a commit of" in proc.stderr
    proc = run_python("tools/bench_resilience.py", "--perturb", "1.5", "--no-validate", check=False)
    assert proc.returncode == 2 and "--perturb must be a fraction in [0, 1), got 1.5" in proc.stderr
    proc = run_python("tools/bench_resilience.py", "--models", "llama2-13b", "--scenarios", "gpu_lost",
                      "--heldout-seeds", "0", "--no-validate")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    key = "llama2-13b/gpu_lost"
    assert out["heldout"] is None
    assert out["perturbed"]["scale"] == 0.2 and set(out["perturbed"]["scenarios"][key]) == {*FAIR, "oracle"}
    assert out["oracle"][key] == out["scenarios"][key]["oracle"]
    frac = out["oracle_fraction"]["cells"]["resihp"][key]
    assert frac == pytest.approx(out["scenarios"][key]["resihp"] / out["oracle"][key], abs=1e-4)
    assert set(out["goals"]) == {"nominal", "perturbed"}
    assert "perturbed scorer (+/-20 %" in proc.stdout and "goals (issue #47)" in proc.stdout

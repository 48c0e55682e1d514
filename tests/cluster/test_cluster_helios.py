"""--helios-compat against a second-by-second reference of the Helios artifact's loop, job by job."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cluster import helios_reference as ref
from tests.cluster.cluster_helpers import FULL_TRACE, FULL_VC, cfg, data, job
from megatron_ext.cluster.engine import VCSimulator, simulate
from megatron_ext.cluster.helios import HeliosVCSimulator
from megatron_ext.cluster.metrics import summarize
from megatron_ext.cluster.policies import noisy_estimates
from megatron_ext.cluster.trace import VCSpec, read_trace, read_vc_config

GPU_CHOICES = [1, 1, 1, 1, 2, 2, 4, 8, 12, 16]


def random_jobs(seed: int, n: int, horizon: int, max_dur: int, gpu_choices=GPU_CHOICES, max_gpus=24):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        gpus = min(int(rng.choice(gpu_choices)), max_gpus)
        out.append(job(f"j{k}", float(rng.integers(0, horizon)), float(rng.integers(1, max_dur)), gpus))
    out.sort(key=lambda j: j.submit)
    return out


def run_both(jobs, nodes: int, gpn: int, policy: str, seed: int = 0):
    spec = VCSpec("vc", nodes, gpn)
    c = cfg(policy=policy, helios_compat=True, estimator_seed=seed)
    mine = HeliosVCSimulator(spec, jobs, c).run().states
    prio = [0] * len(jobs)
    if policy == "qssf":
        est = noisy_estimates(np.array([j.duration for j in jobs]), seed)
        prio = [int(e) * j.gpus for e, j in zip(est, jobs)]
    theirs = ref.simulate([ref.RefJob(i, int(j.submit), int(j.duration), j.gpus, prio[i]) for i, j in enumerate(jobs)],
                          nodes, gpn, policy)
    return mine, theirs


def assert_same(mine, theirs):
    got = [(js.start, js.end, js.wait_s, js.preemptions) for js in mine]
    want = [(r.start, r.end, r.queue, r.ckpt_times) for r in theirs]
    assert got == want


@pytest.mark.parametrize("policy", ["fifo", "sjf", "qssf", "srtf"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_matches_tick_reference_on_busy_traces(policy, seed):
    jobs = random_jobs(seed, n=120, horizon=600, max_dur=150)
    mine, theirs = run_both(jobs, nodes=3, gpn=8, policy=policy, seed=seed)
    assert_same(mine, theirs)
    assert max(r.queue for r in theirs) > 0, "trace too light to exercise queueing"
    if policy == "srtf":
        assert sum(r.ckpt_times for r in theirs) > 0, "trace too light to exercise preemption"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), nodes=st.integers(1, 3), policy=st.sampled_from(["fifo", "sjf", "qssf", "srtf"]))
def test_matches_tick_reference_property(seed, nodes, policy):
    jobs = random_jobs(seed, n=40, horizon=120, max_dur=60, max_gpus=nodes * 8)
    mine, theirs = run_both(jobs, nodes=nodes, gpn=8, policy=policy, seed=seed)
    assert_same(mine, theirs)


def test_srtf_ends_one_tick_late_and_charges_checkpoints():
    # 1 node x 1 GPU: a long job, then a short one that preempts it.
    jobs = [job("long", 0, 100), job("short", 10, 5)]
    states = HeliosVCSimulator(VCSpec("vc", 1, 1), jobs, cfg(policy="srtf", helios_compat=True)).run().states
    long_, short = states
    assert (short.start, short.end, short.wait_s) == (10, 16, 0)      # 5 s of work, ends a tick late
    # long ran ticks 1..10 (10 s done), pays 7 s of checkpoint: 97 s left, restarts at 16, ends 16+97+1
    assert (long_.start, long_.end, long_.preemptions, long_.wait_s) == (0, 114, 1, 6)


def test_fifo_blocks_at_head_without_backfill():
    # 2 nodes x 8: an 8-GPU job waits for a whole node; the 1-GPU job behind it must wait too.
    jobs = [job("a", 0, 100, 1), job("b", 0, 100, 8), job("c", 1, 100, 8), job("d", 2, 10, 1)]
    states = HeliosVCSimulator(VCSpec("vc", 2, 8), jobs, cfg(policy="fifo", helios_compat=True)).run().states
    assert [s.start for s in states] == [0, 0, 100, 100]


@pytest.mark.parametrize("policy", ["fifo", "sjf"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_engine_equals_helios_for_fifo_and_sjf_at_integer_times(policy, nodes):
    """The general engine, configured like Helios (consolidate, no backfill), is the same machine
    for non-preemptive FIFO and SJF when times are integers."""
    vcs = read_vc_config(data("philly_vc_tight.csv"))
    trace = read_trace(data("philly_small.csv"), vcs, load_scale=1.0)
    jobs = [j for j in trace.jobs if j.vc == "6214e9"]
    spec = VCSpec("6214e9", nodes, 8)
    a = VCSimulator(spec, jobs, cfg(policy=policy)).run().states
    b = HeliosVCSimulator(spec, jobs, cfg(policy=policy, helios_compat=True)).run().states
    assert [(s.start, s.end) for s in a] == [(s.start, s.end) for s in b]
    assert max(s.wait_s for s in a) > 0


def test_helios_compat_rejects_policies_it_lacks():
    from megatron_ext.config.base import ConfigError

    with pytest.raises(ConfigError, match="--policy tiresias has no counterpart in the Helios simulator"):
        cfg(policy="tiresias", helios_compat=True)
    with pytest.raises(ConfigError, match="--helios-compat fixes --placement consolidate and --backfill none"):
        cfg(policy="fifo", helios_compat=True, backfill="greedy")


def test_full_trace_fifo_engine_equals_helios_and_every_job_finishes():
    vcs = read_vc_config(FULL_VC)
    trace = read_trace(FULL_TRACE, vcs)
    assert len(trace.jobs) == 82229 and trace.dropped_total == 18
    ra = simulate(trace, cfg(policy="fifo"))
    rb = simulate(trace, cfg(policy="fifo", helios_compat=True))
    a, b = summarize(ra), summarize(rb)
    assert a["jobs"] == b["jobs"] == 82229
    assert a["avg_jct_s"] == b["avg_jct_s"] and a["per_vc"] == b["per_vc"]
    jobs_a = [(js.job.job_id, js.start, js.end) for v in ra.vcs for js in v.states]
    jobs_b = [(js.job.job_id, js.start, js.end) for v in rb.vcs for js in v.states]
    assert jobs_a == jobs_b

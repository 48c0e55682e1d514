"""The resilience simulator: parity with pipesim, what a slow device and a slow link cost, its inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_ext.models.flops import layer_linear_flops_per_token
from megatron_ext.pipeline.pipesim import compile_plan, simulate
from megatron_ext.pipeline.schedule_orders import megatron_1f1b
from megatron_ext.resilience.faults import Fault, FaultTrace, healthy_state
from megatron_ext.resilience.hardware import Hardware
from megatron_ext.resilience.job import Job, Pipeline, balanced_layers, node_aligned_job
from megatron_ext.resilience.resihp_policy import model_spec
from megatron_ext.resilience.shapes import SHAPES, ModelShape, shape
from megatron_ext.resilience.sim import Simulator, compiled, packed_documents, ring_s, run_pipelines

HW = Hardware()
SMALL = ModelShape(name="small", source="test", num_layers=8, hidden_size=1024, num_attention_heads=8,
                   num_query_groups=8, ffn_hidden_size=2816, vocab_size=32000)


def sim(shape_=SMALL, m=16) -> Simulator:
    return Simulator(shape_, HW, packed_documents(m, seq_length=2048, seed=3))


def pipe(devices, layers=(2, 2, 2, 2), m=16, **kw) -> Pipeline:
    return Pipeline(stages=tuple((d,) for d in devices), layers=layers, microbatches=m, **kw)


def test_dataflow_matches_pipesim_on_a_healthy_pipeline():
    rng = np.random.default_rng(0)
    p, m = 4, 8
    fwd = rng.uniform(1.0, 2.0, (3, p, m))
    bwd = rng.uniform(2.0, 4.0, (3, p, m))
    lat = 0.05   # below every op: the link queue never binds
    ref = simulate(compile_plan(megatron_1f1b(p, m)), fwd[:, :, None, :], bwd[:, :, None, :], p2p_latency_s=lat)
    for blocking in (False, True):
        # A send shorter than the gap between two sends on its link: blocking adds it to the
        # sender's next op only where that op would start before it ends.
        ms, busy = run_pipelines(compiled(p, m), fwd, bwd, np.full((3, p - 1), lat), np.full((3, p - 1), lat),
                                 blocking=blocking)
        if not blocking:
            np.testing.assert_allclose(ms, ref.makespan_s, rtol=1e-12)
        else:
            assert (ms >= ref.makespan_s - 1e-12).all()
        np.testing.assert_allclose(busy, ref.busy_s, rtol=1e-12)
    zero = np.zeros((3, p - 1))
    ms0, _ = run_pipelines(compiled(p, m), fwd, bwd, zero, zero, blocking=True)
    ref0 = simulate(compile_plan(megatron_1f1b(p, m)), fwd[:, :, None, :], bwd[:, :, None, :])
    np.testing.assert_allclose(ms0, ref0.makespan_s, rtol=1e-12)


def test_it_runs_megatrons_1f1b_with_the_pipelines_extra_warmup():
    for extra in ((), (2, 1, 0, 0)):
        ours, megatrons = compiled(4, 8, extra), compile_plan(megatron_1f1b(4, 8, extra))
        for field in ("stage", "microbatch", "is_forward", "prev", "prod"):
            np.testing.assert_array_equal(getattr(ours, field), getattr(megatrons, field))


def test_a_slow_device_slows_exactly_its_stage():
    s = sim()
    job = Job((pipe([0, 1, 2, 3]),))
    healthy = healthy_state(8)
    slow = healthy_state(8)
    slow.speed[2] = 0.5
    f0, b0, send0 = s.op_seconds(job, healthy, 0)
    f1, b1, send1 = s.op_seconds(job, slow, 0)
    np.testing.assert_allclose(f1[2], 2 * f0[2])   # TP1: no collective to stay at link speed
    np.testing.assert_allclose(b1[2], 2 * b0[2])
    for k in (0, 1, 3):
        np.testing.assert_allclose(f1[k], f0[k])
    np.testing.assert_allclose(send1, send0)
    # The iteration is the 1F1B pipeline of exactly those ops (sends not holding the sender).
    job_async = Job((pipe([0, 1, 2, 3], async_sends=True),))
    ref = simulate(compile_plan(megatron_1f1b(4, 16)), f1[None, :, None, :], b1[None, :, None, :],
                   p2p_latency_s=float(send1[0]))
    r = s.iteration(job_async, slow)
    assert r.compute_s == pytest.approx(float(ref.makespan_s[0]), rel=1e-12)
    # ... and the slow stage is the bottleneck: at least its own busy time.
    assert r.compute_s >= f1[2].sum() + b1[2].sum()


def test_one_slow_tp_member_slows_its_whole_group_and_only_it():
    s = sim()
    job = Job((Pipeline(stages=((0, 1), (2, 3)), layers=(4, 4), microbatches=16),))
    st = healthy_state(8)
    st.speed[1] = 0.5
    f_h, _, _ = s.op_seconds(job, healthy_state(8), 0)
    f_s, _, _ = s.op_seconds(job, st, 0)
    assert f_s[0, 0] > 1.9 * f_h[0, 0] - 1e-3 and f_s[1, 0] == f_h[1, 0]


def test_a_slow_link_costs_in_proportion_to_its_bandwidth():
    s = sim()
    job = Job((pipe([0, 8], layers=(4, 4)),))          # two nodes: the stage link is a NIC path
    lat = HW.nic_latency_s
    sends = []
    for f in (1.0, 2.0, 4.0):
        st = FaultTrace(16, 8, [Fault("slow_path", (0, 1), 0.0, factor=f)] if f > 1 else []).state(1.0)
        sends.append(s.op_seconds(job, st, 0)[2][0] - lat)
    assert sends[1] == pytest.approx(2 * sends[0]) and sends[2] == pytest.approx(4 * sends[0])
    nbytes = 2.0 * 2048 * SMALL.hidden_size
    assert sends[0] == pytest.approx(nbytes / HW.nic_bytes_per_s)
    # A NIC at 1/2 doubles the bandwidth term of the data-parallel ring through it.
    ring = [0, 8, 16, 24]
    st = healthy_state(32)
    t1 = ring_s(ring, 1e9, st, HW) - 6 * lat
    st.nic[16] = 0.5
    assert ring_s(ring, 1e9, st, HW) - 6 * lat == pytest.approx(2 * t1)
    # Inside a node the same transfer rides NVLink and no NIC matters.
    st.nic[0] = 0.01
    assert ring_s([0, 1], 1e9, st, HW) == pytest.approx(1e9 / HW.nvlink_bytes_per_s + 2 * HW.nvlink_latency_s)


def test_a_slow_send_holds_a_megatron_sender_but_not_an_async_one():
    s = sim()
    st = FaultTrace(16, 8, [Fault("slow_path", (0, 1), 0.0, factor=1e4)]).state(1.0)
    blocking = s.iteration(Job((pipe([0, 8], layers=(4, 4)),)), st).compute_s
    free = s.iteration(Job((pipe([0, 8], layers=(4, 4), async_sends=True),)), st).compute_s
    assert blocking > free


def test_grad_sync_and_optimizer_scale_with_the_job():
    sh = shape("llama2-7b")
    s = Simulator(sh, HW, packed_documents(64, seed=1))
    job = node_aligned_job(sh, tp=2, pp=4, dp=4, global_microbatches=64, layers=balanced_layers(sh, 4))
    r = s.healthy(job)
    assert r.time_s == pytest.approx(r.compute_s + r.grad_sync_s + r.optimizer_s)
    assert r.grad_sync_s > 0 and r.tokens == 64 * 4096
    one = Job(job.pipelines[:1])
    assert s.healthy(one).grad_sync_s == 0.0


def test_flops_agree_with_resihps_count_where_both_count_the_same():
    for name in ("llama2-7b", "llama2-70b", "qwen2.5-14b"):
        sh = SHAPES[name]
        assert sh.layer_linear_flops() == pytest.approx(layer_linear_flops_per_token(model_spec(sh)))


def test_bad_input_is_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="unknown kind 'slow_gpu'"):
        FaultTrace(16, 8, [Fault("slow_gpu", 1, 0.0, factor=2.0)])
    with pytest.raises(ValueError, match="a slowdown needs a finite factor >= 1, got 0.5"):
        FaultTrace(16, 8, [Fault("slow_device", 1, 0.0, factor=0.5)])
    with pytest.raises(ValueError, match=r"end_s \(5.0\) must be after start_s \(10.0\)"):
        FaultTrace(16, 8, [Fault("slow_device", 1, 10.0, 5.0, factor=2.0)])
    with pytest.raises(ValueError, match="target must be a node in 0..1"):
        FaultTrace(16, 8, [Fault("stop_node", 2, 0.0)])
    with pytest.raises(ValueError, match=r"a slow_path targets two different nodes \(a, b\) in 0..1"):
        FaultTrace(16, 8, [Fault("slow_path", (1, 1), 0.0, factor=2.0)])
    with pytest.raises(ValueError, match="12 devices do not make whole nodes of 8"):
        FaultTrace(12, 8, [])
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        pipe([0, 1], layers=(0, 8))
    with pytest.raises(ValueError, match="used twice"):
        Job((pipe([0, 1], layers=(4, 4)), pipe([1, 2], layers=(4, 4))))
    with pytest.raises(ValueError, match="unknown model shape 'gpt5'"):
        shape("gpt5")
    st = healthy_state(4)
    st.speed[1] = 0.0
    from megatron_ext.resilience.sim import DeviceGone
    with pytest.raises(DeviceGone, match=r"device\(s\) \[1\] of the job are gone"):
        sim().iteration(Job((pipe([0, 1], layers=(4, 4)),)), st)


def test_overlapping_faults_multiply_and_end():
    tr = FaultTrace(16, 8, [Fault("slow_node", 0, 10.0, 20.0, 2.0), Fault("slow_device", 3, 15.0, math.inf, 1.5)])
    assert tr.state(5.0).speed[3] == 1.0
    assert tr.state(16.0).speed[3] == pytest.approx(1 / 3)
    assert tr.state(16.0).speed[4] == 0.5
    assert tr.state(25.0).speed[3] == pytest.approx(1 / 1.5) and tr.state(25.0).speed[4] == 1.0

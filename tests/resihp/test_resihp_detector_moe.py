"""The detector on mixture-of-experts traces (the device model's experts: routing drawn per
micro-batch from a drifting expert popularity, tile-quantised expert GEMMs, a fixed cost per
expert): the routed counts remove the false alarms uniform routing raises on imbalanced routing, a
slow expert rank is still named, the expert rate is kept only where the routing varied, and a
routing shift past the calibration refits at once."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_ext.models.flops import stage_costs
from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.detector import ResiHPDetector
from megatron_ext.resihp.synthetic_device import DeviceFault, DeviceJob, generate_device

JOB = dict(stages=2, microbatches=4, dp=4, num_experts=8, ep=4, hidden_size=1024, seq_length=4096, stall_prob=0.0)


def run(records, *, uniform: bool = False, detector: ResiHPDetector | None = None):
    det = detector or ResiHPDetector(ResiHPConfig())
    verdicts = []
    for rec in records:
        verdicts += det.observe(dataclasses.replace(rec, routed_tokens=None) if uniform else rec).verdicts
    return det, [(v.iteration, v.rank) for v in verdicts if v.kind == "fail_slow"]


def test_synthetic_moe_records_are_dropless_and_imbalanced():
    trace = generate_device(DeviceJob(**JOB, iterations=30, routing_alpha=0.3, seed=2))
    for rec in trace.records:
        # EP groups are 4 consecutive DP ranks of a stage; every pair of the group's tokens is
        # computed by one of them: top-k x layers x 4 sequences.
        per_group = rec.routed_tokens[:, 0].reshape(2, 4, 4).sum(axis=1)
        assert (per_group == 2 * 2 * 4 * 4096).all()
    assert np.median(trace.max_share) > 0.35  # the busiest of 4 EP ranks: 0.25 if balanced


@pytest.mark.parametrize("seed", [2, 4])
def test_routed_counts_remove_the_false_alarms_of_imbalanced_routing(seed):
    records = generate_device(DeviceJob(**JOB, iterations=120, routing_alpha=0.3, seed=seed)).records
    _, with_counts = run(records)
    _, uniform = run(records, uniform=True)
    assert with_counts == []
    assert uniform, "uniform routing should misread this imbalance as slow ranks"


def test_slow_expert_rank_is_named_under_imbalanced_routing():
    fault = DeviceFault(rank=5, since=50, factor=1.5)
    records = generate_device(DeviceJob(**JOB, iterations=100, routing_alpha=0.3, faults=(fault,), seed=3)).records
    _, found = run(records)
    assert found and {r for _, r in found} == {5} and found[0][0] >= 50


def test_expert_rate_is_kept_where_routing_varies_and_matches_the_device():
    job = DeviceJob(**JOB, iterations=40, routing_alpha=0.3, op_noise=0.01, rank_noise=0.0, seed=1)
    det, _ = run(generate_device(job).records)
    # Seconds per expert FLOP the device spends on average (tiles, per-expert cost aside).
    device = 1.0 / (job.peak_flops_per_s * job.gemm_efficiency)
    rate = det.coef[..., det.classes.index("expert")]
    assert (rate > 0).all()
    np.testing.assert_allclose(rate, device, rtol=0.25)


def test_expert_rate_is_dropped_where_routing_did_not_vary():
    # Balanced routing: a stage's counts move by a per cent or so, too little to fix the rate.
    job = DeviceJob(**JOB, iterations=40, routing_alpha=1e4, routing_spread=1e4, seed=2)
    det, found = run(generate_device(job).records)
    assert found == []
    assert (det.coef[..., det.classes.index("expert")] == 0).all()


def test_routing_shift_past_the_calibration_refits_at_once():
    balanced = generate_device(DeviceJob(**JOB, iterations=40, routing_alpha=1e4, routing_spread=1e4, seed=0)).records
    skewed = generate_device(DeviceJob(**JOB, iterations=30, first_iteration=41, routing_alpha=0.3, seed=100)).records
    det = ResiHPDetector(ResiHPConfig())
    fits = []
    for rec in balanced + skewed:
        det.observe(rec)
        if det._last_fit == det.seen:  # fitted on this iteration
            fits.append(rec.iteration)
    # Scheduled refits at the end of warm-up (20) and every 25 after it (45, 70); the shift at 41
    # refits there, and again at most every refit_every // 5 = 5 iterations while it is still
    # outside what the calibration saw.
    assert fits[:2] == [20, 41]
    scheduled = {20, 45, 70}
    assert scheduled <= set(fits)
    assert all(b - a >= 5 for a, b in zip(fits, fits[1:]) if b not in scheduled), fits


def test_dense_models_keep_two_flop_classes_and_uniform_moe_costs_add_up():
    dense = generate_device(DeviceJob(stages=2, microbatches=4, iterations=25, seed=0)).records
    det, _ = run(dense)
    assert det.classes == ("linear", "attention") and det.coef.shape == (2, 2, 3)
    # Uniform routing (no counts): a chunk's expert FLOPs are top-k pairs per token and MoE layer.
    spec = generate_device(DeviceJob(**JOB, iterations=1, seed=0)).records[0].model
    (c0,), (c1,) = stage_costs(spec, 2)
    tokens = 4096.0
    uniform, routed = c0.forward(tokens, 0.0), c0.forward(tokens, 0.0, routed_pairs=2 * 2 * tokens)
    assert uniform == routed and c0.pairs_per_token == 2 * 2
    assert c1.fwd_per_pair == c0.fwd_per_pair == 4 * spec.hidden_size * spec.expert_ffn

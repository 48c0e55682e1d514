"""The device-model generator (``synthetic_device``): deterministic by seed, its stalls, phases,
host noise and faults really in the durations, labels where the faults are and nowhere else, and
a cost form the detector's (tokens, squared lengths) regression cannot fit exactly."""
import numpy as np
import pytest

from megatron_ext.resihp.synthetic_device import (CORPORA, DeviceFault, DeviceJob, generate_device, pack_stream,
                                                  random_job)

SMALL = dict(stages=4, microbatches=4, tp=1, dp=2, iterations=120, seq_length=4096, hidden_size=512,
             num_attention_heads=8)


def test_same_seed_same_trace_other_seed_other_trace():
    job = DeviceJob(**SMALL, seed=5)
    a, b = generate_device(job), generate_device(job)
    c = generate_device(DeviceJob(**SMALL, seed=6))
    for ra, rb in zip(a.records, b.records):
        assert np.array_equal(ra.fwd_s, rb.fwd_s) and np.array_equal(ra.bwd_s, rb.bwd_s)
        assert ra.documents == rb.documents and ra.iteration_s == rb.iteration_s
    assert a.stalls == b.stalls and a.phases == b.phases
    assert not np.array_equal(a.records[0].fwd_s, c.records[0].fwd_s)


def test_packing_fills_every_sequence_exactly_and_splits_documents_at_boundaries():
    rng = np.random.default_rng(0)
    seqs, seq = pack_stream(rng, 6, 1000, 700.0, 1.3)
    assert len(seqs) == 6
    assert all(int(s.sum()) == 1000 and (s >= 1).all() for s in seqs)
    assert np.all(np.diff(seq) >= 0)


def test_phases_cover_the_run_and_change_the_documents():
    job = DeviceJob(**SMALL, phase_length=(20, 30), seed=1)
    tr = generate_device(job)
    its = [it for ph in tr.phases for it in range(ph.first, ph.last + 1)]
    assert its == [r.iteration for r in tr.records]  # contiguous, no gap, no overlap
    assert all(a.corpus != b.corpus for a, b in zip(tr.phases, tr.phases[1:]))
    by_corpus: dict[str, list[float]] = {}
    for ph in tr.phases:
        for r in tr.records[ph.first - 1:ph.last]:
            docs = [d for row in r.documents for mb in row for d in mb]
            by_corpus.setdefault(ph.corpus, []).append(float(np.median(docs)))
    assert len(by_corpus) >= 3
    # The observed median document follows the corpus (cut pieces pull it down a little).
    order = sorted(by_corpus, key=lambda c: CORPORA[c][0])
    meds = [np.median(by_corpus[c]) for c in order]
    assert meds == sorted(meds), dict(zip(order, meds))


def test_stalls_are_present_short_within_bounds_and_unlabelled():
    job = DeviceJob(**SMALL, stall_prob=0.02, host_noise=0.0, node_noise=0.0, host_spike_prob=0.0, seed=2)
    tr = generate_device(job)
    assert len(tr.stalls) >= 5
    for s in tr.stalls:
        assert 1 <= s.last - s.first + 1 <= 3 and 1.5 <= s.factor <= 2.5
        k = np.arange(s.first, min(s.last, job.iterations) + 1) - 1
        assert np.allclose(tr.stall_mult[k, s.rank], s.factor)
    assert all(r.faults == () for r in tr.records)  # stalls are not faults
    # The stalled rank's compute really is slower than in the iterations around it.
    s = tr.stalls[0]
    busy = np.array([r.fwd_s[s.rank].sum() + r.bwd_s[s.rank].sum() for r in tr.records])
    peers = np.array([np.median(r.fwd_s.sum(axis=(1, 2)) + r.bwd_s.sum(axis=(1, 2))) for r in tr.records])
    ratio = busy / peers
    assert ratio[s.first - 1] > 1.3 * np.median(ratio)


def test_step_and_ramp_faults_are_labelled_from_onset_and_applied():
    step = DeviceFault(rank=3, since=40, factor=2.0, until=90)
    ramp = DeviceFault(rank=5, since=50, factor=3.0, ramp=20)
    job = DeviceJob(**SMALL, faults=(step, ramp), stall_prob=0.0, seed=3)
    tr = generate_device(job)
    for r in tr.records:
        ranks = {f.rank for f in r.faults}
        assert (3 in ranks) == (40 <= r.iteration <= 90)
        assert (5 in ranks) == (r.iteration >= 50)
        assert all(f.kind == "slow" for f in r.faults)
    assert tr.fault_mult[39, 3] == 2.0 and tr.fault_mult[38, 3] == 1.0 and tr.fault_mult[90, 3] == 1.0
    ramp_mult = tr.fault_mult[49:75, 5]
    assert np.all(np.diff(ramp_mult[:20]) > 0) and ramp_mult[0] == pytest.approx(1.1)
    assert np.allclose(ramp_mult[19:], 3.0)


def test_bad_jobs_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="fault rank 99"):
        DeviceJob(**SMALL, faults=(DeviceFault(rank=99, since=1, factor=2.0),))
    with pytest.raises(ValueError, match="factor must be > 1"):
        DeviceFault(rank=0, since=1, factor=0.9)
    with pytest.raises(ValueError, match="corpora"):
        DeviceJob(**SMALL, corpora=("poetry",))
    with pytest.raises(ValueError, match="kind must be"):
        random_job(np.random.default_rng(0), iterations=100, kind="flaky")


def test_the_detectors_cost_form_does_not_fit_the_device_model_exactly():
    """Least squares of healthy, noise-free op times on the detector's features (tokens, sum of
    squared lengths, 1) per rank leaves a residual; on the FLOPs-form generator it would be ~0."""
    job = DeviceJob(**SMALL, op_noise=0.0, rank_noise=0.0, host_noise=0.0, node_noise=0.0, host_spike_prob=0.0,
                    stall_prob=0.0, phase_length=(10, 20), seed=4)
    tr = generate_device(job)
    x, y = [], []
    for r in tr.records:
        tokens, sq = r.doc_stats
        for i in range(job.microbatches):
            x.append([tokens[0, i], sq[0, i], 1.0])
            y.append(r.fwd_s[0, 0, i])  # rank 0: stage 0, replica 0
    x, y = np.asarray(x), np.asarray(y)
    coef, *_ = np.linalg.lstsq(x / x.max(axis=0), y, rcond=None)
    resid = y - (x / x.max(axis=0)) @ coef
    assert np.sqrt(np.mean(resid ** 2)) / y.mean() > 0.02

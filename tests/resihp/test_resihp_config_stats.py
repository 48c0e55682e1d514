"""Config flags and validation; the robust statistics under the detector."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_ext.config.base import ConfigError, add_flags, build, field_names
from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.stats import Persistence, huber_fit, loo_median, robust_scale


def test_flag_list_is_pinned():
    assert field_names(ResiHPConfig) == [
        "resihp", "resihp_detector", "resihp_threshold", "resihp_zscore", "resihp_window", "resihp_severe_factor",
        "resihp_severe_window", "resihp_warmup",
        "resihp_calibration_window", "resihp_refit_every", "resihp_rank_bias_max", "resihp_common_mode",
        "resihp_noise_floor",
        "resihp_p2p_latency_s", "resihp_links", "resihp_link_floor_ms", "resihp_link_severe_factor",
        "resihp_nic_probe_interval", "resihp_nic_probe_kb",
        "resihp_trace_out", "resihp_verdicts_out", "resihp_control_file", "resihp_act", "resihp_act_reshape",
        "resihp_act_min_gain", "resihp_act_min_gain_healthy",
        "resihp_act_horizon"]


def test_flags_and_yaml_values_build():
    parser = argparse.ArgumentParser()
    add_flags(parser, ResiHPConfig)
    args = parser.parse_args(["--resihp", "--resihp-window", "5", "--resihp-trace-out", "t.jsonl"])
    cfg = build(ResiHPConfig, vars(args), where="flags")
    assert (cfg.resihp, cfg.resihp_window, cfg.resihp_trace_out, cfg.resihp_threshold) == (True, 5, "t.jsonl", 1.25)
    cfg = build(ResiHPConfig, {"resihp_threshold": "1.5"}, where="run.yaml")
    assert cfg.resihp_threshold == 1.5


@pytest.mark.parametrize("kw,message", [
    ({"resihp_threshold": 1.0}, "--resihp-threshold must be > 1 (a slowdown factor), got 1.0"),
    ({"resihp_warmup": 2}, "--resihp-warmup must be >= 3 (calibration needs a few iterations), got 2"),
    ({"resihp_calibration_window": 10}, "--resihp-calibration-window (10) must be >= --resihp-warmup (20)"),
    ({"resihp_rank_bias_max": 1.3}, "--resihp-rank-bias-max (1.3) must be below --resihp-threshold (1.25)"),
    ({"resihp_detector": "fancy"}, "--resihp-detector must be one of resihp, raw, got 'fancy'"),
    ({"resihp_link_floor_ms": 0.0}, "--resihp-link-floor-ms must be > 0, got 0.0"),
    ({"resihp_window": 1}, "--resihp-window must be >= 2 while --resihp-links is on"),
    ({"resihp_severe_factor": 1.2}, "--resihp-severe-factor must be 0 (off) or >= --resihp-threshold (1.25), got 1.2"),
    ({"resihp_severe_window": 0}, "--resihp-severe-window must be >= 1, got 0"),
    ({"resihp_link_severe_factor": 0.5}, "--resihp-link-severe-factor must be 0 (off) or > 1, got 0.5"),
    ({"resihp_nic_probe_interval": -1}, "--resihp-nic-probe-interval must be >= 0 (0: off), got -1"),
    ({"resihp_nic_probe_kb": 0}, "--resihp-nic-probe-kb must be >= 1, got 0"),
])
def test_bad_values_are_named(kw, message):
    with pytest.raises(ConfigError) as err:
        ResiHPConfig(**kw)
    assert str(err.value).startswith(message)


def test_huber_fit_exact_robust_and_batched():
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.uniform(1, 5, 400), rng.uniform(0, 100, 400), np.ones(400)])
    coef = np.array([0.3, 0.02, 1.0])
    y = x @ coef
    np.testing.assert_allclose(huber_fit(x, y), coef, rtol=1e-6)
    dirty = y.copy()
    dirty[:60] *= 3.0  # 15 % gross outliers
    plain = np.linalg.lstsq(x, dirty, rcond=None)[0]
    robust = huber_fit(x, dirty)
    assert np.abs(robust - coef).max() < 0.2 * np.abs(plain - coef).max()
    # A constant column (packed micro-batches: fixed tokens) makes the fit non-unique, not wrong.
    xc = x.copy()
    xc[:, 0] = 4.0
    yc = xc @ coef
    np.testing.assert_allclose(xc @ huber_fit(xc, yc), yc, rtol=1e-6)
    batch = huber_fit(np.stack([x, x]), np.stack([y, 2 * y]), np.stack([np.ones(400, bool), np.arange(400) < 200]))
    np.testing.assert_allclose(batch, [coef, 2 * coef], rtol=1e-6)


def test_robust_scale_is_normal_sigma_and_ignores_outliers():
    x = np.random.default_rng(1).normal(0, 2.0, 20000)
    x[:1000] = 1e6
    assert robust_scale(x) == pytest.approx(2.0, rel=0.1)  # 5 % outliers move it by ~6 %
    assert x.std() > 1e5


def test_persistence_needs_all_but_one_of_the_window_and_releases():
    p = Persistence(1, threshold=1.25, zscore=5.0, window=5)
    sig = np.array([0.02])
    feed = lambda s: p.update(np.array([s]), sig)  # noqa: E731
    # Two bursts (2 + 1 slow iterations) inside five: 3 of 5 flagged, not enough.
    assert [feed(s) for s in [1.0, 1.0, 2.0, 2.0, 1.0, 2.0, 1.0]] == [[]] * 7
    assert [feed(s) for s in [2.0, 2.0, 1.01, 2.2]] == [[]] * 4  # never more than 3 of the last 5
    (d,) = feed(2.0)                                          # 2 2 1.01 2.2 2: 4 of 5, convicted
    assert (d.kind, d.factor) == ("fail_slow", 2.0) and d.confidence == pytest.approx(1.0)
    assert feed(1.01) == [] and feed(2.0) == []               # convicted: no repeat
    out = [feed(1.0) for _ in range(5)]
    assert out[:4] == [[]] * 4 and out[4][0].kind == "recovered"
    # Past the threshold but within the noise: not flagged (z too small).
    q = Persistence(1, threshold=1.25, zscore=5.0, window=1)
    assert q.update(np.array([1.3]), np.array([0.1])) == []
    assert q.update(np.array([np.nan]), np.array([0.1])) == []
    assert q.update(np.array([1.6]), np.array([0.1]))[0].factor == 1.6


def test_nanmedian_matches_numpy():
    import warnings

    from megatron_ext.resihp.stats import nanmedian

    rng = np.random.default_rng(0)
    for shape in [(7,), (5, 6), (3, 4, 9)]:
        x = rng.normal(size=shape)
        x[rng.random(shape) < 0.3] = np.nan
        x.flat[0:shape[-1]] = np.nan  # an all-NaN slice along the last axis
        for axis in [None, *range(len(shape))]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                want = np.nanmedian(x, axis=axis)
            np.testing.assert_allclose(nanmedian(x, axis=axis), want, equal_nan=True)


def test_loo_median_is_the_median_of_the_others():
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        x = rng.normal(size=(2, n))
        x[rng.random((2, n)) < 0.3] = np.nan
        out = loo_median(x)
        for i in range(2):
            for j in range(n):
                others = np.delete(x[i], j)
                others = others[np.isfinite(others)]
                want = np.median(others) if len(others) else np.nan
                np.testing.assert_equal(out[i, j], want)
    # With two ranks, each is measured against the other, not against the mean of both.
    np.testing.assert_equal(loo_median(np.array([1.0, 2.0])), [2.0, 1.0])
    np.testing.assert_equal(loo_median(np.array([1.0, 1.0, 1.0, 3.0])), [1.0, 1.0, 1.0, 1.0])


def test_persistence_does_not_release_a_rank_still_between_release_level_and_threshold():
    """A convicted rank whose scores fall just under the threshold (unflagged, still ~1.2x slow)
    stays convicted; back at ~1.0 it is released within 2 * window iterations."""
    p = Persistence(1, threshold=1.25, zscore=2.0, window=8)
    sig = np.array([0.02])
    feed = lambda s: p.update(np.array([s]), sig)  # noqa: E731
    verdicts = [d for _ in range(8) for d in feed(1.3)]
    assert [d.kind for d in verdicts] == ["fail_slow"]
    assert [d for s in [1.2, 1.18, 1.22] * 20 for d in feed(s)] == []   # 60 unflagged, still slow
    assert bool(p.suspect[0])
    out = [feed(1.0) for _ in range(16)]
    released = [k for k, d in enumerate(out) if d]
    assert released and released[0] <= 15 and out[released[0]][0].kind == "recovered"
    assert not p.suspect[0]


def test_persistence_release_level_is_checked():
    with pytest.raises(ValueError, match="release level"):
        Persistence(1, threshold=1.25, zscore=2.0, window=8, release=1.3)


def test_a_severe_slowdown_is_named_after_the_severe_window_not_the_whole_window():
    sig = np.array([0.02])

    def first_verdict(scores, **kw):
        p = Persistence(1, threshold=1.25, zscore=5.0, window=8, **kw)
        for i, s in enumerate(scores):
            out = p.update(np.array([s]), sig)
            if out:
                return i, out[0]
        return None, None

    # 2x from the first iteration: the 4th names it (rule "severe"); without the rule, the 7th.
    i, d = first_verdict([2.0] * 10, severe=2.0, severe_window=4)
    assert (i, d.kind, d.rule, d.factor) == (3, "fail_slow", "severe", 2.0)
    i, d = first_verdict([2.0] * 10)
    assert (i, d.rule) == (6, "window")
    # 1.5x is below the severe level: the whole window, whatever the rule.
    assert first_verdict([1.5] * 10, severe=2.0, severe_window=4)[0] == 6
    # A 3-iteration pause at 3x (the synthetic traces' longest) twice, apart: never named.
    assert first_verdict([3.0] * 3 + [1.0] * 4 + [3.0] * 3 + [1.0] * 4, severe=2.0, severe_window=4)[0] is None
    # One iteration under the severe level restarts the count (flagged, but only the window counts it).
    i, d = first_verdict([2.5, 2.5, 2.5, 1.6, 2.5, 2.5, 2.5, 2.5], severe=2.0, severe_window=4)
    assert (i, d.rule) == (6, "window")
    with pytest.raises(ValueError, match="severe level must be >= threshold=1.25, got 1.1"):
        Persistence(1, threshold=1.25, zscore=2.0, window=8, severe=1.1)

"""The benchmark harness: rotated interleaving with an A/A arm, bootstrap intervals, verdicts
against the noise floor, provenance, and the one JSON line last."""
from __future__ import annotations

import io
import json
import re
import subprocess
from collections import Counter

import pytest

from megatron_ext.bench.harness import (Report, compare, format_comparison, interleave, provenance, ratio_interval,
                                        rotated_order)
from tests.conftest import ROOT


def test_rotation_puts_every_arm_first_equally_often_and_runs_each_once_per_round():
    arms = ["a", "b", "c"]
    orders = [rotated_order(arms, r) for r in range(9)]
    assert Counter(o[0] for o in orders) == {"a": 3, "b": 3, "c": 3}
    # every arm in every position equally often, not only first
    for pos in range(3):
        assert Counter(o[pos] for o in orders) == {"a": 3, "b": 3, "c": 3}
    assert all(sorted(o) == arms for o in orders)


def test_interleave_runs_the_aa_copy_in_the_rotation_and_records_what_ran():
    calls = []

    def arm(name, value):
        def run():
            calls.append(name)
            return value
        return run

    res = interleave({"runtime": arm("runtime", 2.0), "bare": arm("bare", 1.0)}, rounds=6)
    assert res.reference == "runtime"
    assert list(res.samples) == ["runtime", "bare", "runtime (A/A)"]
    assert res.samples == {"runtime": [2.0] * 6, "bare": [1.0] * 6, "runtime (A/A)": [2.0] * 6}
    assert Counter(o[0] for o in res.orders) == {"runtime": 2, "bare": 2, "runtime (A/A)": 2}
    assert all(sorted(o) == sorted(res.samples) for o in res.orders)
    # the callables ran in exactly the recorded orders (the A/A copy calls the reference's callable)
    flat = [n.replace(" (A/A)", "") for o in res.orders for n in o]
    assert calls == flat
    two = interleave({"x": arm("x", 1.0), "y": arm("y", 1.0)}, rounds=4, aa=None)
    assert list(two.samples) == ["x", "y"] and two.reference is None
    assert Counter(o[0] for o in two.orders) == {"x": 2, "y": 2}
    with pytest.raises(ValueError, match="the A/A arm 'z' is not one of the arms"):
        interleave({"x": arm("x", 1.0)}, rounds=1, aa="z")


def test_warmup_calls_are_dropped():
    n = iter(range(100))
    res = interleave({"a": lambda: float(next(n))}, rounds=2, aa=None, warmup=3)
    assert res.samples["a"] == [3.0, 4.0]


def test_ratio_interval_contains_the_median_and_is_deterministic():
    num = [1.10, 1.25, 1.05, 1.30, 1.15, 1.20, 0.98, 1.12]
    den = [1.0] * 8
    a = ratio_interval(num, den, seed=3)
    assert a == ratio_interval(num, den, seed=3)
    assert a["median"] == pytest.approx(sorted(num)[3] / 2 + sorted(num)[4] / 2)
    lo, hi = a["interval"]
    assert min(num) <= lo <= a["median"] <= hi <= max(num)
    assert lo < hi
    wider = ratio_interval(num, den, level=0.99, seed=3)["interval"]
    assert wider[0] <= lo and wider[1] >= hi
    with pytest.raises(ValueError, match="paired samples"):
        ratio_interval([1.0], [1.0, 2.0])


def test_identical_aa_samples_give_ratio_one_and_a_point_interval():
    samples = {"ref": [1.0, 2.0, 3.0, 4.0], "ref (A/A)": [1.0, 2.0, 3.0, 4.0], "slow": [1.5, 3.0, 4.5, 6.0]}
    res = compare(samples, "ref", higher_is_better=False)
    assert res["noise_floor"] == {"ratio": 1.0, "interval": [1.0, 1.0]}
    assert res["arms"]["slow"]["ratio_vs_reference"] == pytest.approx(1.5)
    assert res["arms"]["slow"]["interval"] == pytest.approx([1.5, 1.5])
    assert res["arms"]["slow"]["verdict"] == "worse"  # seconds: higher is worse
    assert compare(samples, "ref", higher_is_better=True)["arms"]["slow"]["verdict"] == "better"


def test_a_difference_inside_the_aa_floor_is_within_noise():
    ref = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    samples = {"ref": ref, "ref (A/A)": [1.0, 1.1, 0.9, 1.1, 0.9, 1.0], "b": [1.05, 1.06, 1.04, 1.05, 1.06, 1.04]}
    res = compare(samples, "ref", higher_is_better=False)
    assert res["arms"]["b"]["interval"][0] > 1.0  # beyond 1 ...
    assert res["arms"]["b"]["interval"][0] < res["noise_floor"]["interval"][1]  # ... but not beyond the floor
    assert res["arms"]["b"]["verdict"] == "within noise"
    table = format_comparison(res, "s")
    assert "noise floor" in table.splitlines()[-2] and "ref (A/A)" in table


def test_provenance_names_head_and_the_command():
    p = provenance([f"{ROOT}/tools/bench_x.py", "--iters", "4", "a b"])
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert p["commit"] == head.stdout.strip()
        assert isinstance(p["dirty"], bool)
    else:
        assert p["commit"] is None and p["dirty"] is None
    assert p["command"] == "python tools/bench_x.py --iters 4 'a b'"  # relative: no machine path


def test_report_prints_the_table_then_one_json_line_last():
    rep = Report("bench_parallel", argv=["tools/bench_parallel.py", "--rounds", "2"])
    out = io.StringIO()
    line = rep.emit({"overhead": 0.01, "rows": {"a": 1}}, "arm  median\nruntime 1.0", file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "arm  median"
    assert re.match(r"load average before \S+, after \S+ on \d+ cpus; commit ", lines[-2])
    parsed = json.loads(lines[-1])
    assert parsed == line
    assert parsed["bench"] == "bench_parallel" and parsed["overhead"] == 0.01 and parsed["rows"] == {"a": 1}
    assert parsed["command"] == "python tools/bench_parallel.py --rounds 2"
    for key in ("commit", "dirty", "load_before", "load_after", "cpus"):
        assert key in parsed
    assert parsed["load_after"] is None or len(parsed["load_after"]) == 3
    with pytest.raises(ValueError, match=r"figure keys \['commit'\] are the harness's own"):
        rep.line({"commit": 1})

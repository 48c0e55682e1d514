"""tools/bench_squeezer.py's comparisons: guest-on against guest-off iterations in rounds whose
order alternates, with an A/A pair of guest-off iterations, and each guest-on iteration against the
same iteration of the plain run and of its repeat."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_squeezer", os.path.join(ROOT, "tools", "bench_squeezer.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def rows(times: dict[int, float]) -> list[dict]:
    return [{"iteration": i, "iter_time_s": t} for i, t in sorted(times.items())]


def test_rounds_alternate_which_guest_on_iteration_is_paired_and_the_aa_is_the_second_off():
    times = {i: float(i) for i in range(1, 30)}          # odd: guest on, even: guest off
    r = bench.in_run_rounds(rows(times), start=6)        # the first round starts at 7 (odd)
    assert r["guest_off"] == [8.0, 12.0, 16.0, 20.0, 24.0]
    # even rounds: the on-iteration before the first off; odd rounds: the one after it
    assert r["guest_on"] == [7.0, 13.0, 15.0, 21.0, 23.0]
    assert r["guest_off (A/A)"] == [10.0, 14.0, 18.0, 22.0, 26.0]
    assert all(i % 2 for i in map(int, r["guest_on"])) and not any(int(x) % 2 for x in r["guest_off"])


def test_too_few_rounds_is_an_error_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"only 1 round\(s\) of four iterations after iteration 3: run more --iters"):
        bench.in_run_rounds(rows({i: 1.0 for i in range(1, 9)}), start=3)


def test_vs_plain_pairs_each_guest_on_iteration_with_the_same_iteration_of_both_plain_runs():
    sq = rows({i: 10.0 + i for i in range(1, 12)})
    plain = {"rows": rows({i: 1.0 * i for i in range(1, 11)})}
    again = {"rows": rows({i: 2.0 * i for i in range(2, 12)})}
    s = bench.vs_plain_samples(sq, plain, again, start=4)
    # odd iterations >= 4 present in all three runs: 5, 7, 9
    assert s == {"plain": [5.0, 7.0, 9.0], "squeezed": [15.0, 17.0, 19.0], "plain (A/A)": [10.0, 14.0, 18.0]}

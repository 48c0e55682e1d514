"""Regression: replay of traces recorded live on 4 CPU ranks (both engines, PP2xDP2 and PP4), stored
under tests/resihp/data/ (provenance and selection: data/README.md).

The injected slow rank must be named within 10 iterations of the fault, no other rank ever; a
healthy run must get no verdict. Replay is deterministic, so these pin the detector's behaviour on
real, noisy timings (a shared 2-core host), not on the synthetic generator's model of noise.
"""
from __future__ import annotations

import glob
import os

import pytest

from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.replay import replay
from megatron_ext.resihp.trace import read_trace

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TRACES = sorted(glob.glob(os.path.join(DATA, "*.trace.jsonl.gz")))
MAX_DELAY = 10


def test_there_are_traces_of_both_engines_layouts_and_kinds():
    names = [os.path.basename(t) for t in TRACES]
    for engine in ("megatron", "deepspeed"):
        for layout in ("pp2dp2", "pp4"):
            mine = [n for n in names if n.startswith(f"{engine}-{layout}-")]
            assert any("healthy" in n for n in mine), (engine, layout, names)
            assert any("slow" in n for n in mine), (engine, layout, names)


@pytest.mark.parametrize("path", TRACES, ids=[os.path.basename(t).split(".trace")[0] for t in TRACES])
def test_live_trace_replay(path):
    records = list(read_trace(path))
    res = replay(records, ResiHPConfig(), "resihp")
    slow = [v for v in res.verdicts if v.kind == "fail_slow"]
    faults = {(f.rank, f.since) for r in records for f in r.faults if f.kind == "slow"}
    if not faults:
        assert slow == [], [v.describe() for v in slow]
        return
    (rank, since), = faults
    assert slow, f"rank {rank} (slow from iteration {since}) was not named"
    assert {v.rank for v in slow} == {rank}, [v.describe() for v in slow]
    assert since <= slow[0].iteration <= since + MAX_DELAY, slow[0].describe()
    assert res.metrics is not None and res.metrics.precision == 1.0 and res.metrics.recall == 1.0

"""Regression: replay of every trace recorded live on 4 CPU ranks (both engines, PP2xDP2 and PP4,
and the MoE model on PP2xDP2 with EP2),
stored under tests/resihp/data/ (provenance: data/README.md), the detector's misses included.

Replay is deterministic, so each trace's outcome is pinned: the injected slow rank named within
10 iterations of the fault ("within"), named later ("late"), or not named ("missed"); never
another rank; no verdict at all on a healthy trace. A change of any outcome, better or worse,
fails here and must be recorded (with the figures in docs/resihp.md, "Live traces"). These pin
the detector's behaviour on real, noisy timings (a shared 2-core host), not on a generator's
model of noise. ``tools/bench_detector.py`` reports the recall per factor over the same set.
"""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.replay import replay
from megatron_ext.resihp.trace import read_trace

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TRACES = sorted(glob.glob(os.path.join(DATA, "*.trace.jsonl.gz")))
MAX_DELAY = 10

# Outcome of every fault trace under the default settings (healthy traces: no verdict).
EXPECTED = {
    "deepspeed-pp2dp2-slow2x1.3@30-r0": "missed",
    "deepspeed-pp2dp2-slow2x1.6@35-r0": "missed",
    "deepspeed-pp2dp2-slow2x2@25-r0": "within",
    "deepspeed-pp2dp2-slow2x3@40-r0": "within",
    "deepspeed-pp4-slow1x1.3@30-r0": "within",
    "deepspeed-pp4-slow1x1.6@35-r0": "late",
    "deepspeed-pp4-slow1x2@25-r0": "within",
    "deepspeed-pp4-slow1x3@40-r0": "within",
    "megatron-pp2dp2-slow2x1.3@30-r0": "missed",
    "megatron-pp2dp2-slow2x1.6@35-r0": "missed",
    "megatron-pp2dp2-slow2x2@25-r0": "within",
    "megatron-pp2dp2-slow2x3@40-r0": "within",
    "megatron-pp4-slow1x1.3@30-r0": "missed",
    "megatron-pp4-slow1x1.6@35-r0": "within",
    "megatron-pp4-slow1x2@25-r0": "within",
    "megatron-pp4-slow1x3@40-r0": "within",
    "moe-pp2dp2ep2-slow2x1.6@35-r0": "within",
    "moe-pp2dp2ep2-slow2x2@25-r0": "within",
    "moe-pp2dp2ep2-slow2x3@40-r0": "within",
}


def _name(path: str) -> str:
    return os.path.basename(path).split(".trace")[0]


def test_there_are_traces_of_both_engines_layouts_and_kinds():
    names = [_name(t) for t in TRACES]
    for engine in ("megatron", "deepspeed"):
        for layout in ("pp2dp2", "pp4"):
            mine = [n for n in names if n.startswith(f"{engine}-{layout}-")]
            assert any("healthy" in n for n in mine), (engine, layout, names)
            for factor in ("1.3", "1.6", "2", "3"):
                assert any(f"x{factor}@" in n for n in mine), (engine, layout, factor, names)


def test_moe_traces_carry_routed_counts_and_collective_time():
    moe = [t for t in TRACES if _name(t).startswith("moe-")]
    assert len(moe) == 6, [_name(t) for t in moe]
    for path in moe:
        rec = next(read_trace(path))
        assert rec.model.num_experts == 4
        assert rec.routed_tokens is not None and np.isfinite(rec.routed_tokens).all()
        assert rec.moe_comm_fwd_s is not None and rec.moe_comm_bwd_s is not None


def test_every_fault_trace_has_a_pinned_outcome():
    faulty = {_name(t) for t in TRACES if "healthy" not in _name(t)}
    assert faulty == set(EXPECTED), sorted(faulty ^ set(EXPECTED))


@pytest.mark.parametrize("path", TRACES, ids=[_name(t) for t in TRACES])
def test_live_trace_replay(path):
    records = list(read_trace(path))
    res = replay(records, ResiHPConfig(), "resihp")
    slow = [v for v in res.verdicts if v.kind == "fail_slow"]
    faults = {(f.rank, f.since) for r in records for f in r.faults if f.kind == "slow"}
    if not faults:
        assert slow == [], [v.describe() for v in slow]
        return
    (rank, since), = faults
    assert {v.rank for v in slow} <= {rank}, [v.describe() for v in slow]
    if not slow:
        outcome = "missed"
    else:
        assert slow[0].iteration >= since, slow[0].describe()
        outcome = "within" if slow[0].iteration <= since + MAX_DELAY else "late"
    assert outcome == EXPECTED[_name(path)], [v.describe() for v in slow]
    # A recovery is only ever reported after the fault ended (these faults last to the end).
    assert not [v for v in res.verdicts if v.kind == "recovered"], [v.describe() for v in res.verdicts]

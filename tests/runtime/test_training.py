"""Parity, resume and reshard on 4 CPU ranks against a single-rank reference (tier 3)."""
from __future__ import annotations

import json

import pytest

from megatron_ext.config.defaults import former_default_flags
from tests.conftest import run_python, run_torchrun

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("training")
    out = tmp / "curves.json"
    run_torchrun("tests/runtime/scenarios.py", str(out), str(tmp / "ckpt"))
    results = json.loads(out.read_text())
    single = tmp / "single.jsonl"
    # The scenarios' CURVE gives the former defaults (no dropout): so does the reference, first.
    run_python("pretrain_gpt.py", *former_default_flags(), "--train-iters", "10", "--eval-iters", "0",
               "--progress", "false",
               "--global-batch-size", "8", "--micro-batch-size", "2", "--lr-decay-style", "constant",
               "--lr", "2e-3", "--split", "949,50,1", "--metrics-file", str(single))
    results["single"] = [r["loss"] for r in map(json.loads, single.read_text().splitlines()) if r["kind"] == "train"]
    return results


def max_rel(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["tp2pp2", "pp2dp2", "pp2dp2_vpp2"])
def test_parallel_layouts_reproduce_single_rank_curve(curves, layout):
    assert len(curves["single"]) == 10
    assert curves["single"][-1] < curves["single"][0] - 0.3, "the reference run did not learn"
    assert max_rel(curves[layout], curves["single"]) < 1e-3


def test_resume_continues_exactly(curves):
    straight = curves["straight20"]
    resumed = curves["first10"] + curves["resumed10"]
    assert max_rel(resumed, straight) < 1e-6


@pytest.mark.parametrize("target", ["reshard_pp4", "reshard_pp2dp2"])
def test_reshard_on_load_goes_on(curves, target):
    # Saved under TP2xPP2 at iteration 10, resumed under another layout: the curve goes on as if
    # nothing had changed (up to reduction order).
    assert max_rel(curves[target], curves["straight20"][10:]) < 1e-3

"""ResiHP on the MoE model in the training loop (4 gloo ranks, PP2 x DP2 with EP2 in each stage, the
all-to-all dispatcher): an injected slow rank is named although its EP peer waits for it in every
MoE layer, and strongly imbalanced routing raises no false alarm. One launch runs both scenarios
(tests/resihp/live_scenarios_moe.py); the other checks replay its traces."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.detector import ResiHPDetector
from megatron_ext.resihp.trace import read_trace
from tests.conftest import run_torchrun
from tests.resihp.live_scenarios_moe import BASE, SCENARIOS, SKEW_FLIP

SLOW_RANK, SLOW_SINCE = 2, int(SCENARIOS["slow"]["inject_slow"][0].split(":")[1])
WARMUP = BASE["resihp_warmup"]
# (token, expert) pairs per micro-batch and stage of the EP group: top-k x layers per stage x the
# tokens of both its ranks' micro-batches.
GROUP_PAIRS = BASE["moe_router_topk"] * (BASE["num_layers"] // 2) * 2 * BASE["seq_length"]


def verdicts(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def scores(records, *, uniform: bool = False, with_waits: bool = False) -> dict[int, np.ndarray]:
    """Replay: iteration -> rank scores, optionally without the routed counts (uniform routing, as
    the detector assumed before) or with the collective time put back into the op durations (what
    the trace held before the probe)."""
    det = ResiHPDetector(ResiHPConfig(resihp_warmup=WARMUP))
    out = {}
    for rec in records:
        if uniform:
            rec = dataclasses.replace(rec, routed_tokens=None)
        if with_waits:
            rec = dataclasses.replace(rec, fwd_s=rec.fwd_s + rec.moe_comm_fwd_s, bwd_s=rec.bwd_s + rec.moe_comm_bwd_s)
        report = det.observe(rec)
        if report.calibrated:
            out[rec.iteration] = report.rank_scores
    return out


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    out = tmp_path_factory.mktemp("resihp_live_moe")
    run_torchrun("tests/resihp/live_scenarios_moe.py", str(out))
    return out


@pytest.mark.multirank
def test_slow_expert_rank_is_named_not_its_waiting_peer(live):
    found = [v for v in verdicts(live / "slow.verdicts.jsonl") if v["kind"] == "fail_slow"]
    assert found, "no fail-slow verdict"
    first = found[0]
    assert (first["rank"], first["stage"], first["detail"]["dp"]) == (SLOW_RANK, 1, 0)
    assert first["iteration"] >= SLOW_SINCE
    assert {v["rank"] for v in found} == {SLOW_RANK}, "a healthy rank was accused"


@pytest.mark.multirank
def test_peer_waits_in_the_all_to_alls_hid_the_slow_rank(live):
    # The same trace, scored with the time inside the dispatcher's collectives put back into the
    # ops (what the detector saw before): the EP peer's ops grow as much as the slow rank's and the
    # slow rank's score stays under the threshold; taken out, it is well above.
    records = list(read_trace(str(live / "slow.trace.jsonl")))
    assert all(r.moe_comm_fwd_s is not None and r.moe_comm_bwd_s is not None for r in records)
    after = lambda s: np.median([v[SLOW_RANK] for it, v in s.items() if it >= SLOW_SINCE + 2])  # noqa: E731
    threshold = ResiHPConfig().resihp_threshold
    assert after(scores(records, with_waits=True)) < threshold < after(scores(records))


@pytest.mark.multirank
def test_skewed_routing_raises_no_alarm(live):
    assert verdicts(live / "skewed.verdicts.jsonl") == []


@pytest.mark.multirank
def test_routed_counts_are_exact_and_on_the_ranks_the_router_chose(live):
    records = list(read_trace(str(live / "skewed.trace.jsonl")))
    assert len(records) == SCENARIOS["skewed"]["train_iters"]
    sent = {r: json.loads((live / f"skewed.routing.r{r}.json").read_text()) for r in range(4)}
    for rec in records:
        routed = rec.routed_tokens[:, 0]                                     # (world, micro-batches)
        # Dropless: the EP group's ranks computed every pair its tokens were routed to.
        assert (routed[0] + routed[1] == GROUP_PAIRS).all() and (routed[2] + routed[3] == GROUP_PAIRS).all()
        # Experts 0-1 live on EP rank 0 (ranks 0 and 2): what its experts computed is what the
        # routers of its group sent there.
        it = str(rec.iteration)
        assert routed[0].sum() == sent[0][it][0] + sent[1][it][0]
        assert routed[2].sum() == sent[2][it][0] + sent[3][it][0]
        # Strongly imbalanced: the favoured EP rank of each stage gets (nearly) every pair.
        heavy = [0, 2] if rec.iteration < SKEW_FLIP else [1, 3]
        assert routed[heavy].sum() >= 0.9 * routed.sum(), (rec.iteration, routed)


@pytest.mark.multirank
def test_routed_counts_carry_the_imbalance_uniform_routing_misreads(live):
    # The same healthy trace scored as if routing were uniform: the ranks doing the expert work
    # look slow. With the counts they do not.
    records = list(read_trace(str(live / "skewed.trace.jsonl")))
    with_counts, uniform = scores(records), scores(records, uniform=True)

    def heavy_median(s):  # the ranks doing the expert work, mean of the two per iteration
        return np.median([v[[0, 2] if it < SKEW_FLIP else [1, 3]].mean() for it, v in s.items()])

    assert heavy_median(with_counts) < heavy_median(uniform)
    assert heavy_median(with_counts) < ResiHPConfig().resihp_threshold

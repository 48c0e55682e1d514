"""``--engine deepspeed`` on 4 gloo ranks: schedule order, p2p pairing, bubbles, parity, resume, and
checkpoints moving between engines (one torchrun launch, see ds_scenarios.py)."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from megatron_ext.config.defaults import former_default_flags
from megatron_ext.pipeline.events import COMPUTE, Phase, assign_p2p_microbatches
from megatron_ext.pipeline.schedule_orders import deepspeed_train
from tests.conftest import run_python, run_torchrun

pytestmark = pytest.mark.multirank

TIMELINES = {"pp2dp2_m4": (2, 4, 2), "pp4_m4": (4, 4, 1), "pp4_m8": (4, 8, 1)}  # (stages, micro-batches, dp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    run_torchrun("tests/deepspeed_patches/ds_scenarios.py", str(out))
    results = json.loads((out / "results.json").read_text())
    single = out / "single.jsonl"
    # The megatron engine on one rank: the reference curve of tests/runtime.
    run_python("pretrain_gpt.py", *former_default_flags(), "--train-iters", "10", "--eval-iters", "0",
               "--progress", "false",
               "--global-batch-size", "8", "--micro-batch-size", "2", "--lr-decay-style", "constant",
               "--lr", "2e-3", "--split", "949,50,1", "--metrics-file", str(single))
    results["single"] = [r["loss"] for r in map(json.loads, single.read_text().splitlines()) if r["kind"] == "train"]
    records = {}
    for name in [*TIMELINES, "ds_tp2pp2"]:
        with open(out / f"{name}.pkl", "rb") as fh:
            records[name] = pickle.load(fh)
    return {"results": results, "records": records, "dir": out}


def max_rel(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# --- timelines -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TIMELINES))
def test_compute_order_is_deepspeed_train_schedule(runs, name):
    rec = runs["records"][name]
    p, m, dp = TIMELINES[name]
    assert (rec.schedule, rec.num_stages, rec.num_microbatches, rec.num_chunks) == ("deepspeed", p, m, 1)
    assert len(rec.ranks) == 4 and {r.dp for r in rec.ranks.values()} == set(range(dp))
    order = deepspeed_train(p, m)
    for rank, r in rec.ranks.items():
        # keys: the recorded op carries no deferred-send flag (that is the schedule's timing annotation)
        assert [op.key for op in rec.compute_order(rank)] == [op.key for op in order.stages[r.stage]], \
            f"rank {rank} stage {r.stage}"


@pytest.mark.parametrize("name", list(TIMELINES))
def test_every_recv_pairs_with_a_send(runs, name):
    rec = runs["records"][name]
    p, m, dp = TIMELINES[name]
    sends, recvs = rec.p2p_messages()
    key = lambda msg: msg[:4]  # noqa: E731  (direction, from stage, to stage, micro-batch)
    for dp_rank in range(dp):
        ranks = {r.rank for r in rec.ranks.values() if r.dp == dp_rank}
        s = sorted(key(x) for x in sends if x[4] in ranks)
        r = sorted(key(x) for x in recvs if x[4] in ranks)
        assert s == r
        assert len(s) == 2 * m * (p - 1)  # one activation and one gradient per boundary and micro-batch


@pytest.mark.parametrize("name", list(TIMELINES))
def test_p2p_events_carry_the_step_microbatch(runs, name):
    # The engine labels a Send/Recv with the micro-batch of DeepSpeed's step (previous step for
    # sends); the framework-neutral rule (a send carries the previous compute op's output, a recv
    # feeds the next one) must agree with it on every event.
    rec = runs["records"][name]
    for r in rec.ranks.values():
        p2p = 0
        for e, info in zip(r.events, assign_p2p_microbatches(r.events)):
            if e["phase"] in (Phase.SEND, Phase.RECV):
                p2p += 1
                assert [v for k, v in info.items() if not k.endswith("_chunk")] == [int(e["microbatch"])]
        assert p2p > 0


@pytest.mark.parametrize("name", list(TIMELINES))
def test_every_op_starts_after_its_producer(runs, name):
    # Causality across ranks on one clock: an op's input exists only once its producer finished.
    rec = runs["records"][name]
    order = rec.order
    for dp_rank in range(TIMELINES[name][2]):
        times = {}
        for r in rec.ranks.values():
            if r.dp == dp_rank:
                for e in r.compute():
                    op = ("F" if e["phase"] == Phase.FORWARD else "B", int(e["microbatch"]), 0)
                    times[(r.stage, op)] = (float(e["t0"]), float(e["t1"]))
        for s, _, op in order.ops():
            prod = order.producer(s, op)
            if prod is not None and prod[0] != s:
                assert times[(s, op.key)][0] >= times[(prod[0], prod[1].key)][1], (s, op, prod)


@pytest.mark.parametrize("name", list(TIMELINES))
def test_bubbles_where_the_schedule_puts_them(runs, name):
    rec = runs["records"][name]
    p = rec.num_stages
    windows = rec.bubble_windows()
    expected = rec.expected_bubbles()
    assert "F0" not in expected[0]  # the first stage starts at once
    # warm-up: stage s waits for micro-batch 0 through s upstream stages, longer the deeper it is
    warmup = [expected[s]["F0"] for s in range(1, p)]
    assert all(w > 0 for w in warmup) and warmup == sorted(warmup)
    for r in rec.ranks.values():
        mine = {w.ended_by: w for w in windows if w.rank == r.rank}
        if r.stage > 0:
            assert "F0" in mine and mine["F0"].duration_s > 0 and mine["F0"].expected_s > 0
        if r.stage == p - 1:
            # cool-down: the last stage is done while earlier stages still run backwards
            assert "end" in mine and mine["end"].expected_s > 0
        # every idle window the schedule predicts is observed on every replica
        for op_name in expected[r.stage]:
            assert op_name in mine and mine[op_name].duration_s > 0, (r.rank, op_name)
    fractions = rec.stage_bubble_fractions()
    assert len(fractions) == p and all(0 < f < 1 for f in fractions)


def test_bubble_fraction_reaches_the_log_line(runs):
    for name, (p, _, _) in TIMELINES.items():
        logged = json.loads((runs["dir"] / f"{name}_logged.json").read_text())
        assert logged == [f"bubble_s{s}" for s in range(p)]


def test_chrome_trace_written_and_loadable(runs):
    path = runs["dir"] / "pp4_m4" / "timeline_iter0000003.json"
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert {e["pid"] for e in events if e.get("name") == "process_name"} == {0, 1, 2, 3}
    assert trace["metadata"]["megatron_ext"]["schedule"] == "deepspeed"
    assert any(e.get("cat") == "bubble" for e in events)
    fwd = [e for e in events if e.get("cat") == "forward"]
    assert len(fwd) == 4 * 4 and all(sum(e["args"]["doc_lengths"][0]) == 64 for e in fwd)
    cats = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert {"forward", "backward", "send", "recv", "grad-reduce", "optimizer", "other"} <= cats


def test_no_event_left_open(runs):
    for rec in runs["records"].values():
        for r in rec.ranks.values():
            ev = r.events
            assert np.all(np.isfinite(ev["t1"])) and np.all(ev["t1"] >= ev["t0"])
            # one event per instruction: each stage runs 2 m compute ops per iteration
            assert int(np.isin(ev["phase"], [int(ph) for ph in COMPUTE]).sum()) == 2 * rec.num_microbatches


# --- training ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["pp2dp2", "pp4"])
def test_loss_matches_megatron_single_rank(runs, layout):
    res = runs["results"]
    assert len(res["single"]) == 10
    assert res["single"][-1] < res["single"][0] - 0.3, "the reference run did not learn"
    assert max_rel(res[layout], res["single"]) < 1e-3


def test_same_seed_same_weights_as_megatron(runs):
    compared, differ = runs["results"]["init"]
    # PP2 x DP2 with 4 layers: stage 0 has both embeddings + 2 layers x 12, stage 1 2 layers x 12 +
    # final norm (2) + the tied head; every rank compares its whole stage
    assert compared == 2 * (2 + 24) + 2 * (24 + 2 + 1)
    assert differ == 0


def test_resume_continues_exactly(runs):
    res = runs["results"]
    assert max_rel(res["first10"] + res["resumed10"], res["straight20"]) < 1e-6


def test_live_relayout_repartitions_the_pipeline(runs):
    # PipelineModule rebuilt with 3 + 1 layers, then 4 stages with the ranks in reverse order (a new
    # default group, the processes renumbered), then TP2 x PP2 (tensor-parallel layers built, every
    # weight and optimizer state cut to its TP shard), state moved rank to rank: the curve is the
    # straight run's.
    res = runs["results"]
    live = res["relayout"]
    assert live["layouts"] == ["deepspeed pp2dp2", "deepspeed pp2dp2", "deepspeed pp4dp1", "deepspeed tp2pp2dp1"]
    assert live["members"] == [3, 2, 1, 0] and live["generation"] == 1
    assert max_rel(live["losses"], res["straight20"]) < 1e-5
    assert live["refusals"] == [
        "--engine deepspeed runs one stage per rank: use --engine megatron for a target with virtual (interleaved) "
        "stages",
        "--engine deepspeed cannot move micro-batches between replicas (its engine scales every replica's loss "
        "by one accumulation count): use --engine megatron for DP work migration"]


def test_checkpoint_moves_between_engines(runs):
    res = runs["results"]
    # saved by DeepSpeed at 10, continued by megatron; saved by megatron at 10, continued by DeepSpeed
    assert max_rel(res["megatron_from_ds10"], res["straight20"][10:]) < 1e-3
    assert max_rel(res["megatron_first10"], res["first10"]) < 1e-3
    assert max_rel(res["ds_from_megatron10"], res["straight20"][10:]) < 1e-3


def test_plot_timeline_renders_a_gantt_png(runs, tmp_path):
    from tools import plot_timeline as tool

    out = tmp_path / "gantt.png"
    assert tool.main([str(runs["dir"] / "pp4_m8" / "timeline_iter0000003.json"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Several iterations: one panel each, on one time scale; titles one per trace.
    two = [str(runs["dir"] / name / "timeline_iter0000003.json") for name in ("pp4_m8", "pp2dp2_m4")]
    assert tool.main(two + ["-o", str(tmp_path / "two.png"), "--title", "a", "--title", "b"]) == 0
    assert (tmp_path / "two.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tool.main(two + ["-o", str(out), "--title", "a"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert tool.main([str(bad), "-o", str(out)]) == 2


@pytest.mark.multirank
def test_resihp_names_the_slow_rank_on_this_engine(runs):
    found = [v for v in runs["results"]["resihp_verdicts"] if v["kind"] == "fail_slow"]
    assert found, ("ResiHP issued no fail-slow verdict on the DeepSpeed engine; trace: "
                   f"{runs['dir'] / 'resihp.trace.jsonl'}")
    assert {v["rank"] for v in found} == {2} and found[0]["stage"] == 1
    assert found[0]["iteration"] >= 20


# --- TP x PP x DP --------------------------------------------------------------------------------

def test_tp2pp2_reproduces_the_megatron_engine(runs):
    # The LLaMA-style family (GQA, SwiGLU, rotary, RMSNorm, untied head) in TP2 x PP2, fp32: DeepSpeed's
    # PipelineModule with megatron's tensor-parallel layers (and sequence parallelism) against megatron's
    # GPTModel, same seed and data, 10 iterations.
    res = runs["results"]["three_d"]
    megatron = res["megatron_tp2pp2"]
    assert res["layout"] == "deepspeed tp2pp2dp1"
    assert len(megatron) == 10 and megatron[-1] < megatron[0] - 0.3, "the reference run did not learn"
    assert max_rel(res["deepspeed_tp2pp2_sp"], megatron) < 1e-5


def test_checkpoints_reshard_between_engines_and_tp_layouts(runs):
    # Iteration 5 of each engine's TP2 x PP2 run, continued by the other engine in another layout
    # (megatron TP1 x PP2 x DP2 from DeepSpeed's; DeepSpeed TP2 x DP2 from megatron's), weights and
    # optimizer state: the continuation is the straight run's.
    res = runs["results"]["three_d"]
    straight = res["megatron_tp2pp2"][5:]
    assert max_rel(res["megatron_tp1pp2dp2_from_ds5"], straight) < 1e-5
    assert max_rel(res["deepspeed_tp2dp2_from_megatron5"], straight) < 1e-5


def test_timeline_of_tp2pp2_has_every_rank_in_deepspeeds_schedule(runs):
    rec = runs["records"]["ds_tp2pp2"]
    assert (rec.schedule, rec.num_stages, rec.num_microbatches) == ("deepspeed", 2, 4)
    assert len(rec.ranks) == 4 and sorted(r.stage for r in rec.ranks.values()) == [0, 0, 1, 1]
    order = deepspeed_train(2, 4)
    for rank, r in rec.ranks.items():   # both TP ranks of a stage run the stage's order
        assert [op.key for op in rec.compute_order(rank)] == [op.key for op in order.stages[r.stage]], rank
    windows = rec.bubble_windows()
    expected = rec.expected_bubbles()
    for r in rec.ranks.values():   # every idle window the schedule predicts, on both TP ranks
        mine = {w.ended_by: w for w in windows if w.rank == r.rank}
        assert expected[r.stage] and all(op in mine and mine[op].duration_s > 0 for op in expected[r.stage]), r.rank

"""The whole-simulator validation's pieces: a trace's model, layout and documents as the simulator's
shape, job and data; the device figures measured once; the refusals."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from megatron_ext.resilience import validate
from megatron_ext.resilience.shapes import BWD_ATTENTION, BWD_LINEAR

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 4096, "ffn_hidden_size": 768,
         "num_query_groups": None, "gated_linear_unit": True, "num_experts": None}


def _record(it: int, tp: int, pp: int, dp: int, *, fwd: float = 0.1, bwd: float = 0.2, iteration_s: float = 1.0):
    world, m = tp * pp * dp, 2
    ranks = [[r // (tp * dp), (r // tp) % dp, r % tp] for r in range(world)]
    return {"format": "resihp-trace", "version": 1, "iteration": it, "iteration_s": iteration_s,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "vp": 1, "schedule": "1f1b", "num_microbatches": m,
                       "ranks": ranks},
            "model": MODEL, "documents": [[[256, 256], [512]] for _ in range(dp)],
            "fwd_s": [[[fwd] * m] for _ in range(world)], "bwd_s": [[[bwd] * m] for _ in range(world)]}


def _write(path, recs):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_a_recorded_layout_becomes_the_simulators_job_in_megatrons_rank_order():
    job = validate.job_of(_record(1, 2, 2, 1))
    assert [p.stages for p in job.pipelines] == [((0, 1), (2, 3))]
    job = validate.job_of(_record(1, 1, 2, 2))
    # TP fastest, then DP, stage slowest: stage 0 holds ranks 0 (dp 0) and 1 (dp 1)
    assert [p.stages for p in job.pipelines] == [((0,), (2,)), ((1,), (3,))]
    assert all(p.layers == (2, 2) and p.microbatches == 2 for p in job.pipelines)
    data = validate.data_of(_record(1, 1, 2, 2))
    assert data.tokens == 512 and data.sum_sq.tolist() == [2 * 256 ** 2, 512 ** 2] * 2


def test_only_a_dense_swiglu_model_is_priced():
    assert validate.shape_of(MODEL).layer_linear_flops() == 2.0 * (4 * 256 * 256 + 3 * 256 * 768)
    for bad in ({"gated_linear_unit": False}, {"num_experts": 4}):
        with pytest.raises(ValueError, match="dense SwiGLU model"):
            validate.shape_of({**MODEL, **bad})


def test_the_device_rate_is_the_simulators_flops_over_the_recorded_op_seconds(tmp_path):
    recs = [_record(it, 1, 1, 1, fwd=0.5, bwd=1.0) for it in range(1, 9)]
    path = _write(tmp_path / "single.trace.jsonl.gz", recs)
    shape = validate.shape_of(MODEL)
    lin = 4 * shape.layer_linear_flops() * 512 + shape.head_flops() * 512
    att = [4 * shape.layer_attention_flops_per_sq() * q for q in (2 * 256 ** 2, 512 ** 2)]
    flops = sum((1 + BWD_LINEAR) * lin + (1 + BWD_ATTENTION) * a for a in att)
    got = validate.device_flops([path])
    assert got["flops"] == pytest.approx(flops / (2 * 1.5))
    with pytest.raises(ValueError, match="single-rank run"):
        validate.device_flops([_write(tmp_path / "tp2.trace.jsonl.gz", [_record(5, 2, 1, 1)])])


def test_a_wide_case_is_predicted_from_the_device_alone_and_a_slow_device_slows_its_tp_group(tmp_path):
    device = {"flops": 40e9, "link_bytes_per_s": 0.5e9, "link_latency_s": 1e-3, "optimizer_bytes_per_s": 10e9}
    healthy = _write(tmp_path / "megatron-w256-tp2pp2-healthy-r0.trace.jsonl.gz",
                     [_record(it, 2, 2, 1) for it in range(1, 12)])
    slow = _write(tmp_path / "megatron-w256-tp2pp2-slow1x2@4-r0.trace.jsonl.gz",
                  [_record(it, 2, 2, 1) for it in range(1, 12)])
    h, s = validate.whole_case(healthy, device), validate.whole_case(slow, device)
    assert h["iterations"] == 7 and s["iterations"] == 6  # from the warm-up's end / two after the onset
    assert h["grad_sync_s"] == 0.0 and h["optimizer_s"] > 0  # one replica: no DP reduce
    # The recorded times are compared with, never read: the prediction is the same for any.
    other = _write(tmp_path / "megatron-w256-tp2pp2-healthy-r1.trace.jsonl.gz",
                   [_record(it, 2, 2, 1, fwd=9.0, bwd=9.0, iteration_s=7.0) for it in range(1, 12)])
    assert validate.whole_case(other, device)["predicted_s"] == h["predicted_s"]
    # Rank 1 at half speed: stage 0's TP group computes at its pace, its collectives do not slow.
    assert h["compute_s"] < s["compute_s"] < 2 * h["compute_s"]
    dp = _write(tmp_path / "megatron-w256-pp2dp2-healthy-r0.trace.jsonl.gz",
                [_record(it, 1, 2, 2) for it in range(1, 12)])
    assert validate.whole_case(dp, device)["grad_sync_s"] > 0
    assert validate.whole_case(str(tmp_path / "megatron-pp2-healthy-r0.trace.jsonl.gz"), device) is None
    err = validate.whole_error([healthy, slow, dp], device)
    assert err["cases"] == 3 and err["median"] == pytest.approx(float(np.median(
        [abs(c["rel_error"]) for c in err["detail"]])), abs=1e-4)


def test_the_device_file_names_what_it_lacks(tmp_path):
    path = tmp_path / "cpu-device.json"
    path.write_text(json.dumps({"flops": 1e9}))
    with pytest.raises(ValueError, match=r"missing link_bytes_per_s, link_latency_s, optimizer_bytes_per_s"):
        validate.load_device(str(path))

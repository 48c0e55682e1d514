"""Trace format v1: round trip, and errors that name the file, line and key."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from megatron_ext.models.flops import ModelSpec
from megatron_ext.resihp.trace import (
    FaultLabel, TraceRecord, TraceLayout, TraceError, TraceWriter, read_trace, write_trace)


def record(iteration=1, **kw):
    lay = TraceLayout(tp=2, pp=2, dp=1, num_microbatches=3)
    fwd = np.arange(12, dtype=float).reshape(4, 1, 3) / 100
    base = dict(iteration=iteration, iteration_s=0.5, layout=lay,
                model=ModelSpec(num_layers=4, hidden_size=16, num_attention_heads=2, vocab_size=64),
                documents=[[[3, 5], [8], [1, 1, 6]]], fwd_s=fwd, bwd_s=2 * fwd, time_s=10.0,
                faults=(FaultLabel(kind="slow", rank=3, since=1, factor=1.5),))
    base.update(kw)
    return TraceRecord(**base)


def test_round_trip(tmp_path):
    recs = [record(1), record(2)]
    recs[1].fwd_s[2] = np.nan
    recs[1].bwd_s[2] = np.nan
    path = tmp_path / "t.jsonl"
    write_trace(path, recs)
    back = list(read_trace(path))
    assert [r.to_dict() for r in back] == [r.to_dict() for r in recs]
    assert back[1].present.tolist() == [True, True, False, True]
    assert json.loads(path.read_text().splitlines()[1])["fwd_s"][2] is None
    tokens, sq = back[0].doc_stats
    assert tokens.tolist() == [[8, 8, 8]] and sq.tolist() == [[34, 64, 38]]
    assert back[0].layout.coords(3) == (1, 0, 1)  # tp fastest, then dp, then stage


def write_lines(tmp_path, *objs):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
    return path


def good():
    return record().to_dict()


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(version=2), "trace format version 2 is newer than this reader (version 1); update megatron-ext"),
    (lambda d: d.update(format="other"), "key 'format' must be 'resihp-trace', got 'other'"),
    (lambda d: d.pop("iteration_s"), "missing key 'iteration_s'"),
    (lambda d: d.pop("fwd_s"), "missing key 'fwd_s'"),
    (lambda d: d.pop("bwd_s"), "missing key 'bwd_s'"),
    (lambda d: d.update(iteration="7"), "key 'iteration' expects int, got '7'"),
    (lambda d: d.update(colour=1), "unknown key 'colour' (extensions must start with 'x_')"),
    (lambda d: d["fwd_s"].pop(), "key 'fwd_s' must list 4 ranks (tp*pp*dp), got 3"),
    (lambda d: d["bwd_s"][1][0].append(1.0), "key 'bwd_s' rank 1: expected shape [vp=1][microbatches=3], got [1, 4]"),
    (lambda d: d["fwd_s"][0][0].__setitem__(0, -1), "key 'fwd_s' rank 0: durations must be finite and >= 0"),
    (lambda d: d["documents"][0].pop(), "key 'documents' must be a [dp=1][microbatches=3] table"),
    (lambda d: d["documents"][0][1].append(2.5), "key 'documents' [0][1]: expected a list of non-negative integer lengths"),
    (lambda d: d["layout"].update(schedule="gpipe"), "key 'layout': layout.schedule must be one of 1f1b, interleaved, deepspeed, got 'gpipe'"),
    (lambda d: d["layout"].update(ranks=[[0, 0, 0]] * 4), "key 'layout': layout.ranks must list each (stage, dp, tp)"),
    (lambda d: d["model"].update(heads=2), "key 'model': unknown key heads"),
    (lambda d: d["faults"][0].update(rank=9), "key 'faults' [0]: rank 9 outside 0..3"),
    (lambda d: d["faults"][0].update(kind="slo"), "key 'faults' [0]: kind must be one of slow, stop, got 'slo'"),
])
def test_errors_name_file_line_and_key(tmp_path, mutate, message):
    bad = good()
    mutate(bad)
    path = write_lines(tmp_path, good(), "", bad)
    with pytest.raises(TraceError, match="^" + re.escape(f"{path}:3: {message}")):
        list(read_trace(path))


def test_not_json_and_missing_file(tmp_path):
    path = write_lines(tmp_path, good(), "{not json")
    with pytest.raises(TraceError, match="^" + re.escape(f"{path}:2: not valid JSON (Expecting property name "
                                                          "enclosed in double quotes, column 2)") + "$"):
        list(read_trace(path))
    path = write_lines(tmp_path, '{"format": "resihp-trace", "text": "abc', good())
    with pytest.raises(TraceError, match="^" + re.escape(f"{path}:1: not valid JSON (Invalid control "
                                                          "character, column 40)") + "$"):
        list(read_trace(path))
    with pytest.raises(TraceError, match="trace file .*nope.jsonl does not exist"):
        list(read_trace(tmp_path / "nope.jsonl"))


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "crashed.jsonl"
    whole = json.dumps(good())
    path.write_text(whole + "\n" + whole + "\n" + whole[: len(whole) // 2])  # the writer died mid-record
    with caplog.at_level("WARNING"):
        records = list(read_trace(path))
    assert len(records) == 2
    assert f"{path}:3: last line is cut short (the writer stopped mid-record); skipped" in caplog.text
    path.write_text(whole[: len(whole) // 2] + "\n" + whole + "\n")  # a bad line in the middle is an error
    with pytest.raises(TraceError, match=re.escape(f"{path}:1: not valid JSON")):
        list(read_trace(path))


def test_extension_keys_and_explicit_rank_order(tmp_path):
    d = good()
    d["x_host"] = "node7"
    d["layout"]["ranks"] = [[1, 0, 0], [1, 0, 1], [0, 0, 0], [0, 0, 1]]
    (rec,) = read_trace(write_lines(tmp_path, d))
    assert rec.layout.coords(0) == (1, 0, 0)
    with TraceWriter(tmp_path / "sub" / "o.jsonl") as w:
        w.write(rec)
    assert (tmp_path / "sub" / "o.jsonl").exists()


def test_documented_example_parses(tmp_path):
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "resihp_trace_format.md").read_text()
    block = doc.split("## Example")[1].split("```json")[1].split("```")[0]
    line = "".join(part.strip() for part in block.strip().splitlines())
    (rec,) = read_trace(write_lines(tmp_path, line))
    assert rec.iteration == 57 and rec.layout.world_size == 2 and rec.faults[0].factor == 2.0
    assert rec.doc_stats[1].tolist() == [[40 ** 2 + 17 ** 2 + 7 ** 2, 64 ** 2]]


MOE = ModelSpec(num_layers=4, hidden_size=16, num_attention_heads=2, vocab_size=64, num_experts=4, moe_router_topk=2)


def moe_record(**kw):
    routed = np.array([[[12, 20, 16]], [[20, 12, 16]], [[30, 2, 0]], [[2, 30, 32]]], dtype=float)
    comm = np.full((4, 1, 3), 0.002)
    return record(model=MOE, routed_tokens=routed, moe_comm_fwd_s=comm, moe_comm_bwd_s=2 * comm, **kw)


def test_moe_keys_round_trip_and_stay_optional(tmp_path):
    rec = moe_record()
    rec.routed_tokens[1, 0, 2] = np.nan  # a count the probe could not take
    path = tmp_path / "moe.jsonl"
    write_trace(path, [rec, record(2)])
    back, old = read_trace(path)
    assert back.to_dict() == rec.to_dict()
    line = json.loads(path.read_text().splitlines()[0])
    assert line["routed_tokens"][0] == [[12, 20, 16]] and line["routed_tokens"][1] == [[20, 12, None]]
    assert np.allclose(back.moe_comm_bwd_s, 0.004)
    # A record without them (every trace before them) reads as before: no counts, no comm tables.
    assert (old.routed_tokens, old.moe_comm_fwd_s, old.moe_comm_bwd_s) == (None, None, None)
    assert "routed_tokens" not in json.loads(path.read_text().splitlines()[1])


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["routed_tokens"][2][0].__setitem__(1, -3), "key 'routed_tokens' rank 2: counts must be finite and >= 0"),
    (lambda d: d["routed_tokens"][2][0].__setitem__(1, 2.5), "key 'routed_tokens' rank 2: counts must be integers"),
    (lambda d: d["routed_tokens"].pop(), "key 'routed_tokens' must list 4 ranks (tp*pp*dp), got 3"),
    (lambda d: d["moe_comm_fwd_s"][0][0].append(0.1),
     "key 'moe_comm_fwd_s' rank 0: expected shape [vp=1][microbatches=3], got [1, 4]"),
    (lambda d: d["model"].pop("num_experts"), "key 'routed_tokens' needs a model with experts ('model' has no num_experts)"),
])
def test_moe_key_errors_name_file_line_and_key(tmp_path, mutate, message):
    bad = moe_record().to_dict()
    mutate(bad)
    path = write_lines(tmp_path, bad)
    with pytest.raises(TraceError, match="^" + re.escape(f"{path}:1: {message}")):
        list(read_trace(path))


def test_devices_round_trip_and_label_launch_ranks(tmp_path):
    # After a permutation rank r is launch rank devices[r]; a fault label names the device, also
    # one that has left the world (stopped), so it may exceed the world's ranks.
    rec = record(devices=(2, 0, 1, 5), faults=(FaultLabel(kind="stop", rank=3, since=1),))
    path = tmp_path / "perm.jsonl"
    write_trace(path, [rec, record(2)])
    back, plain = read_trace(path)
    assert back.devices == (2, 0, 1, 5) and back.device_of(3) == 5 and back.faults[0].rank == 3
    assert plain.devices is None and plain.device_of(3) == 3
    assert "devices" not in json.loads(path.read_text().splitlines()[1])
    with pytest.raises(ValueError, match=re.escape("devices must name 4 distinct launch ranks >= 0, one per rank; "
                                                   "got [0, 0, 1, 2]")):
        record(devices=(0, 0, 1, 2))


@pytest.mark.parametrize("devices,message", [
    ([0, 1, 2], "key 'devices' must list 4 distinct launch ranks (ints >= 0), one per rank, got [0, 1, 2]"),
    ([0, 1, 1, 3], "key 'devices' must list 4 distinct launch ranks (ints >= 0), one per rank, got [0, 1, 1, 3]"),
    ([0, 1, 2, -1], "key 'devices' must list 4 distinct launch ranks (ints >= 0), one per rank, got [0, 1, 2, -1]"),
    ([0, 1, 2, True], "key 'devices' must list 4 distinct launch ranks (ints >= 0), one per rank, got [0, 1, 2, True]"),
])
def test_devices_errors_name_file_line_and_key(tmp_path, devices, message):
    bad = good()
    bad["devices"] = devices
    path = write_lines(tmp_path, bad)
    with pytest.raises(TraceError, match="^" + re.escape(f"{path}:1: {message}")):
        list(read_trace(path))
    bad = good()
    bad.update(devices=[3, 2, 1, 0])
    bad["faults"][0].update(rank=-1)
    with pytest.raises(TraceError, match=re.escape("key 'faults' [0]: rank -1 is not a launch rank (>= 0)")):
        list(read_trace(write_lines(tmp_path, bad)))

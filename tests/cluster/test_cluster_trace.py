"""Trace and VC-file parsing: order, VC filtering, load scaling, and located errors for bad input."""
from __future__ import annotations

import calendar
import csv

import pytest

from tests.cluster.cluster_helpers import data
from megatron_ext.cluster.trace import TraceError, read_trace, read_vc_config


@pytest.fixture(scope="module")
def vcs():
    return read_vc_config(data("philly_vc.csv"))


def _raw_rows():
    with open(data("philly_small.csv")) as fh:
        return list(csv.DictReader(fh))


def test_vc_config_helios_layout(vcs):
    assert len(vcs) == 11
    assert vcs["6214e9"].nodes == 64 and vcs["6214e9"].gpus == 512 and vcs["ed69ec"].gpus == 64


def test_unsorted_file_is_sorted_and_absent_vcs_are_dropped_and_counted(vcs):
    rows = _raw_rows()
    stamps = [r["timestamp"] for r in rows]
    assert stamps != sorted(stamps), "the fixture must exercise an unsorted file"
    trace = read_trace(data("philly_small.csv"), vcs)
    absent = {}
    for r in rows:
        if r["cluster"] not in vcs:
            absent[r["cluster"]] = absent.get(r["cluster"], 0) + 1
    assert trace.dropped == absent == {"23dbec": 8, "51b7ef": 4, "925e2b": 3, "795a4c": 3}
    assert len(trace.jobs) == len(rows) - 18
    submits = [j.submit for j in trace.jobs]
    assert submits == sorted(submits) and submits[0] == 0.0
    # offsets are exact: seconds since the earliest kept submit
    kept = [r for r in rows if r["cluster"] in vcs]
    epoch = [calendar.timegm(tuple(int(x) for x in r["timestamp"].replace("-", " ").replace(":", " ").split())
                             + (0, 0, 0)) for r in kept]
    assert sorted(j.submit for j in trace.jobs) == sorted(e - min(epoch) for e in epoch)
    by_line = {j.line: j for j in trace.jobs}
    first = kept[0]
    j = by_line[2]  # line 2 is the first data row
    assert (j.vc, j.duration, j.gpus) == (first["cluster"], float(first["duration"]), int(first["num_gpus"]))


def test_equal_submit_times_keep_file_order(tmp_path, vcs):
    path = tmp_path / "t.csv"
    path.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                    "2017-10-01 00:00:05,1,1,1,6214e9\n"
                    "2017-10-01 00:00:01,2,1,2,6214e9\n"
                    "2017-10-01 00:00:05,3,1,3,6214e9\n")
    trace = read_trace(path, vcs)
    assert [j.line for j in trace.jobs] == [3, 2, 4]


def test_load_scale_divides_offsets_from_first_submit(vcs):
    base = read_trace(data("philly_small.csv"), vcs)
    fast = read_trace(data("philly_small.csv"), vcs, load_scale=4.0)
    assert [j.line for j in fast.jobs] == [j.line for j in base.jobs]
    assert [j.submit for j in fast.jobs] == [j.submit / 4.0 for j in base.jobs]
    assert [j.duration for j in fast.jobs] == [j.duration for j in base.jobs]


EXPECTED_BAD = [
    (3, "timestamp '2017-10-9 07:01:55' is not YYYY-MM-DD HH:MM:SS"),
    (4, "duration -5 must be > 0"),
    (5, "num_gpus 0 must be >= 1"),
    (6, "num_gpus '1.5' is not an integer"),
    (7, "expected 5 fields (timestamp,duration,num_gpus,gpu_time,cluster), got 4"),
    (8, "cluster (VC id) is empty"),
    (9, "timestamp '2017-02-30 07:01:55' has no valid date"),
    (10, "timestamp '2017-10-09 25:01:55' has no valid time of day"),
    (11, "duration 'abc' is not a number"),
    (12, "num_gpus 256 exceeds the 128 GPUs of VC '11cb48'"),
    (13, "duration 'nan' is not a finite number"),
]


def test_bad_rows_fail_with_line_and_reason(vcs):
    with pytest.raises(TraceError) as err:
        read_trace(data("philly_bad_rows.csv"), vcs)
    msg = str(err.value)
    shown = "; ".join(f"line {ln}: {why}" for ln, why in EXPECTED_BAD[:5])
    assert msg == (f"{data('philly_bad_rows.csv')}: 11 bad row(s): {shown} (and 6 more). "
                   "Fix them, or pass --skip-bad-rows to drop them")


def test_skip_bad_rows_rejects_each_with_line_and_reason(vcs, caplog):
    trace = read_trace(data("philly_bad_rows.csv"), vcs, skip_bad_rows=True)
    assert trace.rejected == EXPECTED_BAD
    assert [(j.line, j.gpus, j.duration) for j in trace.jobs] == [(2, 1, 66.0), (14, 2, 10.0)]
    assert "philly_bad_rows.csv:4: rejected: duration -5 must be > 0" in caplog.text


@pytest.mark.parametrize("header, message", [
    ("timestamp,duration,num_gpus,cluster", "cannot tell the trace format from header"),
    ("", "empty trace file"),
])
def test_bad_headers(tmp_path, vcs, header, message):
    path = tmp_path / "t.csv"
    path.write_text(header + ("\n" if header else ""))
    with pytest.raises(TraceError, match=message):
        read_trace(path, vcs)


def test_missing_file(vcs):
    with pytest.raises(TraceError, match="nope.csv: file does not exist"):
        read_trace("nope.csv", vcs)


def test_all_jobs_dropped_is_an_error(tmp_path):
    path = tmp_path / "vc.csv"
    path.write_text("vc,node num\nother,1\n")
    with pytest.raises(TraceError, match=r"no jobs left after dropping VCs absent from the VC file \(trace VCs: "):
        read_trace(data("philly_small.csv"), read_vc_config(path))


@pytest.mark.parametrize("text, message", [
    ("vc,nodes\na,x\n", "vc.csv:2: nodes 'x' is not an integer"),
    ("vc,node num\na,0\n", "vc.csv:2: node num 0 must be >= 1"),
    ("vc,node num\na,1\na,2\n", "vc.csv:3: vc 'a' is listed twice"),
    ("vc,node num\n,2\n", "vc.csv:2: vc is empty"),
    ("vc,node num\na,1,3\n", "vc.csv:2: expected 2 fields, got 3"),
    ("vc,size\na,1\n", "vc.csv:1: VC file header 'vc,size' lacks column(s) 'node num'"),
    ("vc,node num,racks\na,1,1\n", "vc.csv:1: unknown VC column(s) 'racks'"),
    ("vc,node num\n", "vc.csv: no VC rows"),
    ("", "vc.csv: empty VC file"),
])
def test_bad_vc_files(tmp_path, text, message):
    path = tmp_path / "vc.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as err:
        read_vc_config(path)
    assert str(err.value).startswith(str(path) + message[len("vc.csv"):])


def test_vc_gpu_types_and_speeds():
    vcs = read_vc_config(data("generic_vc.csv"), gpu_speeds={"a100": 2.0, "v100": 1.0})
    assert (vcs["prod"].gpus, vcs["prod"].gpu_type, vcs["prod"].speed) == (24, "a100", 2.0)
    assert (vcs["research"].gpus, vcs["research"].speed) == (4, 1.0)
    with pytest.raises(TraceError, match=r"generic_vc.csv:3: gpu_type 'v100' has no speed in --gpu-speeds \(a100\)"):
        read_vc_config(data("generic_vc.csv"), gpu_speeds={"a100": 2.0})


def test_generic_format_fields_and_work():
    vcs = read_vc_config(data("generic_vc.csv"), gpu_speeds={"a100": 2.0, "v100": 1.0})
    trace = read_trace(data("generic_example.csv"), vcs)
    assert trace.fmt == "generic"
    jobs = {j.job_id: j for j in trace.jobs}
    assert [j.job_id for j in trace.jobs] == ["gpt-a", "bert", "gpt-b", "trial-1", "trial-2", "resnet"]
    a = jobs["gpt-a"]
    assert (a.kind, a.pp_stages, a.micro_batches, a.mem_gb, a.act_mem_gb, a.user) == ("pipeline", 4, 8, 40.0, 8.0, "alice")
    assert a.bubble == pytest.approx(3 / 11)
    assert jobs["gpt-b"].bubble == 0.2 and jobs["gpt-b"].duration == 43200 / 2.0  # work on a 2x GPU type
    assert jobs["trial-2"].duration == 900.0 and jobs["trial-2"].mem_gb == 12.0
    assert jobs["resnet"].kind == "train" and jobs["resnet"].bubble == 0.0


GENERIC_HEAD = "job_id,submit_time,num_gpus,vc,duration,work,kind,pp_stages,micro_batches,bubble_fraction"


@pytest.mark.parametrize("row, reason", [
    ("a,0,1,research,,,train,,,", "give exactly one of duration and work"),
    ("a,0,1,research,5,5,train,,,", "give exactly one of duration and work"),
    ("a,0,1,research,5,,batch,,,", "kind 'batch' is not one of train, hpo, pipeline"),
    ("a,0,4,research,5,,pipeline,,,", "kind 'pipeline' needs pp_stages and micro_batches, or bubble_fraction"),
    ("a,0,4,research,5,,pipeline,3,4,", "num_gpus 4 is not a multiple of pp_stages 3"),
    ("a,0,4,research,5,,pipeline,1,4,", "pp_stages 1 must be >= 2"),
    ("a,0,4,research,5,,pipeline,,,1.0", "bubble_fraction 1.0 must be < 1"),
    ("a,0,1,research,5,,hpo,2,4,", "pp_stages/micro_batches/bubble_fraction only apply to kind 'pipeline', not 'hpo'"),
    (",0,1,research,5,,train,,,", "job_id is empty"),
    ("a,soon,1,research,5,,train,,,", "timestamp 'soon' is not YYYY-MM-DD HH:MM:SS"),
    ("a,0,8,research,5,,train,,,", "num_gpus 8 exceeds the 4 GPUs of VC 'research'"),
])
def test_generic_bad_rows(tmp_path, row, reason):
    vcs = read_vc_config(data("generic_vc.csv"))
    path = tmp_path / "g.csv"
    path.write_text(f"{GENERIC_HEAD}\nok,0,1,research,5,,train,,,\n{row}\n")
    trace = read_trace(path, vcs, skip_bad_rows=True)
    assert trace.rejected == [(3, reason)]
    assert [j.job_id for j in trace.jobs] == ["ok"]


def test_generic_duplicate_ids_and_mixed_time_forms(tmp_path):
    vcs = read_vc_config(data("generic_vc.csv"))
    path = tmp_path / "g.csv"
    path.write_text("job_id,submit_time,num_gpus,vc,duration\n"
                    "a,0,1,research,5\n"
                    "a,1,1,research,5\n"
                    "b,2017-10-01 00:00:00,1,research,5\n")
    trace = read_trace(path, vcs, skip_bad_rows=True)
    assert trace.rejected == [
        (3, "job_id 'a' already used on line 2"),
        (4, "submit_time '2017-10-01 00:00:00' is given as timestamp but line 2 gives seconds; "
            "use one form in a file"),
    ]


@pytest.mark.parametrize("header, message", [
    ("job_id,submit_time,num_gpu,vc,duration", "unknown column(s) 'num_gpu' (did you mean 'num_gpus'?)"),
    ("job_id,submit_time,vc,duration", "missing required column(s) num_gpus"),
    ("job_id,submit_time,num_gpus,vc", "needs a 'duration' or a 'work' column"),
])
def test_generic_bad_headers(tmp_path, header, message):
    vcs = read_vc_config(data("generic_vc.csv"))
    path = tmp_path / "g.csv"
    path.write_text(header + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(path, vcs)
    assert str(err.value).startswith(f"{path}:1: {message}")

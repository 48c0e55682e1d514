"""tools/bench_detector.py keeps the traces used to choose the detector's rules (tuning) apart from
the ones its headline figures come from (evaluation): the sets are disjoint, every regression trace
is in exactly one, and the JSON line's top-level figures are computed from evaluation data only."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tools import bench_detector as bd


def test_tuning_and_evaluation_seeds_and_jobs_are_disjoint():
    assert bd.EVALUATION_SEED not in bd.TUNING_SEEDS
    # Not only the seeds: no generated job of one set is a job of the other (per part and across).
    tuning = {bd.job_seed(s, part, k) for s in bd.TUNING_SEEDS for part in ("a", "a'", "d") for k in range(1000)}
    evaluation = {bd.job_seed(bd.EVALUATION_SEED, part, k) for part in ("a", "a'", "d") for k in range(1000)}
    assert len(tuning) == 3000 * len(bd.TUNING_SEEDS) and len(evaluation) == 3000
    assert not tuning & evaluation


def test_every_regression_trace_is_in_exactly_one_set():
    assert not set(bd.TUNING_TRACES) & set(bd.EVALUATION_TRACES)
    names = bd.trace_files(bd.LIVE_TRACES)
    tuning, evaluation = bd.split_traces(names)
    assert sorted(tuning + evaluation) == names
    assert set(tuning) == set(bd.TUNING_TRACES) and set(evaluation) == set(bd.EVALUATION_TRACES)
    # The MoE traces chose the expert rate's t-statistic gate: tuning, every one of them.
    assert all(n.startswith("moe-") for n in tuning) and not any(n.startswith("moe-") for n in evaluation)


def test_an_unclassified_regression_trace_is_refused():
    names = bd.trace_files(bd.LIVE_TRACES) + ["megatron-pp2-slow1x2@20-r0.trace.jsonl.gz"]
    with pytest.raises(ValueError, match=r"in neither TUNING_TRACES nor EVALUATION_TRACES of tools/bench_detector\.py: "
                                         r"megatron-pp2-slow1x2@20-r0\.trace\.jsonl\.gz; add each"):
        bd.split_traces(names)


def test_traces_of_another_directory_are_all_evaluation(tmp_path):
    name = bd.EVALUATION_TRACES[0]
    shutil.copy(os.path.join(bd.LIVE_TRACES, bd.TUNING_TRACES[0]), tmp_path / "mine.trace.jsonl.gz")
    assert bd.split_traces(["mine.trace.jsonl.gz", name], str(tmp_path)) == ([], ["mine.trace.jsonl.gz", name])


def test_a_tuning_seed_is_refused_as_evaluation_seed(capsys):
    with pytest.raises(SystemExit) as exc:
        bd.main(["--eval-seed", str(bd.TUNING_SEEDS[0]), "--parts", "c"])
    assert exc.value.code == 2
    assert "--eval-seed 0 is a tuning seed (its jobs were used to choose the detector's rules" in capsys.readouterr().err


def test_headline_figures_come_from_the_evaluation_set_only(monkeypatch):
    calls = []

    def fake(part):
        def run(args, seed, label):
            calls.append((part, seed, label))
            return {"part": part, "seed": seed}
        return run

    def fake_traces(paths, label, directory):
        calls.append(("c", tuple(paths), label))
        return {"part": "c", "traces": list(paths)}

    monkeypatch.setattr(bd, "run_device", fake("a"))
    monkeypatch.setattr(bd, "run_flops_form", fake("a'"))
    monkeypatch.setattr(bd, "run_moe", fake("d"))
    monkeypatch.setattr(bd, "run_live_traces", fake_traces)
    args = bd.argparse.Namespace(eval_seed=7, flops_jobs=1, moe_healthy_jobs=1, moe_jobs_per_factor=0,
                                 live_traces=bd.LIVE_TRACES, no_live=True)
    result = bd.collect(args, {"a", "a'", "d", "c", "b"})
    ev = set(bd.EVALUATION_TRACES)
    for key, part in (("synthetic", "a"), ("synthetic_flops_form", "a'"), ("moe", "d")):
        assert result[key] == {"part": part, "seed": 7}
        assert result["tuning"][key] == {"part": part, "seed": bd.TUNING_SEEDS[0]}
    assert set(result["live_traces"]["traces"]) == ev and result["evaluation"]["live_trace_files"] == \
        result["live_traces"]["traces"]
    assert set(result["tuning"]["live_traces"]["traces"]) == set(result["tuning"]["live_trace_files"]) == \
        set(bd.TUNING_TRACES)
    assert result["tuning"]["label"] == "tuning (used to choose the rule; not an evaluation)"
    assert result["evaluation"]["seed"] == 7 and result["live"] is None
    # Every run for the headline got the evaluation seed or evaluation traces, and was labelled so.
    for call in calls:
        if call[-1] == bd.EVALUATION_LABEL:
            assert call[1] == 7 if call[0] != "c" else set(call[1]) == ev
        else:
            assert call[-1] == bd.TUNING_LABEL
            assert call[1] == 0 if call[0] != "c" else set(call[1]) == set(bd.TUNING_TRACES)
    assert len(calls) == 8


def test_smallest_run_prints_labelled_tables_then_one_json_line(capsys):
    assert bd.main(["--parts", "a,c", "--healthy-jobs", "1", "--jobs-per-factor", "0", "--ramp-jobs", "0",
                    "--iterations", "60"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert not any(line.startswith("{") for line in lines[:-1])
    heads = [line for line in lines if line.startswith("[")]
    assert heads[0].startswith("[evaluation (never used for a choice)] ResiHP detector benchmark (a)") and \
        f"seed {bd.EVALUATION_SEED}," in heads[0]
    assert heads[1].startswith("[evaluation (never used for a choice)] (c) live traces (20 under")
    assert heads[2].startswith("[tuning (used to choose the rule; not an evaluation)] ResiHP detector benchmark (a)") \
        and "seed 0," in heads[2]
    assert heads[3].startswith("[tuning (used to choose the rule; not an evaluation)] (c) live traces (6 under")
    assert result["live_traces"]["traces"] == 20 and result["tuning"]["live_traces"]["traces"] == 6
    assert sorted(result["evaluation"]["live_trace_files"]) == sorted(bd.EVALUATION_TRACES)
    assert sorted(result["tuning"]["live_trace_files"]) == sorted(bd.TUNING_TRACES)
    assert set(result) == {"synthetic", "live_traces", "evaluation", "tuning", "bench", "commit", "dirty", "command",
                           "load_before", "load_after", "cpus"}   # the harness's provenance (megatron_ext/bench)
    assert result["bench"] == "bench_detector"


def test_the_live_parts_figures_come_from_the_flags_its_runs_get():
    from megatron_ext.config.run import parse_run_config

    runs = bd.live_runs(slow_at=30, stop_at=8)
    assert list(runs) == ["slow", "stop", "link", "nic", "path"]
    for name, (argv, fault) in runs.items():
        faults = parse_run_config(argv[1:]).ext("faults")   # what pretrain_gpt.py makes of the run's flags
        assert {"slow": faults.slow, "stop": faults.stop, "link": faults.slow_link, "nic": faults.slow_nic,
                "path": faults.slow_path}[name] == [fault]
    # 256 x 1 x 64 fp32 activations at 2 MB/s; a 64 KiB probe message at 4 MB/s and at 3 MB/s
    # (docs/resihp.md quotes them)
    link_s, nic_s, path_s = bd.injected_s(runs)
    assert (round(1e3 * link_s, 2), round(1e3 * nic_s, 2), round(1e3 * path_s, 2)) == (32.77, 16.38, 21.85)
    assert "--pipeline-model-parallel-size" not in runs["path"][0]

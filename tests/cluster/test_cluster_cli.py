"""The CLI (`python -m megatron_ext.cluster ...`), its JSON line, output files, errors; the flag list."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from megatron_ext.cluster.cli import main
from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.engine import simulate
from megatron_ext.cluster.metrics import summarize
from megatron_ext.cluster.trace import read_trace, read_vc_config
from megatron_ext.config.base import field_names
from tests.cluster.cluster_helpers import data

BASE = ["--trace", data("philly_small.csv"), "--vc-config", data("philly_vc_tight.csv")]


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_flag_list_is_pinned():
    assert field_names(ClusterSimConfig) == [
        "trace", "vc_config", "trace_format", "policy", "load_scale", "helios_compat", "skip_bad_rows",
        "gpus_per_node", "placement", "spread_slowdown", "backfill", "restart_cost_s", "las_thresholds_gpu_s",
        "las_promote_knob", "ftf_lease_s", "qssf_estimator", "estimator_seed", "gpu_speeds", "bubble_speed",
        "bubble_speed_from", "gpu_mem_gb"]


def test_simulate_json_last_line_matches_the_library(capsys):
    assert main(["simulate", *BASE, "--policy", "sjf", "--load-scale", "10", "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    for key in ("avg_jct_s", "p99_jct_s", "avg_queue_s", "makespan_s", "utilization", "per_vc"):
        assert key in out
    trace = read_trace(data("philly_small.csv"), read_vc_config(data("philly_vc_tight.csv")), load_scale=10)
    want = summarize(simulate(trace, ClusterSimConfig(policy="sjf", load_scale=10)))
    for key in ("avg_jct_s", "p99_jct_s", "avg_queue_s", "makespan_s", "utilization", "jobs"):
        assert out[key] == want[key]
    assert set(out["per_vc"]) == {"6214e9", "11cb48", "ee9e8c", "103959", "6c71a0"}
    assert out["dropped_jobs"] == {"23dbec": 8, "51b7ef": 4, "795a4c": 3, "925e2b": 3}
    assert out["per_vc"]["6214e9"]["jobs"] == 284


def test_simulate_writes_json_csv_and_plot(tmp_path, capsys):
    plot = tmp_path / "cdf.png"
    assert main(["simulate", *BASE, "--policy", "srtf", "--load-scale", "10", "--out-dir", str(tmp_path / "o"),
                 "--plot", str(plot), "--helios-compat"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["helios_compat"] is True and summary["policy"] == "srtf"
    with open(tmp_path / "o" / "jobs.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == summary["jobs"]
    jct = [float(r["jct_s"]) for r in rows]
    assert sum(jct) / len(jct) == pytest.approx(summary["avg_jct_s"], rel=1e-6)
    with open(tmp_path / "o" / "per_vc.csv") as fh:
        per_vc = list(csv.DictReader(fh))
    assert per_vc[-1]["vc"] == "all" and float(per_vc[-1]["avg_jct_s"]) == pytest.approx(summary["avg_jct_s"], rel=1e-5)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_yaml_config_and_flags_override(tmp_path, capsys):
    yml = tmp_path / "sim.yaml"
    yml.write_text(f"trace: {data('philly_small.csv')}\nvc-config: {data('philly_vc_tight.csv')}\n"
                   "policy: fifo\nload_scale: 10\n")
    assert main(["simulate", "--config", str(yml), "--policy", "sjf", "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert (out["policy"], out["load_scale"]) == ("sjf", 10.0)
    yml.write_text("polcy: fifo\n")
    assert main(["simulate", "--config", str(yml)]) == 2
    assert "unknown key 'polcy' (did you mean 'policy'?)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--trace", data("philly_bad_rows.csv"), "--vc-config", data("philly_vc.csv")],
     "11 bad row(s): line 3: timestamp '2017-10-9 07:01:55' is not YYYY-MM-DD HH:MM:SS"),
    (["simulate", *BASE, "--load-scale", "0"],
     "python -m megatron_ext.cluster: error: --load-scale must be > 0, got 0.0"),
    (["simulate", *BASE, "--polcy", "sjf"],
     "python -m megatron_ext.cluster: error: unrecognized arguments: --polcy sjf; did you mean --policy?"),
    (["simulate", *BASE, "--policy", "ftf", "--helios-compat"], "--policy ftf has no counterpart"),
])
def test_errors_exit_2_with_a_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_skip_bad_rows_counts_rejections(capsys):
    assert main(["simulate", "--trace", data("philly_bad_rows.csv"), "--vc-config", data("philly_vc.csv"),
                 "--skip-bad-rows", "--json"]) == 0
    captured = capsys.readouterr()
    assert last_json(captured.out)["rejected_rows"] == 11 and last_json(captured.out)["jobs"] == 2


def test_compare_and_bubbles_commands(tmp_path, capsys):
    plot = tmp_path / "panels.png"
    assert main(["compare", *BASE, "--policies", "fifo", "srtf", "--load-scales", "1", "10", "--plot", str(plot),
                 "--json"]) == 0
    runs = last_json(capsys.readouterr().out)["runs"]
    assert [(r["policy"], r["load_scale"]) for r in runs] == [("fifo", 1), ("srtf", 1), ("fifo", 10), ("srtf", 10)]
    assert plot.exists()
    assert main(["bubbles", "--scenario-trials", "8", "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert out["makespan_exclusive_s"] > out["makespan_bubbles_s"] > 0


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.cluster", "simulate", *BASE, "--policy", "fifo",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["policy"] == "fifo"


# ---- the embedded default trace (a fresh clone has no trace of its own) ------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _installed_package_dir(cwd) -> str | None:
    """Where this interpreter imports megatron_ext from without PYTHONPATH (None: not installed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('megatron_ext'); "
                          "print(s.submodule_search_locations[0] if s else '')"],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or None


def test_simulate_without_a_trace_runs_the_embedded_philly_trace_from_an_install(tmp_path):
    where = _installed_package_dir(tmp_path)
    if where is None or os.path.realpath(where) != os.path.realpath(os.path.join(ROOT, "megatron_ext")):
        pytest.skip("megatron-ext from this checkout is not installed in this interpreter (pip install -e .)")
    # From an unrelated directory, without PYTHONPATH: the installed package must find its data.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "megatron_ext.cluster", "simulate", "--policy", "sjf", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("trace: the embedded Philly trace (Microsoft, 2017; CC BY 4.0;")
    assert lines[1].split() == ["policy", "load", "jobs", "avg", "JCT", "s", "median", "s", "p99", "JCT", "s",
                                "avg", "queue", "s", "makespan", "s", "util", "preempt", "wall", "s"]
    assert lines[2].split()[:3] == ["sjf", "1", "82229"]
    summary = json.loads(lines[-1])
    assert summary["jobs"] == 82229 and sum(summary["dropped_jobs"].values()) == 18
    assert len(summary["per_vc"]) == 11 and summary["avg_jct_s"] > 0


def test_the_default_trace_is_package_data_of_the_build(tmp_path):
    # What a wheel or a non-editable install gets: setuptools' build_py copies packages and package_data.
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    built = sorted(os.listdir(tmp_path / "megatron_ext" / "cluster" / "data"))
    assert built == sorted(os.listdir(os.path.join(ROOT, "megatron_ext", "cluster", "data")))
    assert {"philly.csv.gz", "philly_vc.csv", "NOTICE.md", "LICENSE-CC-BY-4.0.txt"} <= set(built)


@pytest.mark.parametrize("given", [["--trace", data("philly_small.csv")], ["--vc-config", data("philly_vc.csv")]])
def test_half_an_input_pair_is_an_error_not_the_default(given, capsys):
    assert main(["simulate", *given]) == 2
    flag, other = given[0], "--vc-config" if given[0] == "--trace" else "--trace"
    assert capsys.readouterr().err.strip() == (
        f"python -m megatron_ext.cluster: error: {flag} needs {other} too (give both, or neither for the embedded Philly trace)")


def test_a_truncated_gzip_trace_is_a_located_error(tmp_path, capsys):
    import gzip

    whole = gzip.compress(open(data("philly_small.csv"), "rb").read())
    bad = tmp_path / "cut.csv.gz"
    bad.write_bytes(whole[: len(whole) // 2])
    assert main(["simulate", "--trace", str(bad), "--vc-config", data("philly_vc.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"python -m megatron_ext.cluster: error: {bad}: cannot be read (EOFError: ") and "\n" not in err

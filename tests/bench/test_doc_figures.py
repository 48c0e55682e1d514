"""Every figure kept in docs/figures/ names the commit it was measured on, and that commit has the
last change to the files its benchmark exercises (megatron_ext/bench/figures.py BENCH_FILES); a
figure without provenance is listed in docs/figures/UNVERSIONED.md with the reason."""
from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from megatron_ext.bench.figures import BENCH_FILES, check_figures, has_history, last_change
from tests.conftest import ROOT


def test_every_kept_figure_is_current_or_listed_as_unversioned():
    if not has_history(ROOT):
        pytest.skip(f"{ROOT} has no full git history (a tarball or a shallow clone): figure commits cannot be ordered")
    problems = check_figures(ROOT)
    assert not problems, "figures in docs/figures:\n" + "\n".join(problems)


def test_every_benchmark_lists_the_files_it_exercises_and_they_exist():
    benches = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools", "bench_*.py")))
    assert sorted(BENCH_FILES) == sorted([*benches, "gpu_check"])   # gpu_check --record keeps figures too
    for bench, paths in BENCH_FILES.items():
        assert f"tools/{bench}.py" in paths
        for p in paths:
            if not p.startswith(":("):
                assert os.path.exists(os.path.join(ROOT, p)), f"BENCH_FILES[{bench!r}] names {p}, which does not exist"


def git(repo, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def commit_all(repo, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "engine.py").write_text("x = 1\n")
    (tmp_path / "other.py").write_text("y = 1\n")
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    return tmp_path


FILES = {"bench_toy": ["src", "tools_toy.py"]}


def figure(repo, name: str, commit: str) -> None:
    line = json.dumps({"speedup": 1.5, "bench": "bench_toy", "commit": commit, "dirty": False})
    (repo / "docs" / "figures" / name).write_text("table row\n" + line + "\n")


def test_a_figure_older_than_a_change_to_its_files_fails_with_both_commits(repo):
    measured = commit_all(repo, "measured here")
    figure(repo, "toy.txt", measured)
    commit_all(repo, "figure kept")
    (repo / "other.py").write_text("y = 2\n")  # not a file of bench_toy: the figure stays current
    commit_all(repo, "unrelated change")
    assert check_figures(str(repo), bench_files=FILES) == []
    (repo / "src" / "engine.py").write_text("x = 2\n")
    newer = commit_all(repo, "engine changed")
    assert last_change(str(repo), FILES["bench_toy"]) == newer
    assert check_figures(str(repo), bench_files=FILES) == [
        f"docs/figures/toy.txt: bench_toy figure measured on commit {measured[:12]}, but commit {newer[:12]} "
        f"changed its files since (src tools_toy.py); rerun tools/bench_toy.py and record it again"]


def test_a_superseded_run_stays_on_file_without_failing_but_only_under_superseded(repo):
    measured = commit_all(repo, "measured here")
    (repo / "docs" / "figures" / "superseded").mkdir()
    figure(repo, "superseded/toy_run1.txt", measured)
    figure(repo, "toy_run1.txt", measured)
    commit_all(repo, "figures kept")
    (repo / "src" / "engine.py").write_text("x = 2\n")
    commit_all(repo, "engine changed")
    problems = check_figures(str(repo), bench_files=FILES)
    assert len(problems) == 1 and problems[0].startswith("docs/figures/toy_run1.txt: bench_toy figure measured"), problems


def test_a_figure_measured_on_the_newest_change_passes(repo):
    (repo / "src" / "engine.py").write_text("x = 3\n")
    newest = commit_all(repo, "engine changed")
    figure(repo, "toy.txt", newest)
    commit_all(repo, "figure kept")  # a later commit that only adds the figure keeps it current
    assert check_figures(str(repo), bench_files=FILES) == []


def test_a_figure_without_provenance_must_be_listed_and_the_list_must_be_true(repo):
    commit_all(repo, "start")
    (repo / "docs" / "figures" / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (repo / "docs" / "figures" / "old.txt").write_text('table\n{"speedup": 1.2}\n')
    assert check_figures(str(repo), bench_files=FILES) == [
        'docs/figures/old.txt: no provenance (no JSON line with "bench" and "commit") and not listed in '
        'docs/figures/UNVERSIONED.md; record it with a benchmark that uses megatron_ext.bench.harness.Report, '
        'or list it there with the reason',
        'docs/figures/plot.png: no provenance (no JSON line with "bench" and "commit") and not listed in '
        'docs/figures/UNVERSIONED.md; record it with a benchmark that uses megatron_ext.bench.harness.Report, '
        'or list it there with the reason']
    (repo / "docs" / "figures" / "UNVERSIONED.md").write_text(
        "# list\n- `plot.png`: an image; to be regenerated\n- `old.txt`: before the harness\n"
        "- `gone.txt`: removed since\n")
    assert check_figures(str(repo), bench_files=FILES) == [
        "docs/figures/UNVERSIONED.md lists gone.txt, which does not exist; remove the line"]


def test_a_table_kept_beside_its_json_line_takes_its_provenance(repo):
    # tools/gpu_check.py --record writes NAME.txt (the table) and NAME.json (the line).
    measured = commit_all(repo, "measured here")
    figs = repo / "docs" / "figures"
    (figs / "gpu_run.txt").write_text("section  figure  value\n")
    (figs / "gpu_run.json").write_text(json.dumps({"bench": "bench_toy", "commit": measured}) + "\n")
    (figs / "lone.txt").write_text("section  figure  value\n")  # no sibling: still unversioned
    commit_all(repo, "figures kept")
    assert check_figures(str(repo), bench_files=FILES) == [
        'docs/figures/lone.txt: no provenance (no JSON line with "bench" and "commit") and not listed in '
        'docs/figures/UNVERSIONED.md; record it with a benchmark that uses megatron_ext.bench.harness.Report, '
        'or list it there with the reason']
    (repo / "src" / "engine.py").write_text("x = 2\n")
    newer = commit_all(repo, "engine changed")
    stale = [p for p in check_figures(str(repo), bench_files=FILES) if "gpu_run" in p]
    assert [p.split(":")[0] for p in stale] == ["docs/figures/gpu_run.json", "docs/figures/gpu_run.txt"]
    assert all(f"but commit {newer[:12]} changed its files since" in p for p in stale)


def test_an_unknown_bench_or_commit_is_named(repo):
    commit_all(repo, "start")
    (repo / "docs" / "figures" / "a.txt").write_text(json.dumps({"bench": "bench_nope", "commit": "0" * 40}) + "\n")
    (repo / "docs" / "figures" / "b.txt").write_text(json.dumps({"bench": "bench_toy", "commit": "1" * 40}) + "\n")
    problems = check_figures(str(repo), bench_files=FILES)
    assert problems[0] == ("docs/figures/a.txt: bench 'bench_nope' has no entry in megatron_ext/bench/figures.py "
                           "BENCH_FILES (known: bench_toy)")
    assert problems[1].startswith("docs/figures/b.txt: bench_toy figure's commit 111111111111 is not in this "
                                  "repository's history")
    assert len(problems) == 2


def test_no_history_is_detected(tmp_path):
    assert not has_history(str(tmp_path))

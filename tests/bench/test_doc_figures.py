"""Every figure kept in docs/figures/ names the commit it was measured on; one measured before a later
change to the files its benchmark loads is stale, which the report lists and a doc quoting it says
next to the quote (a generated mark); a figure without provenance is listed in
docs/figures/UNVERSIONED.md with the reason; ``make figures`` measures the stale ones again."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_ext.bench import figure_marks
from megatron_ext.bench.figure_reruns import MANUAL, Rerun, format_plan, new_names, plan_reruns, rerun
from megatron_ext.bench.figures import (LAUNCHED, READS, Figure, check_figures, derive_bench_files, has_history,
                                        kept_figures, last_change, status_report, write_marks)
from megatron_ext.bench.import_graph import entry_points, loaded_files, modules
from tests.conftest import ROOT


def test_every_quote_of_a_stale_figure_in_the_docs_is_marked_and_the_report_prints():
    if not has_history(ROOT):
        pytest.skip(f"{ROOT} has no full git history (a tarball or a shallow clone): figure commits cannot be ordered")
    report, problems = status_report(ROOT)
    print(report)   # the stale figures and who quotes them: pytest -s shows it
    assert not problems, "figures in docs/figures and their quotes (make figures-marks):\n" + "\n".join(problems)


def test_every_benchmark_has_a_derived_file_list_and_every_path_exists():
    benches = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools", "bench_*.py")))
    files = derive_bench_files(ROOT)
    assert sorted(files) == sorted([*benches, "gpu_check", "chaos"])   # gpu_check --record and the soak keep figures too
    for bench, paths in files.items():
        assert f"tools/{bench}.py" in paths
        for p in paths:
            assert os.path.exists(os.path.join(ROOT, p)), f"{bench}'s files name {p}, which does not exist"


def test_the_derived_lists_hold_what_the_hand_kept_one_missed():
    files = derive_bench_files(ROOT)

    def under(bench: str, prefix: str) -> bool:
        return any(p == prefix or p.startswith(prefix + "/") for p in files[bench])

    for prefix in ("megatron_ext/compat", "megatron_ext/data", "megatron_ext/engines.py", "megatron_ext/ft",
                   "megatron_ext/helix", "megatron_ext/bench/harness.py", "megatron_ext/__init__.py"):
        assert under("bench_helix", prefix), prefix
    for prefix in ("megatron_ext/config", "megatron_ext/pipeline", "megatron_ext/cluster/data"):
        assert under("bench_cluster", prefix), prefix
    # a bench that launches pretrain_gpt.py runs every extension setup.py registers
    extensions = [m.replace(".", "/") for m in entry_points(ROOT)["megatron_ext.extensions"]]
    for bench in ("bench_parallel", "bench_relayout", "bench_squeezer", "bench_detector", "gpu_check", "chaos"):
        assert "pretrain_gpt.py" in files[bench]
        for ext in extensions:
            assert under(bench, ext + ".py") or under(bench, ext + "/__init__.py"), (bench, ext)
        assert "deepspeed_patches/trainer.py" in files[bench]   # engines.py names it: --engine deepspeed
    assert {"tools/relayout_live_worker.py", "megatron_ext/resihp/injection.py"} <= set(files["bench_relayout"])
    assert {"tests/resihp/data", "tests/resilience/data", "docs/figures/resihp_relayout"} <= set(
        files["bench_resilience"])


def test_the_hand_kept_launches_and_reads_are_named_where_they_happen():
    mods = {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in modules(ROOT).values()}
    for bench, paths in LAUNCHED.items():
        source = open(os.path.join(ROOT, "tools", f"{bench}.py"), encoding="utf-8").read()
        for p in paths:
            assert os.path.exists(os.path.join(ROOT, p)), p
            if p.endswith(".py"):
                assert f'"{os.path.basename(p)}"' in source, f"tools/{bench}.py does not name {p}"
    for module, paths in READS.items():
        assert module in mods, module
        assert all(os.path.exists(os.path.join(ROOT, p)) for p in paths), paths


def test_the_figures_bookkeeping_is_on_no_benchmark_path():
    # A change to how figures are checked changes no figure: megatron_ext.bench imports the harness only.
    ours = {f"megatron_ext/bench/{m}.py" for m in ("figures", "figure_marks", "figure_reruns", "import_graph")}
    for bench, paths in derive_bench_files(ROOT).items():
        assert not ours & set(paths), bench


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_loaded_files_follows_imports_packages_names_and_entry_points(tmp_path):
    write(tmp_path / "setup.py", 'setup(entry_points={"megatron_ext.plugins": ["p = megatron_ext.plug.one:X"]})\n')
    write(tmp_path / "megatron_ext" / "__init__.py", "")
    write(tmp_path / "megatron_ext" / "a" / "__init__.py", "from . import b\n")
    write(tmp_path / "megatron_ext" / "a" / "b.py", "")
    write(tmp_path / "megatron_ext" / "a" / "c.py", 'def f():\n    from megatron_ext.late import x\n')
    write(tmp_path / "megatron_ext" / "a" / "unused.py", "")
    write(tmp_path / "megatron_ext" / "late.py", 'TARGET = "megatron_ext.named:run"\n')
    write(tmp_path / "megatron_ext" / "named.py", 'GROUP = "megatron_ext.plugins"\n')
    write(tmp_path / "megatron_ext" / "plug" / "__init__.py", "")
    write(tmp_path / "megatron_ext" / "plug" / "one.py", "")
    write(tmp_path / "megatron_ext" / "plug" / "two.py", "")
    write(tmp_path / "tools" / "bench_x.py", "import os\nfrom megatron_ext.a.c import f\n")
    assert loaded_files(["tools/bench_x.py"], str(tmp_path)) == [
        "megatron_ext/__init__.py", "megatron_ext/a/__init__.py", "megatron_ext/a/b.py", "megatron_ext/a/c.py",
        "megatron_ext/late.py", "megatron_ext/named.py", "megatron_ext/plug/__init__.py",
        "megatron_ext/plug/one.py", "tools/bench_x.py"]


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


def figure(repo, name: str, commit: str, **extra) -> None:
    line = json.dumps({"speedup": 1.5, "bench": "bench_toy", "commit": commit, "dirty": False, **extra})
    write(repo / "docs" / "figures" / name, "table row\n" + line + "\n")


def stale_of(repo) -> dict[str, tuple[str, ...]]:
    figures, problems = kept_figures(str(repo), bench_files=FILES)
    assert problems == []
    return {f.rel: f.changed_since for f in figures}


def test_a_figure_older_than_a_change_to_its_files_is_stale_and_reported_not_a_problem(repo):
    measured = commit_all(repo, "measured here")
    figure(repo, "toy.txt", measured)
    commit_all(repo, "figure kept")
    (repo / "other.py").write_text("y = 2\n")  # not a file of bench_toy: the figure stays current
    commit_all(repo, "unrelated change")
    assert stale_of(repo) == {"toy.txt": ()}
    (repo / "src" / "engine.py").write_text("x = 2\n")
    newer = commit_all(repo, "engine changed")
    (repo / "src" / "engine.py").write_text("x = 3\n")
    newest = commit_all(repo, "engine changed again")
    assert last_change(str(repo), FILES["bench_toy"]) == newest
    assert stale_of(repo) == {"toy.txt": (newer, newest)}
    assert check_figures(str(repo), bench_files=FILES) == []   # quoted nowhere: nothing to mark
    report, problems = status_report(str(repo), bench_files=FILES)
    assert problems == []
    assert report.splitlines()[:6] == [
        "1 kept figures with provenance in docs/figures: 1 stale, 0 current.",
        "Stale (a commit since the figure's changed its bench's files; a refactor leaves the figure true, a change "
        "of behaviour needs `make figures`):",
        f"  docs/figures/toy.txt  bench_toy, measured on {measured[:12]}",
        f"    changed since in 2 commits: {newer[:12]}, {newest[:12]}",
        "    files that differ now: src/engine.py",
        "    quoted in: no doc"]


def test_a_superseded_run_stays_on_file_unchecked_but_only_under_superseded(repo):
    measured = commit_all(repo, "measured here")
    figure(repo, "superseded/toy_run1.txt", measured)
    figure(repo, "toy_run1.txt", measured)
    commit_all(repo, "figures kept")
    (repo / "src" / "engine.py").write_text("x = 2\n")
    newer = commit_all(repo, "engine changed")
    assert stale_of(repo) == {"toy_run1.txt": (newer,)}


def test_a_figure_measured_on_the_newest_change_is_current(repo):
    (repo / "src" / "engine.py").write_text("x = 3\n")
    newest = commit_all(repo, "engine changed")
    figure(repo, "toy.txt", newest)
    commit_all(repo, "figure kept")  # a later commit that only adds the figure keeps it current
    assert stale_of(repo) == {"toy.txt": ()}
    assert check_figures(str(repo), bench_files=FILES) == []


def test_a_figure_measured_on_uncommitted_code_is_refused(repo):
    measured = commit_all(repo, "measured here")
    figure(repo, "toy.txt", measured, dirty=True)
    assert check_figures(str(repo), bench_files=FILES) == [
        f'docs/figures/toy.txt: bench_toy figure measured on commit {measured[:12]} with uncommitted changes '
        f'("dirty": true): no commit holds the code it measured; rerun it from a clean clone (make figures) or '
        f'move it under superseded/']


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
    (figs / "lone.txt").unlink()
    (repo / "src" / "engine.py").write_text("x = 2\n")
    newer = commit_all(repo, "engine changed")
    assert stale_of(repo) == {"gpu_run.json": (newer,), "gpu_run.txt": (newer,)}


def test_an_unknown_bench_or_commit_is_named(repo):
    commit_all(repo, "start")
    (repo / "docs" / "figures" / "a.txt").write_text(json.dumps({"bench": "bench_nope", "commit": "0" * 40}) + "\n")
    (repo / "docs" / "figures" / "b.txt").write_text(json.dumps({"bench": "bench_toy", "commit": "1" * 40}) + "\n")
    problems = check_figures(str(repo), bench_files=FILES)
    assert problems[0] == ("docs/figures/a.txt: bench 'bench_nope' is not a benchmark of this repository (known: "
                           "bench_toy); a figure's \"bench\" names the tools/<bench>.py that measured it")
    assert problems[1].startswith("docs/figures/b.txt: bench_toy figure's commit 111111111111 is not in this "
                                  "repository's history")
    assert len(problems) == 2


def test_no_history_is_detected(tmp_path):
    assert not has_history(str(tmp_path))


DOC = """\
# Toy

The run is kept in [figures/toy.txt](figures/toy.txt): speedup 1.5,
measured on a quiet host.

Next paragraph.
"""


def stale_toy(repo) -> tuple[str, str]:
    """A figure toy.txt measured on one commit, and a later commit that changed its bench's files."""
    measured = commit_all(repo, "measured here")
    figure(repo, "toy.txt", measured)
    write(repo / "docs" / "toy.md", DOC)
    commit_all(repo, "figure kept, quoted")
    (repo / "src" / "engine.py").write_text("x = 2\n")
    return measured, commit_all(repo, "engine changed")


def test_a_quoted_stale_figure_without_its_mark_fails_and_marks_are_written_once(repo):
    measured, newer = stale_toy(repo)
    assert check_figures(str(repo), bench_files=FILES) == [
        f"docs/toy.md:3: quotes docs/figures/toy.txt, a stale figure (measured on {measured[:12]}; 1 commit(s) "
        f"changed its bench's files since, the first {newer[:12]}), without a stale mark after the block; run "
        f"make figures-marks, or measure it again: make figures"]
    assert write_marks(str(repo), bench_files=FILES) == ["docs/toy.md"]
    assert (repo / "docs" / "toy.md").read_text() == DOC.replace("measured on a quiet host.\n", (
        f"measured on a quiet host.\n"
        f"<!-- stale-figure toy.txt {measured[:12]} -->\n"
        f"_Stale figure: `toy.txt` was measured on {measured[:12]}; code on its path changed since "
        f"({newer[:12]}). `make figures` measures it again._\n"))
    assert check_figures(str(repo), bench_files=FILES) == []
    assert write_marks(str(repo), bench_files=FILES) == []      # idempotent
    report, _ = status_report(str(repo), bench_files=FILES)
    assert "    quoted in: docs/toy.md:3" in report.splitlines()


def test_the_mark_lists_the_commits_since_and_a_new_one_updates_it_without_failing(repo):
    measured, newer = stale_toy(repo)
    write_marks(str(repo), bench_files=FILES)
    commit_all(repo, "marks")
    later = []
    for x in range(3, 6):
        (repo / "src" / "engine.py").write_text(f"x = {x}\n")
        later.append(commit_all(repo, f"engine changed to {x}"))
    assert check_figures(str(repo), bench_files=FILES) == []   # the mark is still true
    assert write_marks(str(repo), bench_files=FILES) == ["docs/toy.md"]
    assert (f"code on its path changed since ({newer[:12]}, {later[0][:12]}, {later[1][:12]} and 1 more)"
            in (repo / "docs" / "toy.md").read_text())


def test_a_mark_next_to_a_current_figure_fails_and_is_removed(repo):
    measured, newer = stale_toy(repo)
    write_marks(str(repo), bench_files=FILES)
    figure(repo, "toy.txt", newer)      # measured again on the newest change: current
    commit_all(repo, "measured again")
    assert check_figures(str(repo), bench_files=FILES) == [
        "docs/toy.md:5: a stale mark for toy.txt, but the figure is current (measured after the last change to its "
        "bench's files); run make figures-marks"]
    assert write_marks(str(repo), bench_files=FILES) == ["docs/toy.md"]
    assert (repo / "docs" / "toy.md").read_text() == DOC


def test_a_mark_must_name_the_figures_commit_and_sit_after_a_quote(repo):
    measured, newer = stale_toy(repo)
    write_marks(str(repo), bench_files=FILES)
    doc = repo / "docs" / "toy.md"
    marked = doc.read_text()
    doc.write_text(marked.replace(f"toy.txt {measured[:12]}", "toy.txt 0123456789ab"))
    assert check_figures(str(repo), bench_files=FILES) == [
        f"docs/toy.md:5: the stale mark of toy.txt says measured on 0123456789ab, but the figure was measured on "
        f"{measured[:12]}; run make figures-marks"]
    mark = marked.split("\n")[4:6]
    doc.write_text(marked + "\n".join(mark) + "\n")     # a second copy after "Next paragraph."
    assert check_figures(str(repo), bench_files=FILES) == [
        "docs/toy.md:9: a stale mark for toy.txt, but no block before it quotes that figure; run make figures-marks"]
    write_marks(str(repo), bench_files=FILES)
    assert doc.read_text() == marked


def test_a_quoted_path_that_does_not_exist_fails(repo):
    commit_all(repo, "start")
    write(repo / "docs" / "toy.md", "See `docs/figures/gone.txt` and [this](figures/bench_x/).\n")
    (repo / "docs" / "figures" / "bench_x").mkdir()
    assert check_figures(str(repo), bench_files=FILES) == [
        "docs/toy.md:1: quotes docs/figures/gone.txt, which does not exist"]


def test_marks_go_after_the_block_that_quotes_in_lists_tables_and_code():
    class Stale:
        def __init__(self, commit: str) -> None:
            self.commit, self.changed_since = commit, ["c" * 40]

    text = textwrap.dedent("""\
        1. First item quotes [a](figures/a.txt)
           and goes on.
        2. Second item.

        | run | record |
        |---|---|
        | 1 | [b](figures/b.txt) |
        | 2 | [a](figures/superseded/a.txt) |

        ```
        cat docs/figures/b.txt
        ```
        Both: figures/b.txt, figures/a.txt, and a current one: figures/c.txt.
        """)

    def mark(indent: str, rel: str, commit: str) -> str:
        return (f"{indent}<!-- stale-figure {rel} {commit * 12} -->\n{indent}_Stale figure: `{rel}` was measured on "
                f"{commit * 12}; code on its path changed since ({'c' * 12}). `make figures` measures it again._\n")

    marked = figure_marks.marked_text(text, "docs/figures", {"a.txt": Stale("a" * 40), "b.txt": Stale("b" * 40)})
    assert marked == (
        "1. First item quotes [a](figures/a.txt)\n   and goes on.\n" + mark("   ", "a.txt", "a") +
        "2. Second item.\n\n| run | record |\n|---|---|\n| 1 | [b](figures/b.txt) |\n"
        "| 2 | [a](figures/superseded/a.txt) |\n" + mark("", "b.txt", "b") +
        "\n```\ncat docs/figures/b.txt\n```\n" + mark("", "b.txt", "b") +
        "Both: figures/b.txt, figures/a.txt, and a current one: figures/c.txt.\n" + mark("", "a.txt", "a") +
        mark("", "b.txt", "b"))
    assert figure_marks.marked_text(marked, "docs/figures", {}) == text
    shown = "```\n" + mark("", "a.txt", "a") + "```\n"       # a mark shown in a code block is text
    assert figure_marks.marked_text(shown, "docs/figures", {}) == shown


def fig(bench: str, path: str, command: str, stale: bool = True) -> Figure:
    return Figure(path=f"docs/figures/{path}", rel=path, bench=bench, commit="a" * 40, command=command,
                  changed_since=("b" * 40,) if stale else ())


def test_the_plan_is_one_run_per_recorded_command_benches_in_order_default_first():
    figures = [
        fig("bench_relayout", "bench_relayout/run_1_pp2.txt", "python tools/bench_relayout.py --live-parts pp2"),
        fig("bench_relayout", "bench_relayout/run_1.txt", "python tools/bench_relayout.py"),
        fig("bench_cluster", "bench_cluster/run_1.txt", "python tools/bench_cluster.py", stale=False),
        fig("bench_parallel", "bench_parallel/run_1c.txt", "python tools/bench_parallel.py"),
        fig("bench_parallel", "bench_parallel/run_1b.txt", "python tools/bench_parallel.py"),
        fig("gpu_check", "gpu/g.json", "python tools/gpu_check.py --record"),
        fig("gpu_check", "gpu/g.txt", "python tools/gpu_check.py --record"),
        fig("bench_helix", "bench_helix/run_1.txt", "torchrun tools/bench_helix.py"),
    ]
    assert plan_reruns(figures) == [
        Rerun("bench_helix", "torchrun tools/bench_helix.py", ("docs/figures/bench_helix/run_1.txt",),
              "the recorded command 'torchrun tools/bench_helix.py' does not start with `python "
              "tools/bench_helix.py`"),
        Rerun("bench_parallel", "python tools/bench_parallel.py",
              ("docs/figures/bench_parallel/run_1b.txt", "docs/figures/bench_parallel/run_1c.txt")),
        Rerun("bench_relayout", "python tools/bench_relayout.py", ("docs/figures/bench_relayout/run_1.txt",)),
        Rerun("bench_relayout", "python tools/bench_relayout.py --live-parts pp2",
              ("docs/figures/bench_relayout/run_1_pp2.txt",)),
        Rerun("gpu_check", "python tools/gpu_check.py --record", ("docs/figures/gpu/g.json", "docs/figures/gpu/g.txt"),
              MANUAL["gpu_check"]),
    ]
    assert Rerun("b", "python tools/b.py --x 'a b'", ()).argv("/py") == ["/py", "tools/b.py", "--x", "a b"]
    assert format_plan(plan_reruns(figures[1:2])) == (
        "1 run, one after another, each from a clean clone of HEAD:\n"
        "  1. python tools/bench_relayout.py\n"
        "       replaces docs/figures/bench_relayout/run_1.txt")


def test_a_new_run_is_named_by_the_day_with_the_old_suffix_and_one_free_letter_per_bench(tmp_path):
    for name in ("run_20261204b.txt", "run_20261204b_tuned.txt", "superseded/run_20261210_tuned.txt",
                 "bench_live_run1.txt", "run_20261204.txt"):
        write(tmp_path / "docs" / "figures" / "b" / name, "")
    default = Rerun("b", "python tools/b.py", ("docs/figures/b/run_20261204b.txt",))
    tuned = Rerun("b", "python tools/b.py --tuned", ("docs/figures/b/run_20261204b_tuned.txt",))
    live = Rerun("c", "python tools/c.py", ("docs/figures/c/bench_live_run1.txt",))
    # run_20261210_tuned.txt is an old run's name (superseded): both of b's runs take the letter b
    assert new_names([default, tuned, live], str(tmp_path), "20261210") == {
        default: "docs/figures/b/run_20261210b.txt", tuned: "docs/figures/b/run_20261210b_tuned.txt",
        live: "docs/figures/c/run_20261210_bench_live_run1.txt"}
    # measured again on a day that has runs: the next free letter
    assert new_names([default], str(tmp_path), "20261204") == {default: "docs/figures/b/run_20261204c.txt"}


BENCH = '''\
import json, os, subprocess, sys
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True).stdout.strip()
sys.path.insert(0, root)
from src.engine import x
print("toy table: x =", x)
print(json.dumps({"x": x, "bench": "bench_toy", "commit": git("rev-parse", "HEAD"),
                  "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
                  "command": " ".join(["python", "tools/bench_toy.py", *sys.argv[1:]])}))
'''


def test_make_figures_reruns_a_stale_bench_in_a_clean_clone_and_supersedes_the_old_run(repo):
    files = {"bench_toy": ["tools/bench_toy.py", "src"]}
    write(repo / "tools" / "bench_toy.py", BENCH)
    measured = commit_all(repo, "bench")
    figure(repo, "bench_toy/run_20261201.txt", measured)
    write(repo / "docs" / "toy.md", "Kept in [figures/bench_toy/run_20261201.txt](figures/bench_toy/"
                                    "run_20261201.txt): x = 1.\n\nNext.\n")
    commit_all(repo, "figure kept")
    (repo / "src" / "engine.py").write_text("x = 2\n")
    head = commit_all(repo, "engine changed")
    write_marks(str(repo), bench_files=files)
    (repo / "other.py").write_text("uncommitted\n")           # the clone does not see it
    figures, _ = kept_figures(str(repo), bench_files=files)
    plan = plan_reruns(figures)
    assert plan == [Rerun("bench_toy", "python tools/bench_toy.py", ("docs/figures/bench_toy/run_20261201.txt",))]
    logged = []
    assert rerun(str(repo), plan, python=sys.executable, today="20261210", bench_files=files,
                 log=logged.append) == []
    new = (repo / "docs" / "figures" / "bench_toy" / "run_20261210.txt").read_text()
    assert new.splitlines()[0] == "toy table: x = 2"
    assert json.loads(new.splitlines()[-1])["commit"] == head
    assert (repo / "docs" / "figures" / "bench_toy" / "superseded" / "run_20261201.txt").exists()
    assert not (repo / "docs" / "figures" / "bench_toy" / "run_20261201.txt").exists()
    assert (repo / "docs" / "toy.md").read_text() == (
        "Kept in [figures/bench_toy/superseded/run_20261201.txt](figures/bench_toy/superseded/run_20261201.txt): "
        "x = 1.\n"
        f"<!-- figure-rerun bench_toy/superseded/run_20261201.txt bench_toy/run_20261210.txt {head[:12]} -->\n"
        f"_Rerun: `bench_toy/run_20261210.txt` (measured on {head[:12]}) replaces "
        f"`bench_toy/superseded/run_20261201.txt`; the figures quoted above are the earlier run's until this text "
        f"quotes the new one (then delete this mark)._\n\nNext.\n")
    assert logged[0] == f"running python tools/bench_toy.py in a clone of {head[:12]}"
    assert check_figures(str(repo), bench_files=files) == []
    assert stale_of_files(repo, files) == {"bench_toy/run_20261210.txt": ()}
    # the person updating the text quotes the new run and deletes the mark: a mark left behind fails
    doc = repo / "docs" / "toy.md"
    doc.write_text(doc.read_text().replace("figures/bench_toy/superseded/run_20261201.txt",
                                           "figures/bench_toy/run_20261210.txt"))
    assert check_figures(str(repo), bench_files=files) == [
        "docs/toy.md:2: the rerun mark of bench_toy/superseded/run_20261201.txt: the doc no longer quotes it; "
        "delete the mark"]


def stale_of_files(repo, files) -> dict[str, tuple[str, ...]]:
    figures, problems = kept_figures(str(repo), bench_files=files)
    assert problems == []
    return {f.rel: f.changed_since for f in figures}


def test_a_failed_rerun_keeps_the_old_figure_and_says_why(repo):
    files = {"bench_toy": ["tools/bench_toy.py", "src"]}
    write(repo / "tools" / "bench_toy.py", "import sys\nprint('half a table')\nsys.exit('toy bench broke')\n")
    measured = commit_all(repo, "bench")
    figure(repo, "bench_toy/run_20261201.txt", measured)
    (repo / "src" / "engine.py").write_text("x = 2\n")
    head = commit_all(repo, "engine changed")
    plan = [Rerun("bench_toy", "python tools/bench_toy.py", ("docs/figures/bench_toy/run_20261201.txt",))]
    assert rerun(str(repo), plan, today="20261210", bench_files=files, log=lambda _: None) == [
        f"python tools/bench_toy.py: exit 1 in a clone of {head[:12]}; the old figures stay. Its stderr ended:\n"
        f"toy bench broke"]
    assert sorted(os.listdir(repo / "docs" / "figures" / "bench_toy")) == ["run_20261201.txt"]


def test_the_command_line_reports_writes_the_marks_and_plans(repo, capsys):
    from tools import figures as cli

    write(repo / "tools" / "bench_toy.py", "print('v1')\n")
    measured = commit_all(repo, "bench")
    figure(repo, "bench_toy/run_20261201.txt", measured)
    write(repo / "docs" / "toy.md", "See figures/bench_toy/run_20261201.txt.\n")
    commit_all(repo, "figure kept")
    write(repo / "tools" / "bench_toy.py", "print('v2')\n")    # the bench's files derived: the script itself
    commit_all(repo, "bench changed")
    assert cli.main(["--root", str(repo), "status"]) == 1
    assert "    quoted in: docs/toy.md:1 (NOT MARKED)" in capsys.readouterr().out.splitlines()
    assert cli.main(["--root", str(repo), "marks"]) == 0
    assert capsys.readouterr().out == "marks rewritten: docs/toy.md\nevery quote of a stale figure is marked\n"
    assert cli.main(["--root", str(repo), "status"]) == 0
    capsys.readouterr()
    assert cli.main(["--root", str(repo), "rerun", "--dry-run"]) == 0
    assert capsys.readouterr().out == ("1 run, one after another, each from a clean clone of HEAD:\n"
                                       "  1. python tools/bench_toy.py\n"
                                       "       replaces docs/figures/bench_toy/run_20261201.txt\n")

"""Figures kept in docs/figures/, the code they were measured on, and the docs that quote them.

A figure is worth what the code it measured is. Every benchmark's JSON line carries ``bench`` and
``commit`` (``harness.Report``); a kept figure is *stale* once a commit after its own changed a file
its benchmark loads (``derive_bench_files``: the benchmark's imports, followed through the import graph,
and what it launches or reads by path). Stale is a fact to show, not a fault: a refactor stales
figures it does not change, and a rerun of every benchmark after every move costs an hour. What
must hold is that a reader sees it: a doc that quotes a stale figure carries a generated mark next
to the quote (``figure_marks``), and ``check_figures`` fails where one is missing or no longer
true, on a figure measured on uncommitted code (``"dirty": true``), and on a figure without
provenance that docs/figures/UNVERSIONED.md does not list with a reason. ``status_report`` lists
the stale figures and who quotes them; ``figure_reruns`` measures them again.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
from typing import Mapping, Sequence

from megatron_ext.bench import figure_marks
from megatron_ext.bench.import_graph import REPO_ROOT, loaded_files

FIGURES_DIR = "docs/figures"
DOCS = ("README.md", "docs/*.md")
"""The files whose quotes of figures are checked (globs relative to the repository root)."""

# What the import graph cannot see, per benchmark: the scripts it launches by path (their imports
# are followed too) and the data it reads by path. Every entry must exist; a script must be named in
# the benchmark's source (tests/bench/test_doc_figures.py).
LAUNCHED: dict[str, list[str]] = {
    "bench_checkpoint": ["pretrain_gpt.py"],
    "bench_detector": ["pretrain_gpt.py", "tests/resihp/data"],
    "bench_parallel": ["pretrain_gpt.py"],
    "bench_relayout": ["pretrain_gpt.py", "tools/relayout_live_worker.py"],
    "bench_squeezer": ["pretrain_gpt.py", "configs/squeeze_tiny.yaml"],
    "chaos": ["pretrain_gpt.py"],
    "gpu_check": ["pretrain_gpt.py"],
}
# Data a module reads by path (package data included), counted for every benchmark that loads it.
READS: dict[str, list[str]] = {
    "megatron_ext/cluster/trace.py": ["megatron_ext/cluster/data"],
    "megatron_ext/resilience/validate.py": ["tests/resihp/data", "tests/resilience/data",
                                            "docs/figures/resihp_relayout"],
}
KEEPS_FIGURES = ("gpu_check", "chaos")
"""Tools other than ``tools/bench_*.py`` whose figures are kept (``gpu_check --record`` writes to
docs/figures/gpu/; the chaos soak, ``tools/chaos.py``, to docs/figures/chaos/)."""

UNVERSIONED = "UNVERSIONED.md"
SUPERSEDED = "superseded"
"""A directory of that name (``docs/figures/<bench>/superseded/``) keeps the record of runs whose code
has since changed: every run stays on file, the misses included, and a doc that quotes one says it
is superseded. ``check_figures`` does not hold them to the current code."""
_LISTED = re.compile(r"^\s*[-*]\s+`([^`]+)`\s*[:\u2014-]\s*(\S.*)$")


@dataclasses.dataclass(frozen=True)
class Figure:
    """A kept figure with provenance, and what changed on its benchmark's path since it was measured."""

    path: str
    """Relative to the repository root (``docs/figures/bench_helix/run_20261204b.txt``)."""
    rel: str
    """Relative to the figures directory (``bench_helix/run_20261204b.txt``): how docs quote it."""
    bench: str
    commit: str
    command: str
    """The recorded command line (``python tools/bench_x.py ...``); the default one when not recorded."""
    changed_since: tuple[str, ...]
    """The commits after ``commit`` up to HEAD that touched the benchmark's files, oldest first."""

    @property
    def stale(self) -> bool:
        return bool(self.changed_since)


def benchmarks(root: str = REPO_ROOT) -> list[str]:
    """The benchmarks whose figures may be kept: every ``tools/bench_*.py`` and ``KEEPS_FIGURES``."""
    found = [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(root, "tools", "bench_*.py"))]
    return sorted([*found, *(b for b in KEEPS_FIGURES if os.path.isfile(os.path.join(root, "tools", b + ".py")))])


def derive_bench_files(root: str = REPO_ROOT) -> dict[str, list[str]]:
    """For each benchmark, the files whose change can move its figures, relative to ``root``: what
    ``tools/<bench>.py`` and the scripts it launches load (``import_graph.loaded_files``, which
    follows imports, package ``__init__`` files, modules loaded by name and the extension entry
    points), the data those modules read (``READS``) and what else it launches or reads by path
    (``LAUNCHED``). Derived from the source each time: a hand-kept copy of the graph goes stale."""
    out = {}
    for bench in benchmarks(root):
        extra = LAUNCHED.get(bench, [])
        code = loaded_files([f"tools/{bench}.py", *(p for p in extra if p.endswith(".py"))], root)
        data = [d for f in code for d in READS.get(f, [])]
        out[bench] = sorted({*code, *data, *(p for p in extra if not p.endswith(".py"))})
    return out


def figure_provenance(path: str) -> dict | None:
    """The figure's ``bench`` and ``commit`` (with the rest of its JSON line), or None when it has
    none: a binary file, or text with no JSON object carrying both keys (a whole-file JSON document,
    else the last line that is one). A table kept beside its JSON line (``tools/gpu_check.py --record``
    writes ``NAME.txt`` and ``NAME.json``) takes the provenance of its ``.json`` sibling."""
    own = _provenance_in(path)
    if own is None and not path.endswith(".json"):
        sibling = os.path.splitext(path)[0] + ".json"
        if os.path.isfile(sibling):
            return _provenance_in(sibling)
    return own


def _provenance_in(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (UnicodeDecodeError, OSError):
        return None
    return provenance_of(text)


def provenance_of(text: str) -> dict | None:
    """The JSON object in ``text`` that carries ``bench`` and ``commit``: the whole text, else its
    last line that is one (a benchmark prints its table, then its JSON line last)."""
    candidates = [text] + [line for line in reversed(text.splitlines()) if line.lstrip().startswith("{")]
    for chunk in candidates:
        try:
            obj = json.loads(chunk)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("bench") and obj.get("commit"):
            return obj
    return None


def unversioned(figures_dir: str) -> dict[str, str]:
    """docs/figures/UNVERSIONED.md: figure path (relative to figures_dir) -> why it has no provenance.
    One list item per file: ``- `path`: reason``."""
    path = os.path.join(figures_dir, UNVERSIONED)
    if not os.path.isfile(path):
        return {}
    out = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            m = _LISTED.match(line)
            if m:
                out[m.group(1)] = m.group(2).strip()
    return out


def _git(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)


def has_history(root: str) -> bool:
    """Whether ``root`` is a git checkout with its full history (a tarball or a shallow clone cannot
    say which commit is older)."""
    inside = _git(root, "rev-parse", "--is-inside-work-tree")
    if inside.returncode or inside.stdout.strip() != "true":
        return False
    return _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() != "true"


def last_change(root: str, paths: Sequence[str]) -> str | None:
    """The newest commit that touched any of ``paths`` (git pathspecs), or None if none did."""
    r = _git(root, "log", "-1", "--format=%H", "--", *paths)
    if r.returncode:
        raise RuntimeError(f"git log failed in {root}: {r.stderr.strip()}")
    return r.stdout.strip() or None


def changes_since(root: str, commit: str, paths: Sequence[str]) -> list[str]:
    """The commits in HEAD's history and not in ``commit``'s that touched any of ``paths``, oldest
    first: what a figure measured on ``commit`` has not seen."""
    r = _git(root, "rev-list", "--reverse", "--topo-order", f"{commit}..HEAD", "--", *paths)
    if r.returncode:
        raise RuntimeError(f"git rev-list {commit[:12]}..HEAD failed in {root}: {r.stderr.strip()}")
    return r.stdout.split()


def changed_files(root: str, commit: str, paths: Sequence[str]) -> list[str]:
    """Which of ``paths`` differ between ``commit`` and HEAD (for the report: what to read before
    deciding whether a change was a refactor or a change of behaviour)."""
    r = _git(root, "diff", "--name-only", commit, "HEAD", "--", *paths)
    return r.stdout.split() if r.returncode == 0 else []


def _in_history(root: str, commit: str) -> str | None:
    """None when ``commit`` is a commit of this repository, else git's reason."""
    r = _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    return None if r.returncode == 0 else (r.stderr.strip() or f"no commit {commit}")


def kept_figures(root: str, figures_dir: str = FIGURES_DIR,
                 bench_files: Mapping[str, Sequence[str]] | None = None) -> tuple[list[Figure], list[str]]:
    """The figures under ``root/figures_dir`` with provenance (``superseded`` directories left out),
    and one message per problem found on the way: a figure without provenance that UNVERSIONED.md
    does not list (or a listed file that is gone: the list stays true), an unknown benchmark, a
    commit not in this repository's history, a figure measured on uncommitted code."""
    files = derive_bench_files(root) if bench_files is None else bench_files
    base = os.path.join(root, figures_dir)
    listed = unversioned(base)
    figures: list[Figure] = []
    problems: list[str] = []
    found = set()
    for dirpath, dirs, names in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != SUPERSEDED)
        for f in sorted(names):
            rel = os.path.relpath(os.path.join(dirpath, f), base).replace(os.sep, "/")
            if rel == UNVERSIONED:
                continue
            found.add(rel)
            shown = f"{figures_dir}/{rel}"
            prov = figure_provenance(os.path.join(dirpath, f))
            if prov is None:
                if rel not in listed:
                    problems.append(f"{shown}: no provenance (no JSON line with \"bench\" and \"commit\") and not "
                                    f"listed in {figures_dir}/{UNVERSIONED}; record it with a benchmark that uses "
                                    f"megatron_ext.bench.harness.Report, or list it there with the reason")
                continue
            bench, commit = prov["bench"], prov["commit"]
            if bench not in files:
                problems.append(f"{shown}: bench {bench!r} is not a benchmark of this repository (known: "
                                f"{', '.join(sorted(files))}); a figure's \"bench\" names the tools/<bench>.py "
                                f"that measured it")
                continue
            if prov.get("dirty"):
                problems.append(f"{shown}: {bench} figure measured on commit {commit[:12]} with uncommitted "
                                f"changes (\"dirty\": true): no commit holds the code it measured; rerun it from "
                                f"a clean clone (make figures) or move it under {SUPERSEDED}/")
                continue
            missing = _in_history(root, commit)
            if missing:
                problems.append(f"{shown}: {bench} figure's commit {commit[:12]} is not in this repository's "
                                f"history ({missing})")
                continue
            figures.append(Figure(path=shown, rel=rel, bench=bench, commit=commit,
                                  command=prov.get("command") or f"python tools/{bench}.py",
                                  changed_since=tuple(changes_since(root, commit, files[bench]))))
    for rel in sorted(set(listed) - found):
        problems.append(f"{figures_dir}/{UNVERSIONED} lists {rel}, which does not exist; remove the line")
    return figures, problems


def doc_paths(root: str, docs: Sequence[str] = DOCS) -> list[str]:
    """The files ``docs`` (globs relative to ``root``) match, relative to ``root``, sorted."""
    found = {p for g in docs for p in glob.glob(os.path.join(root, g))}
    return sorted(os.path.relpath(p, root).replace(os.sep, "/") for p in found)


def check_figures(root: str, figures_dir: str = FIGURES_DIR, bench_files: Mapping[str, Sequence[str]] | None = None,
                  docs: Sequence[str] = DOCS) -> list[str]:
    """One message per problem with the figures under ``root/figures_dir`` and the docs quoting them
    (none: every quote of a stale figure is marked and every mark is true). Stale figures are not
    problems: ``status_report`` lists them."""
    figures, problems = kept_figures(root, figures_dir, bench_files)
    stale = {f.rel: f for f in figures if f.stale}
    for doc in doc_paths(root, docs):
        problems += figure_marks.check_doc(root, doc, figures_dir, stale, {f.rel for f in figures})
    return problems


def write_marks(root: str, figures_dir: str = FIGURES_DIR, bench_files: Mapping[str, Sequence[str]] | None = None,
                docs: Sequence[str] = DOCS) -> list[str]:
    """Add, update and remove the stale marks in ``docs`` so that each quote of a stale figure has
    one and no other quote does; the docs changed, relative to ``root``. Running it twice changes
    nothing the second time."""
    figures, _ = kept_figures(root, figures_dir, bench_files)
    stale = {f.rel: f for f in figures if f.stale}
    return [doc for doc in doc_paths(root, docs) if figure_marks.write_doc(root, doc, figures_dir, stale)]


def _commits(n: int) -> str:
    return f"{n} commit" + ("" if n == 1 else "s")


def _short_list(items: Sequence[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def status_report(root: str, figures_dir: str = FIGURES_DIR, bench_files: Mapping[str, Sequence[str]] | None = None,
                  docs: Sequence[str] = DOCS) -> tuple[str, list[str]]:
    """The figures' report (stale ones with the commits and files changed since, and the docs
    quoting them, marked or not; the current ones) and the problems that fail the docs check."""
    files = derive_bench_files(root) if bench_files is None else bench_files
    figures, problems = kept_figures(root, figures_dir, files)
    stale = {f.rel: f for f in figures if f.stale}
    quoted: dict[str, list[str]] = {}
    for doc in doc_paths(root, docs):
        problems += figure_marks.check_doc(root, doc, figures_dir, stale, {f.rel for f in figures})
        for rel, line, marked in figure_marks.quotes_in(root, doc, figures_dir, stale):
            quoted.setdefault(rel, []).append(f"{doc}:{line}{'' if marked else ' (NOT MARKED)'}")
    n_stale = sum(f.stale for f in figures)
    out = [f"{len(figures)} kept figures with provenance in {figures_dir}: {n_stale} stale, "
           f"{len(figures) - n_stale} current."]
    if n_stale:
        out.append("Stale (a commit since the figure's changed its bench's files; a refactor leaves the figure "
                   "true, a change of behaviour needs `make figures`):")
    for f in figures:
        if f.stale:
            changed = changed_files(root, f.commit, files[f.bench])
            out.append(f"  {f.path}  {f.bench}, measured on {f.commit[:12]}")
            out.append(f"    changed since in {_commits(len(f.changed_since))}: "
                       f"{_short_list([c[:12] for c in f.changed_since])}")
            out.append(f"    files that differ now: {_short_list(changed) if changed else 'none (changed and back)'}")
            out.append(f"    quoted in: {', '.join(quoted.get(f.rel, [])) or 'no doc'}")
    for f in figures:
        if not f.stale:
            out.append(f"  current: {f.path}  {f.bench}, measured on {f.commit[:12]}")
    out += [f"Problems ({len(problems)}; these fail the docs check):", *(f"  {p}" for p in problems)] if problems \
        else ["No problems: every quote of a stale figure is marked."]
    return "\n".join(out), problems

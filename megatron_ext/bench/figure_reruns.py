"""Measure stale figures again: one benchmark after another, each from a clean clone of HEAD.

``plan_reruns`` says what ``make figures`` will do: one run per recorded command of the stale
figures (a benchmark's figures recorded with other flags are measured again with those flags),
benchmarks in name order, the default command first. ``rerun`` runs the plan: for each run a fresh
``git clone`` of the repository checked out at HEAD (nothing uncommitted, nothing an earlier run
wrote), the command with ``PYTHONPATH`` at the clone, its output kept as the new figure once its
JSON line names the benchmark, HEAD and a clean tree. The figures it replaces move under their
directory's ``superseded/``, as every earlier run did; the docs' quotes of them follow
(``figure_marks.record_rerun``) and the stale marks are written again.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Callable, Mapping, Sequence

from megatron_ext.bench import figure_marks
from megatron_ext.bench.figures import (DOCS, FIGURES_DIR, SUPERSEDED, Figure, doc_paths, kept_figures,
                                        provenance_of, write_marks)

MANUAL = {"gpu_check": "needs CUDA devices: run `make gpu-check ARGS=--record` on a GPU host "
                       "(docs/runtime.md, First GPU run)"}
"""Benchmarks ``make figures`` does not run, and why."""
_RUN_NAME = re.compile(r"^run_\d{8}[a-z]?(?P<suffix>.*)\.txt$")


@dataclasses.dataclass(frozen=True)
class Rerun:
    """One benchmark run that replaces stale figures."""

    bench: str
    command: str
    """As recorded on the figures' JSON line: ``python tools/<bench>.py [flags]``."""
    figures: tuple[str, ...]
    """The stale figures it replaces, relative to the repository root."""
    manual: str | None = None
    """Why ``make figures`` does not run it (None: it does)."""

    def argv(self, python: str) -> list[str]:
        return [python, *shlex.split(self.command)[1:]]


def _why_manual(bench: str, command: str) -> str | None:
    if bench in MANUAL:
        return MANUAL[bench]
    words = shlex.split(command)
    if words[:2] != ["python", f"tools/{bench}.py"]:
        return f"the recorded command {command!r} does not start with `python tools/{bench}.py`"
    return None


def plan_reruns(figures: Sequence[Figure]) -> list[Rerun]:
    """The runs that measure every stale figure of ``figures`` again: one per (benchmark, recorded
    command), benchmarks in name order, each one's default command first, then by command."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in figures:
        if f.stale:
            groups.setdefault((f.bench, f.command), []).append(f.path)
    order = sorted(groups, key=lambda bc: (bc[0], bc[1] != f"python tools/{bc[0]}.py", bc[1]))
    return [Rerun(b, c, tuple(sorted(groups[(b, c)])), _why_manual(b, c)) for b, c in order]


def format_plan(plan: Sequence[Rerun]) -> str:
    if not plan:
        return "No stale figures: nothing to measure again."
    out = [f"{len(plan)} run{'' if len(plan) == 1 else 's'}, one after another, each from a clean clone of HEAD:"]
    for n, r in enumerate(plan, 1):
        out.append(f"  {n}. {r.command}" + (f"  -- not run here: {r.manual}" if r.manual else ""))
        out += [f"       replaces {p}" for p in r.figures]
    return "\n".join(out)


def _suffix(old: Sequence[str]) -> str:
    """What follows the date in the first old name (``run_20261204b_tuned.txt`` -> ``_tuned``); a name
    of another form is kept whole as the suffix."""
    first = os.path.basename(sorted(old)[0])
    m = _RUN_NAME.match(first)
    return m["suffix"] if m else "_" + os.path.splitext(first)[0]


def new_names(plan: Sequence[Rerun], root: str, today: str) -> dict[Rerun, str]:
    """Each run's new figure, relative to ``root``: ``run_<today><letter><suffix>.txt`` in the old
    figures' directory, the letter the first of '', 'b', 'c', ... that leaves every name of the
    benchmark's runs free (its runs of one day share a stem, as run_X.txt and run_X_tuned.txt do)."""
    out: dict[Rerun, str] = {}
    for bench in sorted({r.bench for r in plan}):
        runs = [r for r in plan if r.bench == bench]
        dirs = {r: os.path.dirname(sorted(r.figures)[0]) for r in runs}
        taken = {os.path.join(d, n) for d in set(dirs.values()) for n in _listing(root, d)}
        for letter in ["", *"bcdefghijklmnopqrstuvwxyz"]:
            names = {r: os.path.join(dirs[r], f"run_{today}{letter}{_suffix(r.figures)}.txt") for r in runs}
            if len(set(names.values())) == len(runs) and not set(names.values()) & taken:
                out.update(names)
                break
        else:
            raise RuntimeError(f"no free name run_{today}<letter>...txt for {bench} in "
                               f"{', '.join(sorted(set(dirs.values())))}")
    return out


def _git(root: str, *args: str) -> str:
    r = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed in {root}: {r.stderr.strip()}")
    return r.stdout.strip()


def _clone(root: str, commit: str, dest: str) -> None:
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", root, dest], check=True, capture_output=True)
    _git(dest, "checkout", "--quiet", "--detach", commit)


def _listing(root: str, directory: str) -> list[str]:
    """The names in ``directory`` and its ``superseded/`` (a new run must not take an old run's name)."""
    names = []
    for sub in (directory, os.path.join(directory, SUPERSEDED)):
        full = os.path.join(root, sub)
        names += os.listdir(full) if os.path.isdir(full) else []
    return names


def _under(path: str, figures_dir: str) -> str:
    """``path`` (relative to the repository root) as docs quote it: relative to ``figures_dir``."""
    return os.path.relpath(path, figures_dir).replace(os.sep, "/")


def _tail(path: str, n: int = 15) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return "\n".join(fh.read().splitlines()[-n:])


def run_one(root: str, run: Rerun, head: str, new: str, *, python: str, figures_dir: str,
            docs: Sequence[str], log: Callable[[str], None]) -> str | None:
    """Measure ``run`` in a clean clone of ``head``; keep its output as ``new`` (relative to
    ``root``), move the old figures under ``superseded/`` and follow them in the docs. The problem,
    or None."""
    supers = {p: os.path.join(os.path.dirname(p), SUPERSEDED, os.path.basename(p)) for p in run.figures}
    clash = [s for s in supers.values() if os.path.exists(os.path.join(root, s))]
    if clash:
        return f"{run.command}: not run: {', '.join(clash)} already exists (rename the old copy first)"
    with tempfile.TemporaryDirectory(prefix="figures-") as tmp:
        clone = os.path.join(tmp, "clone")
        _clone(root, head, clone)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [clone, os.environ.get("PYTHONPATH")]))}
        log(f"running {run.command} in a clone of {head[:12]}")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            rc = subprocess.run(run.argv(python), cwd=clone, env=env, stdout=out, stderr=err).returncode
        if rc:
            return f"{run.command}: exit {rc} in a clone of {head[:12]}; the old figures stay. Its stderr ended:\n" \
                   f"{_tail(err_path)}"
        with open(out_path, encoding="utf-8") as fh:
            text = fh.read()
    prov = provenance_of(text)
    if prov is None or prov["bench"] != run.bench or prov["commit"] != head or prov.get("dirty") is not False:
        got = "no JSON line with bench and commit" if prov is None else \
            f"bench {prov['bench']!r}, commit {prov['commit'][:12]}, dirty {prov.get('dirty')!r}"
        return f"{run.command}: its output's JSON line says {got}, not {run.bench!r} on {head[:12]} with a clean " \
               f"tree; the old figures stay"
    for old, sup in supers.items():
        os.makedirs(os.path.join(root, os.path.dirname(sup)), exist_ok=True)
        os.replace(os.path.join(root, old), os.path.join(root, sup))
    with open(os.path.join(root, new), "w", encoding="utf-8") as fh:
        fh.write(text)
    log(f"  kept as {new}; {', '.join(run.figures)} moved under {SUPERSEDED}/")
    moves = {_under(old, figures_dir): (_under(sup, figures_dir), _under(new, figures_dir), head)
             for old, sup in supers.items()}
    for doc in doc_paths(root, docs):
        if figure_marks.record_rerun(root, doc, figures_dir, moves):
            log(f"  {doc}: quotes of the old run now name it under {SUPERSEDED}/, with a rerun mark")
    return None


def rerun(root: str, plan: Sequence[Rerun], *, python: str = sys.executable, today: str | None = None,
          figures_dir: str = FIGURES_DIR, bench_files: Mapping[str, Sequence[str]] | None = None,
          docs: Sequence[str] = DOCS, log: Callable[[str], None] = print) -> list[str]:
    """Run ``plan`` one run after another (a failed run leaves its figures stale and the next one
    goes on), then write the stale marks again. The problems, one per failed or skipped run."""
    head = _git(root, "rev-parse", "HEAD")
    today = today or datetime.date.today().strftime("%Y%m%d")
    problems = []
    names = new_names([r for r in plan if not r.manual], root, today)
    for run in plan:
        if run.manual:
            problems.append(f"{run.command}: not run: {run.manual}")
            continue
        problem = run_one(root, run, head, names[run], python=python, figures_dir=figures_dir, docs=docs, log=log)
        if problem:
            problems.append(problem)
        write_marks(root, figures_dir, bench_files, docs)
    return problems


def stale_plan(root: str, figures_dir: str = FIGURES_DIR,
               bench_files: Mapping[str, Sequence[str]] | None = None) -> list[Rerun]:
    """The plan for the stale figures of ``root`` as they are now."""
    figures, _ = kept_figures(root, figures_dir, bench_files)
    return plan_reruns(figures)

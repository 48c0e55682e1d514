"""Figures kept in docs/figures/ and the code they were measured on.

A figure is worth what the code it measured is: once a file its benchmark exercises changes, the
figure describes code that no longer exists. Every benchmark's JSON line carries ``bench`` and
``commit`` (``harness.Report``); ``check_figures`` fails a kept figure whose commit is older than
the last commit that touched its benchmark's files (``BENCH_FILES``), and one without provenance
that docs/figures/UNVERSIONED.md does not list with a reason.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Mapping, Sequence

# For each tools/bench_*.py, the sources whose change can move its figures: the benchmark itself,
# what it imports or launches, and the harness when it uses it. Paths are git pathspecs relative to
# the repository root (directories included; ":(exclude)..." leaves a sub-directory out).
BENCH_FILES: dict[str, list[str]] = {
    "bench_cluster": ["tools/bench_cluster.py", "megatron_ext/cluster", "megatron_ext/bench/harness.py"],
    "bench_detector": ["tools/bench_detector.py", "megatron_ext/resihp", "megatron_ext/ft", "megatron_ext/runtime",
                       "megatron_ext/config", "deepspeed_patches", "pretrain_gpt.py", "megatron_ext/bench/harness.py"],
    "bench_helix": ["tools/bench_helix.py", "megatron_ext/helix", "megatron_ext/runtime", "megatron_ext/config",
                    "megatron_ext/models", "megatron_ext/bench/harness.py"],
    "bench_hydro": ["tools/bench_hydro.py", "megatron_ext/hydro", ":(exclude)megatron_ext/hydro/squeezer",
                    "megatron_ext/bench/harness.py"],
    "bench_parallel": ["tools/bench_parallel.py", "megatron_ext/runtime", "megatron_ext/config", "megatron_ext/data",
                       "megatron_ext/models", "megatron_ext/compat", "deepspeed_patches", "megatron_ext/engines.py",
                       "pretrain_gpt.py", "megatron_ext/bench/harness.py"],
    "bench_relayout": ["tools/bench_relayout.py", "tools/relayout_live_worker.py", "megatron_ext/ft",
                       "megatron_ext/resihp", "megatron_ext/runtime", "pretrain_gpt.py", "megatron_ext/bench/harness.py"],
    "bench_resilience": ["tools/bench_resilience.py", "megatron_ext/resilience", "megatron_ext/resihp",
                         "megatron_ext/pipeline/pipesim.py", "megatron_ext/pipeline/schedule_orders.py",
                         "tests/resihp/data", "tests/resilience/data", "docs/figures/resihp_relayout",
                         "megatron_ext/bench/harness.py"],
    "bench_squeezer": ["tools/bench_squeezer.py", "megatron_ext/hydro", "megatron_ext/pipeline",
                       "megatron_ext/runtime", "deepspeed_patches", "pretrain_gpt.py", "megatron_ext/bench/harness.py"],
    # tools/gpu_check.py --record keeps its figures in docs/figures/gpu/
    "gpu_check": ["tools/gpu_check.py", "megatron_ext/runtime", "megatron_ext/models", "megatron_ext/helix",
                  "megatron_ext/hydro", "megatron_ext/ft", "megatron_ext/resihp/flops.py", "megatron_ext/data",
                  "megatron_ext/compat", "megatron_ext/config", "megatron_ext/pipeline", "deepspeed_patches",
                  "megatron_ext/engines.py", "pretrain_gpt.py", "megatron_ext/bench/harness.py"],
    "bench_timeline": ["tools/bench_timeline.py", "megatron_ext/pipeline", "megatron_ext/runtime",
                       "deepspeed_patches", "megatron_ext/resihp/injection.py", "megatron_ext/bench/harness.py"],
}

UNVERSIONED = "UNVERSIONED.md"
SUPERSEDED = "superseded"
"""A directory of that name (``docs/figures/<bench>/superseded/``) keeps the record of runs whose code
has since changed: every run stays on file, the misses included, and a doc that quotes one says it
is superseded. ``check_figures`` does not hold them to the current code."""
_LISTED = re.compile(r"^\s*[-*]\s+`([^`]+)`\s*[:\u2014-]\s*(\S.*)$")


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
    for line in open(path, encoding="utf-8"):
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


def check_figures(root: str, figures_dir: str = "docs/figures",
                  bench_files: Mapping[str, Sequence[str]] = BENCH_FILES) -> list[str]:
    """One message per problem with the figures under ``root/figures_dir`` (none: all current).

    A figure with provenance is stale when the last commit touching its benchmark's files is not an
    ancestor of (or equal to) the figure's commit. A figure without provenance must be listed in
    UNVERSIONED.md; a listed file that no longer exists is a problem too (the list stays true).
    Files under a ``superseded`` directory are the record of earlier runs and are not checked.
    """
    base = os.path.join(root, figures_dir)
    listed = unversioned(base)
    problems = []
    found = set()
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d != SUPERSEDED]
        for f in sorted(files):
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
            if bench not in bench_files:
                problems.append(f"{shown}: bench {bench!r} has no entry in megatron_ext/bench/figures.py "
                                f"BENCH_FILES (known: {', '.join(sorted(bench_files))})")
                continue
            paths = list(bench_files[bench])
            last = last_change(root, paths)
            if last is None:
                continue
            r = _git(root, "merge-base", "--is-ancestor", last, commit)
            if r.returncode == 1:
                problems.append(f"{shown}: {bench} figure measured on commit {commit[:12]}, but commit {last[:12]} "
                                f"changed its files since ({' '.join(paths)}); rerun tools/{bench}.py and record "
                                f"it again")
            elif r.returncode:
                problems.append(f"{shown}: {bench} figure's commit {commit[:12]} is not in this repository's "
                                f"history ({r.stderr.strip()})")
    for rel in sorted(set(listed) - found):
        problems.append(f"{figures_dir}/{UNVERSIONED} lists {rel}, which does not exist; remove the line")
    return problems

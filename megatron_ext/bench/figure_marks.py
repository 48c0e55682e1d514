"""The marks next to a doc's quotes of figures: where they go, and the check that they are true.

A doc quotes a figure by naming its path (``figures/bench_x/run.txt`` in a link, or
``docs/figures/bench_x/run.txt``). When the figure is stale, a mark of two generated lines follows
the paragraph (the list item, the table, the code block) that quotes it::

    <!-- stale-figure bench_x/run.txt 0123456789ab -->
    _Stale figure: `bench_x/run.txt` was measured on 0123456789ab; code on its path changed since (...). ..._

The comment is the sentinel a tool finds (the figure and the commit it was measured on), the line
under it what a reader sees. ``write_doc`` removes every stale mark and places the ones due, so it
adds, updates and removes marks, and a second run changes nothing. ``check_doc`` holds the sentinels
only: the list of commits in the visible line grows with every commit and cannot name the commit
that is being made, so it is refreshed by ``write_doc`` and not compared.

After ``make figures`` measures a figure again (``figure_reruns``), the doc's quotes of the old run
name it under ``superseded/`` and a rerun mark says which run replaced it, until a person updates the
text and deletes the mark::

    <!-- figure-rerun bench_x/superseded/run.txt bench_x/run_20261210.txt 0123456789ab -->
    _Rerun: `bench_x/run_20261210.txt` (measured on 0123456789ab) replaces `bench_x/superseded/run.txt`; ..._
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Collection, Mapping, Protocol, Sequence

STALE = re.compile(r"^(?P<indent>[ \t]*)<!-- stale-figure (?P<rel>\S+) (?P<commit>[0-9a-f]{12}) -->[ \t]*$")
STALE_LINE = re.compile(r"^[ \t]*_Stale figure: .*_[ \t]*$")
RERUN = re.compile(r"^[ \t]*<!-- figure-rerun (?P<old>\S+) (?P<new>\S+) (?P<commit>[0-9a-f]{12}) -->[ \t]*$")
RERUN_LINE = re.compile(r"^[ \t]*_Rerun: .*_[ \t]*$")
_LIST_ITEM = re.compile(r"^[ \t]*(?:[-*+]|\d+[.)])[ \t]+")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
MARKS_COMMAND = "make figures-marks"


class StaleFigure(Protocol):
    commit: str
    changed_since: Sequence[str]


def _quote_pattern(figures_dir: str) -> re.Pattern:
    """A path under the figures directory as docs write it: ``figures/...`` (a link from docs/) or
    ``docs/figures/...``, not inside a longer path."""
    base = re.escape(os.path.basename(figures_dir))
    parent = re.escape(os.path.dirname(figures_dir).replace(os.sep, "/"))
    prefix = f"(?:{parent}/)?" if parent else ""
    return re.compile(rf"(?<![\w./-]){prefix}{base}/(?P<rel>[\w./-]*[\w-])")


@dataclasses.dataclass(frozen=True)
class _Mark:
    after: int
    """The index, in the doc's lines without stale marks, of the line the mark follows."""
    rel: str
    commit: str
    line: int
    """1-based line of the sentinel in the doc as it is."""
    visible: bool


@dataclasses.dataclass
class _Doc:
    lines: list[str]
    """The doc's lines without its stale marks."""
    line_no: list[int]
    """For each of ``lines``, its 1-based number in the doc as it is."""
    marks: list[_Mark]


def _read(root: str, doc: str) -> str:
    with open(os.path.join(root, doc), encoding="utf-8") as fh:
        return fh.read()


def _split(text: str) -> _Doc:
    """The doc's lines with the stale marks taken out, and the marks (a mark shown inside a code
    block, as docs/benchmarks.md shows one, is text)."""
    raw = text.split("\n")
    fenced = _fences(raw)
    out = _Doc([], [], [])
    i = 0
    while i < len(raw):
        m = None if i in fenced else STALE.match(raw[i])
        if m:
            visible = i + 1 < len(raw) and bool(STALE_LINE.match(raw[i + 1]))
            out.marks.append(_Mark(len(out.lines) - 1, m["rel"], m["commit"], i + 1, visible))
            i += 2 if visible else 1
            continue
        out.lines.append(raw[i])
        out.line_no.append(i + 1)
        i += 1
    return out


def _fences(lines: Sequence[str]) -> dict[int, int]:
    """Line index -> the index of the closing fence, for every line of a fenced code block."""
    out: dict[int, int] = {}
    start = None
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            if start is None:
                start = i
            else:
                out.update((j, i) for j in range(start, i + 1))
                start = None
    if start is not None:                       # an unclosed fence runs to the end
        out.update((j, len(lines) - 1) for j in range(start, len(lines)))
    return out


def _starts_block(line: str) -> bool:
    s = line.lstrip()
    return bool(_LIST_ITEM.match(line)) or s.startswith(("#", "|", "<!--", "```", "~~~"))


def _block_end(lines: Sequence[str], fences: Mapping[int, int], i: int) -> int:
    """The last line of the block that holds line ``i``: its code block, its table, or its
    paragraph (which a list item, a heading, a table, a comment or a fence ends)."""
    if i in fences:
        return fences[i]
    j = i
    if lines[i].lstrip().startswith("|"):
        while j + 1 < len(lines) and lines[j + 1].lstrip().startswith("|"):
            j += 1
        return j
    while j + 1 < len(lines) and lines[j + 1].strip() and not _starts_block(lines[j + 1]) and j + 1 not in fences:
        j += 1
    return j


def _indent(lines: Sequence[str], fences: Mapping[int, int], i: int) -> str:
    """A mark's indentation after the block of line ``i``: inside a list item, its content's (the
    mark stays in the item); after a table or a code block, none."""
    line = lines[i]
    if i in fences or line.lstrip().startswith("|"):
        return ""
    m = _LIST_ITEM.match(line)
    return " " * len(m.group(0).expandtabs()) if m else line[:len(line) - len(line.lstrip())]


def quoted(line: str, figures_dir: str) -> list[str]:
    """The figure paths (relative to ``figures_dir``) that ``line`` names."""
    return [m["rel"] for m in _quote_pattern(figures_dir).finditer(line)]


def _due(doc: _Doc, figures_dir: str, stale: Collection[str]) -> dict[tuple[int, str], tuple[int, str]]:
    """(block end, figure) -> (the first quoting line, the mark's indentation), for every block
    that quotes a stale figure."""
    fences = _fences(doc.lines)
    due: dict[tuple[int, str], tuple[int, str]] = {}
    for i, line in enumerate(doc.lines):
        for rel in quoted(line, figures_dir):
            if rel in stale:
                due.setdefault((_block_end(doc.lines, fences, i), rel), (i, _indent(doc.lines, fences, i)))
    return due


def _since(fig: StaleFigure, shown: int = 3) -> str:
    commits = [c[:12] for c in fig.changed_since]
    return ", ".join(commits[:shown]) + (f" and {len(commits) - shown} more" if len(commits) > shown else "")


def stale_mark(indent: str, rel: str, fig: StaleFigure) -> list[str]:
    return [f"{indent}<!-- stale-figure {rel} {fig.commit[:12]} -->",
            f"{indent}_Stale figure: `{rel}` was measured on {fig.commit[:12]}; code on its path changed since "
            f"({_since(fig)}). `make figures` measures it again._"]


def rerun_mark(indent: str, old: str, new: str, commit: str) -> list[str]:
    return [f"{indent}<!-- figure-rerun {old} {new} {commit[:12]} -->",
            f"{indent}_Rerun: `{new}` (measured on {commit[:12]}) replaces `{old}`; the figures quoted above are "
            f"the earlier run's until this text quotes the new one (then delete this mark)._"]


def _with(lines: Sequence[str], after: Mapping[int, list[str]]) -> list[str]:
    out = list(after.get(-1, []))
    for i, line in enumerate(lines):
        out.append(line)
        out += after.get(i, [])
    return out


def _write_if_changed(root: str, doc: str, old: str, lines: Sequence[str]) -> bool:
    new = "\n".join(lines)
    if new == old:
        return False
    with open(os.path.join(root, doc), "w", encoding="utf-8") as fh:
        fh.write(new)
    return True


def marked_text(text: str, figures_dir: str, stale: Mapping[str, StaleFigure]) -> str:
    """``text`` with its stale marks replaced by the ones due (``stale``: figure path relative to
    ``figures_dir`` -> the figure). Several figures quoted in one block get a mark each, by path."""
    doc = _split(text)
    after: dict[int, list[str]] = {}
    for (end, rel), (_, indent) in sorted(_due(doc, figures_dir, stale).items()):
        after.setdefault(end, []).extend(stale_mark(indent, rel, stale[rel]))
    return "\n".join(_with(doc.lines, after))


def write_doc(root: str, doc: str, figures_dir: str, stale: Mapping[str, StaleFigure]) -> bool:
    """Rewrite the stale marks of ``doc`` (relative to ``root``); whether it changed."""
    text = _read(root, doc)
    return _write_if_changed(root, doc, text, marked_text(text, figures_dir, stale).split("\n"))


def quotes_in(root: str, doc: str, figures_dir: str,
              stale: Collection[str]) -> list[tuple[str, int, bool]]:
    """(figure, line, marked) for each block of ``doc`` that quotes a stale figure."""
    d = _split(_read(root, doc))
    have = {(m.after, m.rel) for m in d.marks}
    due = sorted(_due(d, figures_dir, stale).items())
    return [(rel, d.line_no[i], (end, rel) in have) for (end, rel), (i, _) in due]


def check_doc(root: str, doc: str, figures_dir: str, stale: Mapping[str, StaleFigure],
              kept: Collection[str]) -> list[str]:
    """One message per untrue or missing mark in ``doc``: a quote of a stale figure without its mark
    after the block, a mark that names another commit than the figure's, a mark where no block
    quotes its figure or for a figure that is current, a sentinel without its line; a quote of a
    path that does not exist; a rerun mark naming a file that does not exist or that the doc no
    longer quotes."""
    d = _split(_read(root, doc))
    problems = []
    for i, line in enumerate(d.lines):
        for rel in quoted(line, figures_dir):
            if not os.path.exists(os.path.join(root, figures_dir, rel)):
                problems.append(f"{doc}:{d.line_no[i]}: quotes {figures_dir}/{rel}, which does not exist")
    due = _due(d, figures_dir, stale)
    have: dict[tuple[int, str], _Mark] = {}
    for m in d.marks:
        if (m.after, m.rel) in have:
            problems.append(f"{doc}:{m.line}: a second stale mark for {m.rel} after the same block; "
                            f"run {MARKS_COMMAND}")
        have[(m.after, m.rel)] = m
    for (end, rel), (i, _) in sorted(due.items()):
        fig, m = stale[rel], have.get((end, rel))
        if m is None:
            problems.append(f"{doc}:{d.line_no[i]}: quotes {figures_dir}/{rel}, a stale figure (measured on "
                            f"{fig.commit[:12]}; {len(fig.changed_since)} commit(s) changed its bench's files since, "
                            f"the first {fig.changed_since[0][:12]}), without a stale mark after the block; run "
                            f"{MARKS_COMMAND}, or measure it again: make figures")
        elif m.commit != fig.commit[:12]:
            problems.append(f"{doc}:{m.line}: the stale mark of {rel} says measured on {m.commit}, but the figure "
                            f"was measured on {fig.commit[:12]}; run {MARKS_COMMAND}")
        elif not m.visible:
            problems.append(f"{doc}:{m.line}: the stale mark of {rel} has no line \"_Stale figure: ..._\" under "
                            f"its comment; run {MARKS_COMMAND}")
    for (end, rel), m in sorted(have.items()):
        if (end, rel) in due:
            continue
        why = ("no block before it quotes that figure" if rel in stale else
               "the figure is current (measured after the last change to its bench's files)" if rel in kept else
               "no kept figure has that path (superseded, or gone)")
        problems.append(f"{doc}:{m.line}: a stale mark for {rel}, but {why}; run {MARKS_COMMAND}")
    problems += _check_reruns(root, doc, figures_dir, d)
    return problems


def _check_reruns(root: str, doc: str, figures_dir: str, d: _Doc) -> list[str]:
    problems = []
    quotes = {rel for line in d.lines for rel in quoted(line, figures_dir)}
    fenced = _fences(d.lines)
    for i, line in enumerate(d.lines):
        m = None if i in fenced else RERUN.match(line)
        if not m:
            continue
        where = f"{doc}:{d.line_no[i]}: the rerun mark of {m['old']}"
        for rel in (m["old"], m["new"]):
            if not os.path.exists(os.path.join(root, figures_dir, rel)):
                problems.append(f"{where} names {figures_dir}/{rel}, which does not exist")
        if m["old"] not in quotes:
            problems.append(f"{where}: the doc no longer quotes it; delete the mark")
        if not (i + 1 < len(d.lines) and RERUN_LINE.match(d.lines[i + 1])):
            problems.append(f"{where} has no line \"_Rerun: ..._\" under its comment")
    return problems


def record_rerun(root: str, doc: str, figures_dir: str, moves: Mapping[str, tuple[str, str, str]]) -> bool:
    """After figures were measured again: ``moves`` maps a figure's old path (relative to
    ``figures_dir``) to (its path under ``superseded/``, the new run's path, the new run's commit).
    Each quote of an old path is rewritten to name its superseded copy (the link stays true), and a
    rerun mark follows each block that quotes it. The doc's stale marks are taken out: ``write_doc``
    places them again. Whether the doc changed."""
    text = _read(root, doc)
    d = _split(text)
    pattern = _quote_pattern(figures_dir)

    def rename(m: re.Match) -> str:
        moved = moves.get(m["rel"])
        return m.group(0) if moved is None else m.group(0)[:m.start("rel") - m.start()] + moved[0]

    lines = [pattern.sub(rename, line) for line in d.lines]
    superseded = {old: (new, commit) for old, new, commit in moves.values()}
    fences = _fences(lines)
    after: dict[int, list[str]] = {}
    seen = set()
    for i, line in enumerate(lines):
        for rel in quoted(line, figures_dir):
            end = _block_end(lines, fences, i)
            if rel in superseded and (end, rel) not in seen:
                seen.add((end, rel))
                after.setdefault(end, []).extend(rerun_mark(_indent(lines, fences, i), rel, *superseded[rel]))
    return _write_if_changed(root, doc, text, _with(lines, after))

#!/usr/bin/env python
"""The figures kept in docs/figures/: which are stale, the marks beside the docs' quotes of them,
and measuring them again (docs/benchmarks.md, "Figures kept in docs/figures").

    python tools/figures.py status          # make figures-status: the report; exit 1 on a problem
    python tools/figures.py marks           # make figures-marks: add, update, remove the stale marks
    python tools/figures.py rerun [--dry-run]   # make figures: rerun the stale benches, then the marks

A figure is stale when a commit after the one it was measured on changed a file its benchmark loads
(megatron_ext/bench/figures.py derives the files from the import graph). A stale figure is not a
problem; a doc quoting one without the generated mark next to the quote is, and so is a mark that
is no longer true. ``rerun`` measures each stale figure's recorded command again, one after another,
each in a clean clone of HEAD, and moves the old runs under ``superseded/``: an hour or more.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.bench.figure_reruns import format_plan, rerun, stale_plan  # noqa: E402
from megatron_ext.bench.figures import check_figures, has_history, status_report, write_marks  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="list stale figures and the docs quoting them; exit 1 on a problem")
    sub.add_parser("marks", help="write the stale marks into the docs, then check them")
    r = sub.add_parser("rerun", help="measure the stale figures again from clean clones of HEAD")
    r.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not has_history(args.root):
        print(f"{args.root} has no full git history (a tarball or a shallow clone): figure commits cannot be "
              f"ordered", file=sys.stderr)
        return 2
    if args.command == "status":
        report, problems = status_report(args.root)
        print(report)
        return 1 if problems else 0
    if args.command == "marks":
        for doc in write_marks(args.root):
            print(f"marks rewritten: {doc}")
        problems = check_figures(args.root)
        print("\n".join(problems) if problems else "every quote of a stale figure is marked")
        return 1 if problems else 0
    plan = stale_plan(args.root)
    print(format_plan(plan))
    if args.dry_run or not plan:
        return 0
    problems = rerun(args.root, plan)
    print("\n".join(problems) if problems else "every stale figure measured again")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

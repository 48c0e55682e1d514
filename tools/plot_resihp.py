"""Plot a ResiHP trace through an injected fault: observed vs expected iteration time, the shared
(common-mode) factor, and the slow rank's score before and after the normalisation.

    python tools/plot_resihp.py TRACE.jsonl[.gz] -o FIG.png [--rank R] [--title T] [--resihp-* flags]

The trace is replayed with the detector (``megatron_ext.resihp.replay``); detector settings are the
training flags. ``--rank`` defaults to the rank of the trace's first fault label (rank 0 without
one). Prints the verdicts, then where the figure went.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.config.base import add_flags, build  # noqa: E402
from megatron_ext.resihp.config import ResiHPConfig  # noqa: E402
from megatron_ext.resihp.replay import replay  # noqa: E402
from megatron_ext.resihp.trace import read_trace  # noqa: E402


def plot(records, result, rank: int, path: str, title: str, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = [r for r in result.reports if r.calibrated]
    its = np.array([r.iteration for r in reps])
    obs = np.array([r.observed_s for r in reps]) * 1e3
    exp = np.array([r.expected_s for r in reps]) * 1e3
    shared = np.array([r.common_factor if r.common_factor is not None else 1.0 for r in reps])
    rel = np.array([r.rank_scores for r in reps])
    raw = np.array([r.raw_scores for r in reps])
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True, height_ratios=[2, 1, 2])
    ax1.plot(its, obs, lw=1.2, color="C0", label="observed iteration time")
    ax1.plot(its, exp, lw=1.2, color="C1",
             label="expected: FLOPs / calibrated throughput, pipeline-simulated, x shared factor")
    ax1.plot(its, exp / shared, lw=0.8, ls="--", color="C1", alpha=0.6, label="expected without the shared factor")
    ax1.set_ylabel("ms")
    ax2.plot(its, shared, lw=1, color="C4", label="shared factor (median over ranks of observed / expected)")
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_ylabel("factor")
    others = [r for r in range(rel.shape[1]) if r != rank]
    for k, r in enumerate(others):
        ax3.plot(its, rel[:, r], lw=0.6, color="grey", alpha=0.5,
                 label="other ranks, relative score" if k == 0 else None)
    ax3.plot(its, raw[:, rank], lw=1, color="C3", ls="--", alpha=0.7,
             label=f"rank {rank}: observed / expected (own calibration)")
    ax3.plot(its, rel[:, rank], lw=1.6, color="C3",
             label=f"rank {rank}: relative score (after common-mode normalisation)")
    ax3.axhline(threshold, color="black", lw=0.8, ls="-.", label=f"threshold {threshold:g}")
    ax3.axhline(1.0, color="grey", lw=0.5)
    ax3.set_ylabel("score")
    ax3.set_xlabel("iteration")
    top = float(np.nanquantile(np.concatenate([rel.ravel(), raw[:, rank]]), 0.99))
    ax3.set_ylim(0, max(2.0, min(top * 1.1, 6.0)))
    onsets = sorted({(f.rank, f.since, f.factor) for r in records for f in r.faults if f.kind == "slow"})
    for r, since, factor in onsets:
        for a in (ax1, ax2, ax3):
            a.axvline(since, color="red", ls="--", lw=1)
        ax1.text(since, 0.03, f" fault: rank {r} x{factor:g}", transform=ax1.get_xaxis_transform(), color="red",
                 fontsize=8, va="bottom")
    for v in result.verdicts:
        if v.kind != "fail_slow":
            continue
        for a in (ax1, ax2, ax3):
            a.axvline(v.iteration, color="black", ls=":", lw=1)
        ax3.text(v.iteration, 0.03, f" verdict: rank {v.rank} x{v.factor:.2f}", transform=ax3.get_xaxis_transform(),
                 fontsize=8, va="bottom")
    ax1.set_title(title, fontsize=10)
    for a in (ax1, ax2, ax3):
        a.legend(loc="upper left", fontsize=7, framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("-o", "--out", required=True, help="PNG to write")
    parser.add_argument("--rank", type=int, default=None, help="rank whose score is drawn (default: the faulty one)")
    parser.add_argument("--title", default=None)
    add_flags(parser, ResiHPConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the verdicts are printed below, once
    cfg = build(ResiHPConfig, vars(args), where="command line")
    records = list(read_trace(args.trace))
    res = replay(records, cfg, "resihp", keep_reports=True)
    rank = args.rank
    if rank is None:
        rank = next((f.rank for r in records for f in r.faults), 0)
    for v in res.verdicts:
        print(v.describe())
    title = args.title or f"ResiHP replay of {os.path.basename(args.trace)}"
    plot(records, res, rank, args.out, title, cfg.resihp_threshold)
    print(f"plot written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

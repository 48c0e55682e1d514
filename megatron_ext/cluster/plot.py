"""JCT CDF plot: one curve per policy (matplotlib, headless)."""
from __future__ import annotations

import logging
import os
from typing import Mapping

import numpy as np

logger = logging.getLogger(__name__)


def plot_jct_cdf(series: Mapping[str, np.ndarray], path: str | os.PathLike, title: str = "") -> str:
    """Empirical CDF of job completion times (log x axis), one step curve per label."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI boxes; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, values in series.items():
        x = np.sort(np.asarray(values, dtype=float))
        if not len(x):
            continue
        y = np.arange(1, len(x) + 1) / len(x)
        ax.step(np.maximum(x, 1.0), y, where="post", label=f"{label} (mean {x.mean() / 3600:.1f} h)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Fixed metadata keeps the PNG byte-stable across runs (a committed figure should not churn).
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return os.fspath(path)


def plot_jct_cdf_panels(panels: Mapping[float, Mapping[str, np.ndarray]], path: str | os.PathLike,
                        title: str = "") -> str:
    """One CDF panel per load scale, one curve per policy, shared axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = list(panels)
    fig, axes = plt.subplots(1, len(scales), figsize=(4.8 * len(scales), 4.0), dpi=120, sharey=True,
                             squeeze=False)
    for ax, scale in zip(axes[0], scales):
        for label, values in panels[scale].items():
            x = np.sort(np.asarray(values, dtype=float))
            if not len(x):
                continue
            y = np.arange(1, len(x) + 1) / len(x)
            ax.step(np.maximum(x, 1.0), y, where="post", label=f"{label} ({x.mean() / 3600:.1f} h)")
        ax.set_xscale("log")
        ax.set_xlabel("job completion time (s)")
        ax.set_title(f"load scale {scale:g}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="lower right", fontsize=7, title="policy (mean JCT)", title_fontsize=7)
    axes[0][0].set_ylabel("fraction of jobs")
    axes[0][0].set_ylim(0, 1.0)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return os.fspath(path)

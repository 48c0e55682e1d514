"""Rotated rounds and paired per-round ratios: how two or more arms are measured side by side on a
machine whose load drifts. The benchmark harness (``megatron_ext/bench/harness.py``) builds its
interleaved arms and A/A floors on these; the training job's own measured selection
(``helix/selection.py``) decides with them. Pure Python and numpy: no torch.
"""
from __future__ import annotations

from typing import Sequence


def rotated_order(arms: Sequence[str], round_index: int) -> list[str]:
    """The arms in the order round ``round_index`` runs them: the list rotated left by the round's
    index. Over a multiple of ``len(arms)`` rounds every arm is first (and in every other position)
    equally often."""
    if not arms:
        raise ValueError("rotated_order: no arms")
    k = round_index % len(arms)
    return list(arms[k:]) + list(arms[:k])


def ratio_interval(num: Sequence[float], den: Sequence[float], *, level: float = 0.9, n_boot: int = 2000,
                   seed: int = 0) -> dict:
    """Paired per-round ratios ``num[i] / den[i]``, their median and a percentile bootstrap interval
    of that median at ``level`` (resampling rounds with replacement; the same seed, the same interval).

    Paired because both samples of a round saw the same machine: the ratio cancels what the round
    shared. With one round the interval is that round's ratio alone -- nothing to resample.
    """
    import numpy as np

    if len(num) != len(den) or not len(num):
        raise ValueError(f"ratio_interval: need paired samples, got {len(num)} and {len(den)}")
    if not 0 < level < 1:
        raise ValueError(f"ratio_interval: level must be in (0, 1), got {level}")
    ratios = np.asarray(num, dtype=float) / np.asarray(den, dtype=float)
    median = float(np.median(ratios))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(ratios), size=(n_boot, len(ratios)))
    boot = np.median(ratios[idx], axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(boot, [tail, 100 - tail])
    # The percentile of an even-sized resample's medians can sit a hair outside [min, max] of the
    # ratios only through rounding; clamp so the interval always contains the median it is about.
    return {"ratios": [float(x) for x in ratios], "median": median, "level": level,
            "interval": [min(float(low), median), max(float(high), median)]}

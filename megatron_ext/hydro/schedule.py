"""Per-trial learning-rate schedules (a multiplier of the trial's base LR, by step)."""
from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(kw_only=True, frozen=True)
class LRSchedule:
    """``factor(k)`` multiplies the base LR at step k (0-based; the k-th ``optimizer.step``).

    Linear warmup over ``warmup_steps`` steps (``(k+1)/warmup``), then ``constant``, ``cosine`` or
    ``linear`` decay to ``min_ratio`` at ``total_steps``. Used as ``LambdaLR(opt, sched.factor)``
    for a trial run alone, which is what the parity tests compare against.
    """
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("warmup_steps and total_steps must be >= 0")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio}")

    def factor(self, k: int) -> float:
        if k < self.warmup_steps:
            return (k + 1) / self.warmup_steps
        if self.kind == "constant" or self.total_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (k - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.kind == "cosine":
            return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - self.min_ratio) * progress

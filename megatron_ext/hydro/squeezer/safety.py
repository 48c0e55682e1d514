"""Is the main job slower with guests? Interleaved guest-off control iterations tell.

Pure. Every ``control_every``-th iteration runs with every guest parked; the others with guests.
After each block of ``block`` iterations the monitor compares the two samples of iteration times
of that block: the slowdown is ``median(on) / median(off) - 1``, and it counts only when a
one-sided Mann-Whitney test says the on-iterations are slower (a shared host's noise is larger
than the 1 % a squeezer may cost). Blocks do not overlap, so one noisy stretch is tested once.

The policy escalates: each significant slowdown above ``max_slowdown`` backs off one level
(larger safety margin before a window's forecast end, fewer fused trials); past the last level
guests stop for the rest of the run.
"""
from __future__ import annotations

import dataclasses
import math
import statistics


def mann_whitney_greater(a: list[float], b: list[float]) -> float:
    """One-sided p-value that values of ``a`` tend to exceed those of ``b`` (normal approximation
    with the tie correction; fine from about 5 values per side)."""
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = r
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    r1 = sum(r for r, (_, side) in zip(ranks, pooled) if side == 0)
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var)   # continuity correction
    return 0.5 * math.erfc(z / math.sqrt(2))


@dataclasses.dataclass(frozen=True)
class BlockResult:
    iterations: tuple[int, int]       # first and last iteration of the block
    slowdown: float
    p_value: float
    on: int
    off: int
    action: str                        # "keep", "back off" or "stop"
    level: int                         # back-off level after the action


class SlowdownMonitor:
    def __init__(self, max_slowdown: float = 0.01, control_every: int = 4, block: int = 40,
                 alpha: float = 0.05, levels: int = 2) -> None:
        if control_every < 2:
            raise ValueError(f"control_every must be >= 2 (every iteration a control leaves no guest time), "
                             f"got {control_every}")
        if block < 2 * control_every:
            raise ValueError(f"block ({block}) must hold at least two control iterations (control_every "
                             f"{control_every})")
        self.max_slowdown, self.control_every, self.block = max_slowdown, control_every, block
        self.alpha, self.levels = alpha, levels
        self.level = 0
        self.stopped = False
        self.results: list[BlockResult] = []
        self._on: list[float] = []
        self._off: list[float] = []
        self._first: int | None = None

    def is_control(self, iteration: int) -> bool:
        return iteration % self.control_every == 0

    def observe(self, iteration: int, iter_time_s: float) -> BlockResult | None:
        """Add one iteration; at the end of a block, its verdict (else None)."""
        if self.stopped:
            return None
        if self._first is None:
            self._first = iteration
        (self._off if self.is_control(iteration) else self._on).append(iter_time_s)
        if iteration - self._first + 1 < self.block:
            return None
        return self._judge(iteration)

    def _judge(self, last: int) -> BlockResult:
        on, off = self._on, self._off
        slowdown = statistics.median(on) / statistics.median(off) - 1.0 if on and off else 0.0
        p = mann_whitney_greater(on, off)
        action = "keep"
        if slowdown > self.max_slowdown and p < self.alpha:
            if self.level >= self.levels:
                action, self.stopped = "stop", True
            else:
                action = "back off"
                self.level += 1
        res = BlockResult((self._first, last), slowdown, p, len(on), len(off), action, self.level)
        self.results.append(res)
        self._on, self._off, self._first = [], [], None
        return res

    def force(self, action: str) -> None:
        """Apply an action decided elsewhere (all ranks act on the most severe rank's verdict)."""
        if action == "stop":
            self.stopped = True
        elif action == "back off" and self.level < self.levels:
            self.level += 1


# What each back-off level means: (share of the forecast kept back, fusion limit as a share of
# the guest's own fusion count).
LEVELS = ((0.0, 1.0), (0.25, 0.5), (0.5, 0.0))   # level 2: one trial


def level_settings(level: int) -> tuple[float, float]:
    return LEVELS[min(level, len(LEVELS) - 1)]

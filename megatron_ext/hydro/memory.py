"""How many trials fit: a bundle's memory as a function of its fusion count, and the budget.

The default memory model is measured, not guessed: two probe bundles (B = 1 and B = 2) take one
training step each, and their footprints (parameters, gradients, optimizer state, activations
saved for backward) give ``bytes(B) = shared + B * per_trial``. Any other model can be injected
as a callable ``B -> bytes``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import torch

logger = logging.getLogger(__name__)

MemoryModel = Callable[[int], int]


@dataclasses.dataclass(frozen=True)
class LinearMemoryModel:
    shared_bytes: int
    per_trial_bytes: int

    def __call__(self, num_trials: int) -> int:
        return self.shared_bytes + num_trials * self.per_trial_bytes


def probe_memory_model(make_bundle: Callable[[int], object], batch: tuple[torch.Tensor, torch.Tensor]
                       ) -> LinearMemoryModel:
    """Fit ``shared + B * per_trial`` from bundles of 1 and 2 trials (one step each)."""
    totals = []
    for b in (1, 2):
        bundle = make_bundle(b)
        bundle.train_step(*batch)
        totals.append(bundle.memory_footprint()["total_bytes"])
    per = max(1, totals[1] - totals[0])
    return LinearMemoryModel(max(0, totals[0] - per), per)


def available_bytes(device: torch.device, budget_mb: float = 0.0) -> int:
    """The budget: ``budget_mb`` if set, else free device memory (CUDA) or half of MemAvailable (CPU,
    where the bundle shares RAM with everything else on the host)."""
    if budget_mb > 0:
        return int(budget_mb * 2 ** 20)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // 2)


def fusion_count(model: MemoryModel, budget_bytes: int, max_fusion: int) -> int:
    """The largest B <= max_fusion with ``model(B) <= budget``; an error if not even one fits."""
    if model(1) > budget_bytes:
        raise MemoryError(f"one trial needs {model(1) / 2**20:.1f} MiB but the budget is "
                          f"{budget_bytes / 2**20:.1f} MiB: raise memory_budget_mb or shrink more")
    b = 1
    while b < max_fusion and model(b + 1) <= budget_bytes:
        b += 1
    return b

"""Fused Dropout with a per-trial drop probability (dropout is a tunable hyperparameter)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import FusedModule, per_trial, trial_view


class FusedDropout(FusedModule):
    """``p`` is a ``[B]`` buffer so it is resized with the other per-trial state. Masks are drawn
    from the global generator: fused trials cannot reproduce the masks of trials run alone, so
    parity tests use p = 0 (as any exactness test of dropout would)."""

    plain_types = (nn.Dropout,)

    def __init__(self, num_trials: int, p: float = 0.0, device=None) -> None:
        super().__init__()
        # Not persistent: plain nn.Dropout keeps p as an attribute, not state; stacking skips it.
        self.register_buffer("p", torch.full((num_trials,), float(p), device=device), persistent=False)
        self._any_p = p > 0   # a python flag: checking the buffer would cost a sync per forward

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Dropout]) -> "FusedDropout":
        fused = cls(len(plains), 0.0)
        fused.set_p([m.p for m in plains])
        return fused

    def set_p(self, values: Sequence[float]) -> None:
        """Set every trial's probability (after ``resize_trials``, pass the full new vector)."""
        values = [float(v) for v in values]
        self.p = torch.tensor(values, dtype=self.p.dtype, device=self.p.device)
        self._any_p = any(v > 0 for v in values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self._any_p:
            return x
        B = self.p.shape[0]
        xb = trial_view(x, B)
        keep = (1.0 - self.p).to(x.dtype)
        keep_b = per_trial(keep, xb.dim())
        mask = torch.rand_like(xb) < keep_b
        # A trial with p = 1 drops everything; avoid 0/0.
        scale = torch.where(keep_b > 0, 1.0 / keep_b.clamp_min(1e-12), torch.zeros_like(keep_b))
        return (xb * mask * scale).reshape(x.shape)

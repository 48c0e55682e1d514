"""Per-trial losses: each trial's loss is the mean over its own rows only, so trials never mix."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import trial_view


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, num_trials: int) -> torch.Tensor:
    """Cross-entropy per trial, ``[B]``.

    ``logits``: ``[B*N, ..., C]`` (class last, as a GPT emits) ; ``target``: ``[B*N, ...]`` or the
    shared ``[N, ...]`` every trial was fed. Summing the result and calling backward gives each
    trial exactly the gradient of its own mean loss, because the trials share no parameters.
    """
    B = num_trials
    C = logits.shape[-1]
    if target.shape[0] * B == logits.shape[0]:
        target = target.repeat(B, *([1] * (target.dim() - 1)))
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}")
    per_row = F.cross_entropy(logits.reshape(-1, C), target.reshape(-1), reduction="none")
    return trial_view(per_row, B).mean(dim=1)


def fused_mse(pred: torch.Tensor, target: torch.Tensor, num_trials: int) -> torch.Tensor:
    """Mean squared error per trial, ``[B]``."""
    B = num_trials
    if target.shape[0] * B == pred.shape[0]:
        target = target.repeat(B, *([1] * (target.dim() - 1)))
    return trial_view((pred - target).pow(2).reshape(pred.shape[0], -1), B).mean(dim=(1, 2))

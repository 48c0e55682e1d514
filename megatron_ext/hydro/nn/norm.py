"""Fused LayerNorm, RMSNorm and BatchNorm (per-trial affine parameters and running statistics)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import FusedModule, check_same_config, load_stacked, trial_view


class FusedLayerNorm(FusedModule):
    """B LayerNorms over the last dimension: normalize once, then a per-trial affine."""

    plain_types = (nn.LayerNorm,)

    def __init__(self, num_trials: int, dim: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(num_trials, dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_trials, dim, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_plain(cls, plains: Sequence[nn.LayerNorm]) -> "FusedLayerNorm":
        check_same_config(plains, ("normalized_shape", "eps", "elementwise_affine"))
        p0 = plains[0]
        if len(p0.normalized_shape) != 1 or not p0.elementwise_affine:
            raise ValueError("only LayerNorm over the last dim with elementwise_affine=True is fused")
        fused = cls(len(plains), p0.normalized_shape[0], p0.eps, p0.bias is not None,
                    device=p0.weight.device, dtype=p0.weight.dtype)
        return load_stacked(fused, plains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = self.weight.shape[0]
        y = trial_view(F.layer_norm(x, (self.dim,), eps=self.eps).reshape(-1, self.dim), B)
        y = y * self.weight.unsqueeze(1)
        if self.bias is not None:
            y = y + self.bias.unsqueeze(1)
        return y.reshape(x.shape)


class FusedRMSNorm(FusedModule):
    """B RMSNorms over the last dimension."""

    plain_types = (nn.RMSNorm,)

    def __init__(self, num_trials: int, dim: int, eps: float | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(num_trials, dim, device=device, dtype=dtype))

    @classmethod
    def from_plain(cls, plains: Sequence[nn.RMSNorm]) -> "FusedRMSNorm":
        check_same_config(plains, ("normalized_shape", "eps", "elementwise_affine"))
        p0 = plains[0]
        if len(p0.normalized_shape) != 1 or not p0.elementwise_affine:
            raise ValueError("only RMSNorm over the last dim with elementwise_affine=True is fused")
        fused = cls(len(plains), p0.normalized_shape[0], p0.eps, device=p0.weight.device, dtype=p0.weight.dtype)
        return load_stacked(fused, plains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = self.weight.shape[0]
        y = trial_view(F.rms_norm(x, (self.dim,), eps=self.eps).reshape(-1, self.dim), B)
        return (y * self.weight.unsqueeze(1)).reshape(x.shape)


class FusedBatchNorm(FusedModule):
    """B BatchNorm1d/2d layers. Statistics are per trial: the fused batch ``[B*N, C, ...]`` is laid out
    as ``[N, B*C, ...]`` so one ``F.batch_norm`` call normalizes each (trial, channel) pair over that
    trial's N samples only, and updates the ``[B, C]`` running buffers through a flat view."""

    plain_types = (nn.BatchNorm1d, nn.BatchNorm2d)

    def __init__(self, num_trials: int, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_trials, num_features, **kw))
        self.bias = nn.Parameter(torch.zeros(num_trials, num_features, **kw))
        self.register_buffer("running_mean", torch.zeros(num_trials, num_features, **kw))
        self.register_buffer("running_var", torch.ones(num_trials, num_features, **kw))
        self.register_buffer("num_batches_tracked", torch.zeros(num_trials, dtype=torch.long, device=device))

    @classmethod
    def from_plain(cls, plains: Sequence[nn.modules.batchnorm._BatchNorm]) -> "FusedBatchNorm":
        check_same_config(plains, ("num_features", "eps", "momentum", "affine", "track_running_stats"))
        p0 = plains[0]
        if not p0.affine or not p0.track_running_stats or p0.momentum is None:
            raise ValueError("only BatchNorm with affine=True, track_running_stats=True and a float momentum is fused")
        fused = cls(len(plains), p0.num_features, p0.eps, p0.momentum, device=p0.weight.device, dtype=p0.weight.dtype)
        return load_stacked(fused, plains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C = self.weight.shape
        xb = trial_view(x, B)                                   # [B, N, C, *S]
        N, spatial = xb.shape[1], xb.shape[3:]
        xc = xb.transpose(0, 1).reshape(N, B * C, *spatial)     # [N, B*C, *S]
        if self.training:
            self.num_batches_tracked.add_(1)
        y = F.batch_norm(xc, self.running_mean.view(-1), self.running_var.view(-1),
                         self.weight.reshape(-1), self.bias.reshape(-1), self.training, self.momentum, self.eps)
        return y.reshape(N, B, C, *spatial).transpose(0, 1).reshape(x.shape)

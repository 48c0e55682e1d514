"""Fused Conv2d: B convolutions as one grouped convolution."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import FusedModule, check_same_config, load_stacked, trial_view


class FusedConv2d(FusedModule):
    """B ``nn.Conv2d`` with weight ``[B, out, in/groups, kh, kw]``.

    The fused batch ``[B*N, C, H, W]`` is regrouped to ``[N, B*C, H, W]``; a convolution with
    ``groups = B * groups`` then applies trial b's filters only to trial b's channels. The regrouping
    costs two copies per layer; what we buy is one kernel launch instead of B.
    """

    plain_types = (nn.Conv2d,)
    _attrs = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "padding_mode")

    def __init__(self, num_trials: int, in_channels: int, out_channels: int, kernel_size: tuple[int, int],
                 stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups: int = 1, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, tuple(kernel_size)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.weight = nn.Parameter(torch.empty(num_trials, out_channels, in_channels // groups, *self.kernel_size, **kw))
        self.bias = nn.Parameter(torch.zeros(num_trials, out_channels, **kw)) if bias else None
        for b in range(num_trials):
            nn.init.kaiming_uniform_(self.weight.data[b], a=5 ** 0.5)

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Conv2d]) -> "FusedConv2d":
        check_same_config(plains, cls._attrs)
        p0 = plains[0]
        if p0.padding_mode != "zeros" or isinstance(p0.padding, str):
            raise ValueError("only zero padding given as numbers is fused (padding_mode='zeros', no 'same'/'valid')")
        fused = cls(len(plains), p0.in_channels, p0.out_channels, p0.kernel_size, p0.stride, p0.padding,
                    p0.dilation, p0.groups, p0.bias is not None, device=p0.weight.device, dtype=p0.weight.dtype)
        return load_stacked(fused, plains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = self.weight.shape[0]
        xb = trial_view(x, B)                                           # [B, N, C, H, W]
        N = xb.shape[1]
        xc = xb.transpose(0, 1).reshape(N, B * self.in_channels, *x.shape[2:])
        w = self.weight.reshape(B * self.out_channels, *self.weight.shape[2:])
        bias = self.bias.reshape(-1) if self.bias is not None else None
        y = F.conv2d(xc, w, bias, self.stride, self.padding, self.dilation, B * self.groups)
        return y.reshape(N, B, self.out_channels, *y.shape[2:]).transpose(0, 1).reshape(B * N, self.out_channels, *y.shape[2:])

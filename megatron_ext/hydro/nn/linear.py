"""Fused Linear and Embedding: one batched matmul / one gather for B trials."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import FusedModule, check_same_config, load_stacked, trial_view


class FusedLinear(FusedModule):
    """B ``nn.Linear`` layers. ``weight`` is ``[B, out, in]`` (nn.Linear orientation, stacked).

    ``input_mult`` scales the input: muP's readout multiplier (``output_mult / width_mult``) lands
    here so that a ``mup.MuReadout`` fuses to an ordinary FusedLinear.
    """

    plain_types = (nn.Linear,)

    def __init__(self, num_trials: int, in_features: int, out_features: int, bias: bool = True,
                 input_mult: float = 1.0, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.input_mult = in_features, out_features, input_mult
        self.weight = nn.Parameter(torch.empty(num_trials, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_trials, out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same distribution as nn.Linear, drawn per trial.
        for b in range(self.weight.shape[0]):
            nn.init.kaiming_uniform_(self.weight[b], a=5 ** 0.5)
            if self.bias is not None:
                bound = 1 / self.in_features ** 0.5 if self.in_features > 0 else 0
                nn.init.uniform_(self.bias[b], -bound, bound)

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Linear]) -> "FusedLinear":
        check_same_config(plains, ("in_features", "out_features"))
        p0 = plains[0]
        mult = 1.0
        if hasattr(p0, "output_mult") and hasattr(p0, "width_mult"):  # mup.MuReadout
            if not hasattr(p0.weight, "infshape"):
                raise ValueError("mup.MuReadout without base shapes: call hydro.parametrization.apply_mup "
                                 "(or mup.set_base_shapes) on each trial's model before fusing")
            mult = float(p0.output_mult) / float(p0.width_mult())
        fused = cls(len(plains), p0.in_features, p0.out_features, p0.bias is not None, input_mult=mult,
                    device=p0.weight.device, dtype=p0.weight.dtype)
        return load_stacked(fused, plains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = self.weight.shape[0]
        lead = x.shape[:-1]
        xb = trial_view(x.reshape(-1, x.shape[-1]), B)          # [B, M, in]
        if self.input_mult != 1.0:
            xb = xb * self.input_mult
        wt = self.weight.transpose(1, 2)                        # [B, in, out]
        if self.bias is not None:
            out = torch.baddbmm(self.bias.unsqueeze(1), xb, wt)
        else:
            out = torch.bmm(xb, wt)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"trials={self.weight.shape[0]}, in={self.in_features}, out={self.out_features}, "
                f"bias={self.bias is not None}" + (f", input_mult={self.input_mult:g}" if self.input_mult != 1 else ""))


class FusedEmbedding(FusedModule):
    """B ``nn.Embedding`` tables, ``weight`` ``[B, V, d]``; looked up with one gather by offsetting
    trial b's ids by ``b * V`` into the flattened table."""

    plain_types = (nn.Embedding,)

    def __init__(self, num_trials: int, num_embeddings: int, embedding_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_trials, num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight)

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Embedding]) -> "FusedEmbedding":
        check_same_config(plains, ("num_embeddings", "embedding_dim"))
        for i, p in enumerate(plains):
            if p.padding_idx is not None or p.max_norm is not None or p.sparse:
                raise ValueError(f"trial {i}: Embedding with padding_idx/max_norm/sparse is not supported fused")
        p0 = plains[0]
        fused = cls(len(plains), p0.num_embeddings, p0.embedding_dim, device=p0.weight.device, dtype=p0.weight.dtype)
        return load_stacked(fused, plains)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, V, d = self.weight.shape
        idb = trial_view(ids, B)
        offs = torch.arange(B, device=ids.device).reshape(B, *([1] * (idb.dim() - 1))) * V
        out = F.embedding((idb + offs).reshape(ids.shape), self.weight.reshape(B * V, d))
        return out

    def extra_repr(self) -> str:
        return f"trials={self.weight.shape[0]}, {self.num_embeddings}, {self.embedding_dim}"

"""Shared conventions of the fused (``hydro.nn``) modules.

A fused module holds B independent trials. Two invariants make everything else generic:

* **Layout.** Activations are *trial-major in the batch dimension*: a fused tensor has shape
  ``[B * N, ...]`` where rows ``b*N:(b+1)*N`` belong to trial ``b``. Every op that treats samples
  independently (elementwise ops, softmax over features, per-sample reshapes written with
  ``x.size(0)``) is then already correct for B trials; only modules that own parameters, or that
  mix samples (BatchNorm, losses), need a fused version.
* **State.** Every parameter and buffer of a fused module has the trial on dim 0, and its slice
  ``[b]`` equals the corresponding tensor of the plain module of trial ``b`` (same name). Fusing is
  stacking, unfusing is indexing, and dropping or adding trials is slicing or concatenating along
  dim 0 (``resize_trials``), so optimizer state and module state follow the same rule.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)


class FusedModule(nn.Module):
    """Base class: B trials in one module. Subclasses implement ``from_plain`` for their plain twin."""

    #: plain module types this fused class replaces (filled by subclasses; used by ``fuse_model``)
    plain_types: tuple[type, ...] = ()

    @property
    def num_trials(self) -> int:
        for t in self.parameters(recurse=True):
            return t.shape[0]
        for t in self.buffers(recurse=True):
            return t.shape[0]
        raise RuntimeError(f"{type(self).__name__} has no per-trial state to count trials from")

    @classmethod
    def from_plain(cls, plains: Sequence[nn.Module]) -> "FusedModule":
        raise NotImplementedError

    def extra_repr(self) -> str:
        try:
            return f"trials={self.num_trials}"
        except RuntimeError:
            return ""


def check_same_config(plains: Sequence[nn.Module], attrs: Sequence[str]) -> None:
    """Trials fused into one module must agree on every shape-defining attribute."""
    if not plains:
        raise ValueError("cannot fuse zero trials")
    first = plains[0]
    for i, m in enumerate(plains[1:], start=1):
        if type(m) is not type(first):
            raise ValueError(f"trial {i} is a {type(m).__name__}, trial 0 a {type(first).__name__}")
        for a in attrs:
            if getattr(m, a) != getattr(first, a):
                raise ValueError(f"trial {i} has {a}={getattr(m, a)!r}, trial 0 has {getattr(first, a)!r}: "
                                 "fused trials must share shapes")


def load_stacked(fused: nn.Module, plains: Sequence[nn.Module]) -> nn.Module:
    """Copy ``stack([p.state_dict()[k] for p in plains])`` into ``fused`` for every key."""
    states = [p.state_dict() for p in plains]
    target = fused.state_dict()
    missing = sorted(set(target) - set(states[0]))
    if missing:
        raise ValueError(f"{type(fused).__name__}: plain module lacks {missing}")
    with torch.no_grad():
        for k, t in target.items():
            t.copy_(torch.stack([s[k].to(t.dtype) for s in states]))
    return fused


def unfuse_state(fused: nn.Module, b: int) -> dict[str, torch.Tensor]:
    """The plain state dict of trial ``b`` (clones, so later fused updates do not leak)."""
    return {k: v[b].clone() for k, v in fused.state_dict().items()}


def resize_trials(module: nn.Module, keep: Sequence[int],
                  new_states: Sequence[dict[str, torch.Tensor]] = ()) -> None:
    """Keep trials ``keep`` (in that order) and append one trial per entry of ``new_states``.

    Tensors are replaced through ``.data`` so that ``nn.Parameter`` objects keep their identity:
    optimizers and hooks that hold them stay valid. Gradients are dropped (they are per step).
    """
    keep_idx = None
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if keep_idx is None or keep_idx.device != t.device:
            keep_idx = torch.as_tensor(list(keep), dtype=torch.long, device=t.device)
        kept = t.data.index_select(0, keep_idx)
        if new_states:
            extra = torch.stack([s[name].to(device=t.device, dtype=t.dtype) for s in new_states])
            kept = torch.cat([kept, extra], dim=0)
        t.data = kept.contiguous()
        if isinstance(t, nn.Parameter):
            t.grad = None


def trial_view(x: torch.Tensor, num_trials: int) -> torch.Tensor:
    """``[B*N, ...] -> [B, N, ...]`` with a clear error when the batch does not split evenly."""
    if x.shape[0] % num_trials:
        raise ValueError(f"fused batch of {x.shape[0]} rows does not split into {num_trials} trials")
    return x.reshape(num_trials, x.shape[0] // num_trials, *x.shape[1:])


def expand_trials(x: torch.Tensor, num_trials: int) -> torch.Tensor:
    """Give every trial the same input batch: ``[N, ...] -> [B*N, ...]``."""
    return x.unsqueeze(0).expand(num_trials, *x.shape).reshape(num_trials * x.shape[0], *x.shape[1:])


def per_trial(values: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[B] -> [B, 1, ..., 1]`` broadcastable against a tensor of ``ndim`` dims."""
    return values.reshape(values.shape[0], *([1] * (ndim - 1)))


CheckpointFn = Callable[[str], None]

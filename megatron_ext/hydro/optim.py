"""Fused Adam, AdamW and SGD: one update for B trials, each with its own hyperparameters.

The math mirrors ``torch.optim.Adam/AdamW/SGD`` (single-tensor path) term by term, with every
scalar hyperparameter turned into a ``[B, 1, ...]`` tensor. Each trial also has its own step
count, so Adam's bias correction and the LR schedule stay right for a trial that joined the bundle
later than the others (slot refill). Per-parameter multipliers (``lr_mult``, ``wd_mult``) carry
muP's width scaling; they are shared by the trials, which all have the same width.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

import torch
from torch import nn

from .nn.base import per_trial
from .schedule import LRSchedule

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclasses.dataclass(kw_only=True)
class TrialHParams:
    """One trial's optimizer hyperparameters (the searchable ones; batch size is per bundle)."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    grad_clip: float = 0.0          # max global grad norm of the trial; 0 = off
    schedule: LRSchedule = dataclasses.field(default_factory=LRSchedule)

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        for name in ("beta1", "beta2", "momentum", "dampening"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0 + (name == "dampening"):
                raise ValueError(f"{name} must be in [0, 1), got {v}")


@dataclasses.dataclass
class ParamSlot:
    """A fused parameter (trial on dim 0) with muP multipliers and its optimizer state."""
    param: nn.Parameter
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class FusedOptimizer:
    """Adam / AdamW / SGD over fused parameters with per-trial hyperparameters and schedules."""

    def __init__(self, params: Iterable[nn.Parameter | tuple[nn.Parameter, float, float]], kind: str,
                 hparams: Sequence[TrialHParams], nesterov: bool = False) -> None:
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
        self.kind, self.nesterov = kind, nesterov
        self.hparams: list[TrialHParams] = list(hparams)
        self.steps: list[int] = [0] * len(self.hparams)
        self.slots: list[ParamSlot] = []
        for p in params:
            slot = ParamSlot(*p) if isinstance(p, tuple) else ParamSlot(p)
            if slot.param.shape[0] != len(self.hparams):
                raise ValueError(f"parameter of shape {tuple(slot.param.shape)} has {slot.param.shape[0]} "
                                 f"trials, but {len(self.hparams)} hyperparameter sets were given")
            self.slots.append(slot)

    @property
    def num_trials(self) -> int:
        return len(self.hparams)

    def current_lrs(self) -> list[float]:
        """Each trial's LR for its next step (base LR x schedule factor)."""
        return [h.lr * h.schedule.factor(k) for h, k in zip(self.hparams, self.steps)]

    def zero_grad(self) -> None:
        for s in self.slots:
            s.param.grad = None

    def _vec(self, values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        # float64 first: the per-trial scalars are python floats in torch's own optimizers.
        return torch.tensor(values, dtype=torch.float64, device=like.device)

    def _clip_coefs(self) -> torch.Tensor | None:
        clips = [h.grad_clip for h in self.hparams]
        if not any(c > 0 for c in clips):
            return None
        dev = self.slots[0].param.device
        sq = torch.zeros(self.num_trials, dtype=torch.float64, device=dev)
        for s in self.slots:
            if s.param.grad is not None:
                sq += s.param.grad.detach().reshape(self.num_trials, -1).double().pow(2).sum(dim=1)
        norm = sq.sqrt()
        clip = self._vec(clips, norm)
        # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
        coef = (clip / (norm + 1e-6)).clamp(max=1.0)
        return torch.where(clip > 0, coef, torch.ones_like(coef))

    @torch.no_grad()
    def step(self) -> None:
        if not self.slots:
            return
        coefs = self._clip_coefs()
        lrs = self.current_lrs()
        for k in range(self.num_trials):
            self.steps[k] += 1
        for s in self.slots:
            g = s.param.grad
            if g is None:
                continue
            if coefs is not None:
                g = g * per_trial(coefs.to(g.dtype), g.dim())
            if self.kind == "sgd":
                self._sgd(s, g, lrs)
            else:
                self._adam(s, g, lrs)

    def _adam(self, s: ParamSlot, g: torch.Tensor, lrs: list[float]) -> None:
        p, nd, dt = s.param, s.param.dim(), s.param.dtype
        hp = self.hparams
        if not s.state:
            s.state["exp_avg"] = torch.zeros_like(p)
            s.state["exp_avg_sq"] = torch.zeros_like(p)
        lr = self._vec(lrs, p) * s.lr_mult
        wd = self._vec([h.weight_decay for h in hp], p) * s.wd_mult
        b1 = self._vec([h.beta1 for h in hp], p)
        b2 = self._vec([h.beta2 for h in hp], p)
        eps = self._vec([h.eps for h in hp], p)
        step = self._vec(self.steps, p)
        if self.kind == "adamw":
            p.mul_(per_trial((1 - lr * wd).to(dt), nd))
        elif bool((wd != 0).any()):
            g = g + p * per_trial(wd.to(dt), nd)
        m, v = s.state["exp_avg"], s.state["exp_avg_sq"]
        m.lerp_(g, per_trial((1 - b1).to(dt), nd))
        v.mul_(per_trial(b2.to(dt), nd)).addcmul_(g, g * per_trial((1 - b2).to(dt), nd))
        bc1 = 1 - b1 ** step
        bc2_sqrt = (1 - b2 ** step).sqrt()
        step_size = lr / bc1
        denom = (v.sqrt() / per_trial(bc2_sqrt.to(dt), nd)).add_(per_trial(eps.to(dt), nd))
        p.sub_(per_trial(step_size.to(dt), nd) * m / denom)

    def _sgd(self, s: ParamSlot, g: torch.Tensor, lrs: list[float]) -> None:
        p, nd, dt = s.param, s.param.dim(), s.param.dtype
        hp = self.hparams
        lr = self._vec(lrs, p) * s.lr_mult
        wd = self._vec([h.weight_decay for h in hp], p) * s.wd_mult
        if bool((wd != 0).any()):
            g = g + p * per_trial(wd.to(dt), nd)
        mom = self._vec([h.momentum for h in hp], p)
        if bool((mom != 0).any()):
            damp = self._vec([h.dampening for h in hp], p)
            first = per_trial(self._vec([k == 1 for k in self.steps], p) > 0, nd)
            buf = s.state.get("momentum_buffer")
            if buf is None:
                buf = g.clone()
            else:
                # torch starts the buffer at the first gradient (no dampening on step 1).
                upd = buf * per_trial(mom.to(dt), nd) + g * per_trial((1 - damp).to(dt), nd)
                buf = torch.where(first, g, upd)
            s.state["momentum_buffer"] = buf
            use = g + buf * per_trial(mom.to(dt), nd) if self.nesterov else buf
            g = torch.where(per_trial(mom != 0, nd), use, g)
        p.sub_(per_trial(lr.to(dt), nd) * g)

    # ---- elasticity -------------------------------------------------------------------------
    def resize(self, keep: Sequence[int], new_hparams: Sequence[TrialHParams] = ()) -> None:
        """Keep trials ``keep`` and append new ones (fresh state, step 0). Call after the model's
        ``resize_trials`` with the same arguments, so dim 0 of state and parameters agree."""
        self.hparams = [self.hparams[i] for i in keep] + list(new_hparams)
        self.steps = [self.steps[i] for i in keep] + [0] * len(new_hparams)
        for s in self.slots:
            for name, t in list(s.state.items()):
                idx = torch.as_tensor(list(keep), dtype=torch.long, device=t.device)
                kept = t.index_select(0, idx)
                if new_hparams:
                    kept = torch.cat([kept, kept.new_zeros((len(new_hparams), *t.shape[1:]))])
                s.state[name] = kept
        for s in self.slots:
            if s.param.shape[0] != self.num_trials:
                raise RuntimeError(f"parameter has {s.param.shape[0]} trials after resize, optimizer "
                                   f"{self.num_trials}: resize the model first")

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.slots for t in s.state.values())

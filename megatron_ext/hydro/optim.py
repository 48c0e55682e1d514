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
        # Per-trial scalars once per step (float64, as torch's python-float math), then one cast per
        # (dtype, ndim): tiny trials are dominated by per-op overhead, not by these B-vectors.
        like = self.slots[0].param
        hp = self.hparams
        v64 = {name: self._vec(vals, like) for name, vals in (
            ("lr", lrs), ("wd", [h.weight_decay for h in hp]), ("b1", [h.beta1 for h in hp]),
            ("b2", [h.beta2 for h in hp]), ("eps", [h.eps for h in hp]), ("step", self.steps),
            ("mom", [h.momentum for h in hp]), ("damp", [h.dampening for h in hp]))}
        v64["step_size"] = v64["lr"] / (1 - v64["b1"] ** v64["step"])
        v64["bc2_sqrt"] = (1 - v64["b2"] ** v64["step"]).sqrt()
        v64["lr_wd"] = v64["lr"] * v64["wd"]
        flags = {"wd": any(h.weight_decay != 0 for h in hp), "mom": any(h.momentum != 0 for h in hp)}
        cache: dict[tuple, dict[str, torch.Tensor]] = {}
        for s in self.slots:
            g = s.param.grad
            if g is None:
                continue
            key = (s.param.dtype, s.param.dim(), s.param.device, s.lr_mult, s.wd_mult)
            if key not in cache:
                dt, nd = s.param.dtype, s.param.dim()
                lm, wm = s.lr_mult, s.wd_mult
                cache[key] = {k: per_trial(v.to(s.param.device).to(dt), nd) for k, v in (
                    ("step_size", v64["step_size"] * lm), ("lr", v64["lr"] * lm), ("wd", v64["wd"] * wm),
                    ("decay", 1 - v64["lr_wd"] * (lm * wm)),
                    ("1-b1", 1 - v64["b1"]), ("b2", v64["b2"]), ("1-b2", 1 - v64["b2"]), ("eps", v64["eps"]),
                    ("bc2_sqrt", v64["bc2_sqrt"]), ("mom", v64["mom"]), ("1-damp", 1 - v64["damp"]),
                    ("first", (v64["step"] == 1).to(torch.float64)), ("mom!=0", (v64["mom"] != 0).to(torch.float64)))}
                if coefs is not None:
                    cache[key]["clip"] = per_trial(coefs.to(dt), nd)
            c = cache[key]
            if coefs is not None:
                g = g * c["clip"]
            if self.kind == "sgd":
                self._sgd(s, g, v64, c, flags)
            else:
                self._adam(s, g, v64, c, flags)

    def _adam(self, s: ParamSlot, g: torch.Tensor, v64: dict, c: dict, flags: dict) -> None:
        p = s.param
        if not s.state:
            s.state["exp_avg"] = torch.zeros_like(p)
            s.state["exp_avg_sq"] = torch.zeros_like(p)
        if self.kind == "adamw":
            if flags["wd"]:
                p.mul_(c["decay"])
        elif flags["wd"]:
            g = g + p * c["wd"]
        m, v = s.state["exp_avg"], s.state["exp_avg_sq"]
        m.lerp_(g, c["1-b1"])
        v.mul_(c["b2"]).addcmul_(g, g * c["1-b2"])
        denom = (v.sqrt() / c["bc2_sqrt"]).add_(c["eps"])
        p.addcdiv_(m * c["step_size"], denom, value=-1.0)

    def _sgd(self, s: ParamSlot, g: torch.Tensor, v64: dict, c: dict, flags: dict) -> None:
        p = s.param
        if flags["wd"]:
            g = g + p * c["wd"]
        if flags["mom"]:
            buf = s.state.get("momentum_buffer")
            if buf is None:
                buf = g.clone()
            else:
                # torch starts the buffer at the first gradient (no dampening on step 1).
                upd = buf * c["mom"] + g * c["1-damp"]
                buf = torch.where(c["first"] > 0, g, upd)
            s.state["momentum_buffer"] = buf
            use = g + buf * c["mom"] if self.nesterov else buf
            g = torch.where(c["mom!=0"] > 0, use, g)
        p.sub_(c["lr"] * g)

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

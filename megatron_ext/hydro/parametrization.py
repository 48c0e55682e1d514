"""muP for Hydro: width-dependent initialization and per-parameter LR multipliers.

What comes from the ``mup`` package (Microsoft's reference implementation of Tensor Programs V):
  * which dimensions are "infinite" (grow with width) and each parameter's width multiplier:
    ``mup.set_base_shapes`` with a base and a delta model;
  * the initialization rescaling (``MuReadout`` readout weights and Linear biases);
  * the readout layer itself (``mup.MuReadout``: output multiplier ``output_mult / width_mult``);
  * the LR / weight-decay multiplier of every parameter for Adam(W) and SGD: we build
    ``mup.MuAdam`` / ``mup.MuSGD`` param groups with base LR 1 and read the group LRs back.

What we do ourselves, and why: ``mup``'s optimizers are ordinary torch optimizers over plain
parameters, but our trials are fused (one tensor holds B trials), so the multipliers are handed to
``FusedOptimizer`` per parameter instead; and attention's 1/d scaling lives in the model
(``GPTShape.attn_scale``), since ``mup`` leaves attention to the model code.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)

Shapes = Mapping[str, tuple[int, ...]]


def param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def apply_mup(model: nn.Module, base_shapes: Shapes, delta_shapes: Shapes, rescale: bool = True) -> nn.Module:
    """Attach ``infshape`` to every parameter and rescale the init (muP), in place.

    ``base_shapes``: the model at base width (width multiplier 1); ``delta_shapes``: the same model
    at any other width, which tells ``mup`` which dimensions scale with width. Call on a freshly
    initialized model; a copy made after rescaling must not be rescaled again.
    """
    import mup

    for m in model.modules():  # mup refuses to rescale twice; our callers always pass fresh inits
        if getattr(m, "_has_rescaled_params", False):
            m._has_rescaled_params = False
    missing = sorted(set(param_shapes(model)) - set(base_shapes))
    if missing:
        raise ValueError(f"apply_mup: base shapes lack parameters {missing[:5]}")
    mup.set_base_shapes(model, dict(base_shapes), delta=dict(delta_shapes), rescale_params=rescale)
    return model


def mup_multipliers(model: nn.Module, optimizer: str) -> dict[str, tuple[float, float]]:
    """``{name: (lr_mult, wd_mult)}`` that ``mup.MuAdam`` / ``mup.MuSGD`` would apply to ``model``
    (after ``apply_mup``). AdamW shares Adam's rule (``mup.MuAdamW`` is ``MuAdam`` with AdamW)."""
    import mup

    named = list(model.named_parameters())
    for name, p in named:
        if not hasattr(p, "infshape"):
            raise ValueError(f"parameter {name} has no infshape: call apply_mup first")
    by_id = {id(p): name for name, p in named}
    capture = lambda groups, **_: groups  # noqa: E731 - stands in for the torch optimizer class
    fn = mup.MuSGD if optimizer == "sgd" else mup.MuAdam
    groups = fn([p for _, p in named], impl=capture, lr=1.0, weight_decay=1.0)
    out: dict[str, tuple[float, float]] = {}
    for g in groups:
        for p in g["params"]:
            out[by_id[id(p)]] = (float(g["lr"]), float(g["weight_decay"]))
    return out


def width_multipliers(model: nn.Module) -> dict[str, float]:
    return {n: float(p.infshape.width_mult()) for n, p in model.named_parameters() if hasattr(p, "infshape")}


def fused_param_groups(fused: nn.Module, multipliers: Mapping[str, tuple[float, float]] | None
                       ) -> list[tuple[nn.Parameter, float, float]]:
    """(param, lr_mult, wd_mult) for ``FusedOptimizer``. Fused parameter names equal plain ones
    (stacking keeps names), so the plain model's muP multipliers apply one to one."""
    out = []
    for name, p in fused.named_parameters():
        if multipliers is None:
            out.append((p, 1.0, 1.0))
            continue
        if name not in multipliers:
            raise ValueError(f"no muP multiplier for fused parameter {name}")
        lr_m, wd_m = multipliers[name]
        out.append((p, lr_m, wd_m))
    return out


def describe(multipliers: Mapping[str, tuple[float, float]]) -> list[dict[str, Any]]:
    return [{"param": n, "lr_mult": lm, "wd_mult": wm} for n, (lm, wm) in sorted(multipliers.items())]


def readout_mult(model: nn.Module) -> float:
    """The readout input multiplier in effect (1 for SP)."""
    for m in model.modules():
        if hasattr(m, "output_mult") and hasattr(m, "width_mult") and isinstance(m, nn.Linear):
            return float(m.output_mult) / float(m.width_mult())
    return 1.0


def coordinate_stats(model: nn.Module, inputs: torch.Tensor, module_types: tuple[type, ...] = (nn.Linear,)
                     ) -> dict[str, float]:
    """Mean |activation| of each module's output for one forward (what a coordinate check plots)."""
    stats: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, module_types):
            hooks.append(m.register_forward_hook(
                lambda mod, inp, out, name=name: stats.__setitem__(name, float(out.detach().abs().mean()))))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return stats

"""Hydro: cheap hyperparameter trials (shrunk muP models), fused into bundles, tuned with Optuna.

Entry points (imported lazily so that ``import megatron_ext.hydro`` stays light):

* ``fuse_model`` / ``shrink_model``: the torch.fx passes (Trial Binder, Model Shrinker);
* ``TrialBundle``: B trials trained as one unit, with pause points and elastic fusion count;
* ``FusedOptimizer`` / ``TrialHParams`` / ``LRSchedule``: per-trial Adam, AdamW and SGD;
* ``apply_mup`` / ``mup_multipliers``: muP on top of the ``mup`` package;
* ``HydroTuneConfig`` / ``load_config`` / ``parse_search_space`` / ``HydroTuner``: the tuning service
  (CLI: ``python -m megatron_ext.hydro.tune --config tune.yaml``).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "fuse_model": "fuse", "register_fuser": "fuse", "shrink_model": "shrink", "PassError": "fx_common",
    "TrialBundle": "bundle", "TrialSpec": "bundle", "PauseGate": "gate",
    "FusedOptimizer": "optim", "TrialHParams": "optim", "LRSchedule": "schedule",
    "apply_mup": "parametrization", "mup_multipliers": "parametrization", "param_shapes": "parametrization",
    "HydroTuneConfig": "config", "load_config": "config", "parse_search_space": "search_space",
    "HydroTuner": "tuner", "TuneResult": "tuner", "results_table": "tuner",
    "GPT": "models", "GPTShape": "models", "SmallCNN": "models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

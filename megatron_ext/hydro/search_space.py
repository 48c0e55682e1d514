"""The search space of a tuning study: parsing with located errors, and sampling through Optuna.

YAML form (a mapping under ``search_space``)::

    search_space:
      lr:           {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
      warmup_steps: {type: int, low: 0, high: 50, step: 10}
      schedule:     {type: categorical, choices: [constant, cosine]}

Only hyperparameters that trials of one fused bundle can differ in are searchable: optimizer
settings, the LR schedule and dropout. Shapes and the batch are shared by a bundle's trials.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Mapping

from megatron_ext.config.base import ConfigError

from .schedule import SCHEDULES

# name -> (kind, valid range as (low, high) inclusive or allowed choices)
SEARCHABLE: dict[str, tuple[str, Any]] = {
    "lr": ("float", (0.0, math.inf)),
    "beta1": ("float", (0.0, 0.999999)),
    "beta2": ("float", (0.0, 0.999999)),
    "eps": ("float", (0.0, 1.0)),
    "weight_decay": ("float", (0.0, math.inf)),
    "momentum": ("float", (0.0, 0.999999)),
    "dampening": ("float", (0.0, 1.0)),
    "grad_clip": ("float", (0.0, math.inf)),
    "warmup_steps": ("int", (0, 10 ** 9)),
    "min_lr_ratio": ("float", (0.0, 1.0)),
    "dropout": ("float", (0.0, 0.999999)),
    "schedule": ("categorical", SCHEDULES),
}
# Shape or batch settings a user may try to search, and why that cannot be done in one bundle.
NOT_FUSABLE = {"batch_size", "seq_len", "d_model", "n_layers", "n_heads", "ffn_mult", "vocab_size",
               "optimizer", "shrink_ratio", "model_family", "num_query_groups", "ffn_hidden_size", "rotary_base"}
SPEC_KEYS = {"type", "low", "high", "log", "step", "choices"}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str                      # float | int | categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def distribution(self) -> Any:
        """The Optuna distribution ``suggest`` draws from."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "categorical":
            return CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return FloatDistribution(float(self.low), float(self.high), log=self.log, step=self.step)

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)


def _num(v: Any, kind: str, err) -> float | int:
    # PyYAML reads 1e-4 (no dot) as a string: accept numeric strings.
    if isinstance(v, bool):
        err(f"expected a number, got {v!r}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        err(f"expected a number, got {v!r}")
    if kind == "int":
        if not float(x).is_integer():
            err(f"expected an integer, got {v!r}")
        return int(x)
    return x


def parse_search_space(spec: Any, where: str = "search_space", lines: Mapping[str, int] | None = None,
                       section: str = "search_space") -> dict[str, Param]:
    """Validate ``spec`` (the YAML mapping) into ``{name: Param}``. Errors name file:line and key."""
    lines = lines or {}
    if spec is None or spec == {}:
        return {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: search_space must be a mapping of hyperparameter: {{type, ...}}, "
                          f"got {type(spec).__name__}")
    out: dict[str, Param] = {}
    for name, body in spec.items():
        name = str(name)
        loc = f"{where}:{lines[name]}" if name in lines else where

        def err(msg: str, name=name, loc=loc) -> None:
            raise ConfigError(f"{loc}: {section}.{name}: {msg}")

        if name in NOT_FUSABLE:
            err("cannot be searched: the trials of one fused bundle share shapes, the batch and the optimizer "
                "kind; run one study per value instead")
        if name not in SEARCHABLE:
            close = difflib.get_close_matches(name, SEARCHABLE, n=1)
            err("unknown hyperparameter" + (f" (did you mean '{close[0]}'?)" if close else "") +
                f"; searchable: {', '.join(sorted(SEARCHABLE))}")
        if not isinstance(body, Mapping):
            err(f"expected a mapping like {{type: float, low: ..., high: ...}}, got {body!r}")
        extra = sorted(set(body) - SPEC_KEYS)
        if extra:
            err(f"unknown field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}; "
                f"allowed: {', '.join(sorted(SPEC_KEYS))}")
        want_kind, valid = SEARCHABLE[name]
        kind = str(body.get("type", want_kind))
        if kind not in ("float", "int", "categorical"):
            err(f"type must be float, int or categorical, got {kind!r}")
        if kind == "categorical":
            choices = body.get("choices")
            if not isinstance(choices, (list, tuple)) or not choices:
                err("categorical needs a non-empty list 'choices'")
            if want_kind == "categorical":
                bad = [c for c in choices if c not in valid]
                if bad:
                    err(f"invalid choice{'s' if len(bad) > 1 else ''} {bad}; valid: {list(valid)}")
            else:
                choices = [_num(c, want_kind, err) for c in choices]
                for c in choices:
                    if not valid[0] <= c <= valid[1]:
                        err(f"{'value' if section == 'defaults' else 'choice'} {c} is outside [{valid[0]}, {valid[1]}]")
            if any(k in body for k in ("low", "high", "log", "step")):
                err("categorical takes only 'choices' (no low/high/log/step)")
            out[name] = Param(name, "categorical", choices=tuple(choices))
            continue
        if want_kind == "categorical":
            err(f"{name} is categorical: use {{type: categorical, choices: {list(valid)}}}")
        if want_kind == "int" and kind == "float":
            err("is an integer hyperparameter: use type: int")
        for k in ("low", "high"):
            if k not in body:
                err(f"missing '{k}'")
        low, high = _num(body["low"], kind, err), _num(body["high"], kind, err)
        log = body.get("log", False)
        if not isinstance(log, bool):
            err(f"'log' must be true or false, got {log!r}")
        step = _num(body["step"], kind, err) if body.get("step") is not None else None
        if not low < high:
            err(f"'low' ({low}) must be < 'high' ({high})")
        if log and low <= 0:
            err(f"log scale needs low > 0, got {low}")
        if log and step is not None:
            err("'log' and 'step' cannot be combined")
        if step is not None and step <= 0:
            err(f"'step' must be > 0, got {step}")
        if low < valid[0] or high > valid[1]:
            err(f"range [{low}, {high}] leaves the valid range [{valid[0]}, {valid[1]}]")
        out[name] = Param(name, kind, low, high, log, step)
    return out


def space_signature(space: Mapping[str, Param]) -> str:
    """A stable text form stored with the study, to refuse resuming with another search space."""
    return ";".join(f"{p.name}:{p.kind}:{p.low}:{p.high}:{p.log}:{p.step}:{list(p.choices)}"
                    for p in sorted(space.values(), key=lambda p: p.name))

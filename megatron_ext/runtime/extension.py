"""The small protocol every training-loop extension follows.

An extension is set up with the trainer, sees each iteration before and after it runs, and is torn
down at the end. Factories register by name with ``@register_extension``; ``build_extensions`` asks
each factory for an instance given the run config, and a factory returns ``None`` when its flag is
off — so each extension is switched on and off by its own flag, and the loop stays the same.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.config.run import RunConfig
    from megatron_ext.runtime.loop import Trainer


@dataclasses.dataclass
class IterationMetrics:
    iteration: int
    loss: float | None  # lm loss averaged over micro-batches and data-parallel ranks (last stage only)
    lr: float
    grad_norm: float | None
    iter_time_s: float
    tokens_per_s: float
    consumed_samples: int
    skipped: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Extension:
    """Base class: override what you need. Runtime objects come through ``trainer``."""

    name = "extension"

    def setup(self, trainer: "Trainer") -> None:
        pass

    def before_iteration(self, trainer: "Trainer", iteration: int) -> None:
        pass

    def after_iteration(self, trainer: "Trainer", metrics: IterationMetrics) -> None:
        pass

    def teardown(self, trainer: "Trainer") -> None:
        pass

    # A live re-layout (``Trainer.relayout``) replaces the model, optimizer, process groups and data
    # streams. An extension that wrapped or patched any of them lets go in ``detach`` and wraps the
    # new ones in ``attach``; state of its own (files, detectors, threads) carries over.
    def detach(self, trainer: "Trainer") -> None:
        pass

    def attach(self, trainer: "Trainer") -> None:
        pass


ExtensionFactory = Callable[["RunConfig"], "Extension | None"]
_FACTORIES: dict[str, ExtensionFactory] = {}


def register_extension(name: str) -> Callable[[ExtensionFactory], ExtensionFactory]:
    def deco(factory: ExtensionFactory) -> ExtensionFactory:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"extension {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return deco


def build_extensions(cfg: "RunConfig") -> list[Extension]:
    out = []
    for factory in _FACTORIES.values():
        ext = factory(cfg)
        if ext is not None:
            out.append(ext)
    return out

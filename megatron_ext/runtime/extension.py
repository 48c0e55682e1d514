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
    from megatron_ext.ft.protocol import TrainerLike as Trainer


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
    global_batch_size: int | None = None   # sequences of this iteration over all data-parallel ranks
    loss_scale: float = 1.0                # the optimizer's (fp16's dynamic scale; 1.0 in bf16 and fp32)
    timers_s: dict[str, float] = dataclasses.field(default_factory=dict)   # --timing-log-level 1: phases, seconds
    params_norm: float | None = None       # --log-params-norm: L2 norm of every parameter, each counted once
    num_zeros_in_grad: int | None = None   # --log-num-zeros-in-grad: zero entries of the step's gradient


class Extension:
    """Base class: override what you need. Runtime objects come through ``trainer`` (what a trainer
    offers: ``ft/protocol.py``; the runtime's ``Trainer`` and the DeepSpeed engine's implement it).

    ``requires`` names extensions this one reads (e.g. the timeline's event recorder): they are
    built even when their own flag is off, set up before this one, and handed over in ``deps``."""

    name = "extension"
    requires: tuple[str, ...] = ()
    deps: dict[str, "Extension"]

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


# factory(cfg) -> an instance, or None when the extension's flag is off; a factory another
# extension depends on also takes ``required=True`` (build it although its flag is off).
ExtensionFactory = Callable[..., "Extension | None"]
_FACTORIES: dict[str, ExtensionFactory] = {}


def register_extension(name: str) -> Callable[[ExtensionFactory], ExtensionFactory]:
    def deco(factory: ExtensionFactory) -> ExtensionFactory:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"extension {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return deco


def build_extensions(cfg: "RunConfig") -> list[Extension]:
    """The extensions ``cfg`` switches on, plus what they require, dependencies first."""
    from megatron_ext.config.run import sections

    sections()  # imports every extension module: their factories register on import
    built: dict[str, Extension] = {}
    for name, factory in _FACTORIES.items():
        ext = factory(cfg)
        if ext is not None:
            built[name] = ext
    order: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in chain:
            raise ValueError(f"extensions require each other: {' -> '.join(chain + (name,))}")
        ext = built[name]
        ext.deps = {}
        for dep in ext.requires:
            if dep not in built:
                if dep not in _FACTORIES:
                    raise ValueError(f"extension {name!r} requires {dep!r}, which is not registered")
                made = _FACTORIES[dep](cfg, required=True)
                if made is None:
                    raise ValueError(f"extension {dep!r} (required by {name!r}) cannot run with this configuration")
                built[dep] = made
            visit(dep, chain + (name,))
            ext.deps[dep] = built[dep]
        order.append(name)

    for name in list(built):
        visit(name, ())
    return [built[n] for n in order]

"""What the in-process runtime tests share: one rank for a test module, and a run whose iterations
are watched."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from megatron_ext.config.run import config_from_values
from megatron_ext.runtime import distributed


def one_rank(values: dict[str, Any]) -> Iterator[Any]:
    """A module fixture's body: this process as a one-rank job for ``values``' layout; the CPU shims
    are removed again if the fixture applied them (tests/compat checks ``apply()`` from scratch)."""
    from megatron_ext.compat import megatron_cpu

    shims_before = megatron_cpu.applied()
    cfg = config_from_values(dict(values))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    yield ctx
    distributed.teardown()
    if not shims_before:
        megatron_cpu.remove()


def watched_run(ctx: Any, values: dict[str, Any], record: Callable[[Any, Any], Any] = lambda t, m: m
                ) -> tuple[Any, list[Any]]:
    """Set up and run a trainer for ``values``; ``record(trainer, metrics)`` of every iteration."""
    from megatron_ext.runtime.loop import Trainer

    trainer = Trainer(config_from_values(dict(values)), ctx).setup()
    seen: list[Any] = []
    trainer.extensions.append(type("Watch", (), {
        "before_iteration": lambda self, t, it: None, "teardown": lambda self, t: None,
        "after_iteration": lambda self, t, m: seen.append(record(t, m))})())
    trainer.run()
    return trainer, seen

"""The MoE load-balancing loss in the progress line, the metrics file and TensorBoard (under megatron's
tracker name there: ``load_balancing_loss``, as Megatron-LM logs it).

megatron's router records each auxiliary loss divided by its coefficient (1.0 for a perfectly
balanced router) in a tracker; this extension reduces it over the ranks after each iteration and
puts it into ``metrics.extra`` (``moe_load_balancing_loss``, or ``moe_seq_load_balancing_loss``).
Registered by its own entry point (``megatron_ext.extensions``: ``moe-aux-loss``), on for MoE
models on an engine that trains them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.runtime.extension import Extension, IterationMetrics, register_extension

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.config.run import RunConfig
    from megatron_ext.ft.protocol import TrainerLike


PREFIX = "moe_"
"""Our name of a tracked loss: ``moe_`` + megatron's tracker name (``moe_load_balancing_loss``)."""


def megatron_loss_name(key: str) -> str | None:
    """Megatron-LM's name (its TensorBoard tag and progress-line field: the tracker's) of an
    ``IterationMetrics.extra`` key this extension writes, or None for any other key."""
    return key[len(PREFIX):] if key.startswith(PREFIX) else None


def moe_aux_losses(num_microbatches: int) -> dict[str, float]:
    """megatron's MoE auxiliary losses of the last iteration, per layer and micro-batch, reduced
    over ranks (collective over every rank); the tracker is cleared for the next iteration.

    The router records each loss divided by its coefficient (``load_balancing_loss`` is 1.0 for a
    perfectly balanced router), summed over micro-batches, one value per layer."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    names = sorted(tracker)
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    out = {}
    for name in names:
        values = tracker[name]["values"]
        out[PREFIX + name] = float(values.float().sum()) / (values.numel() * max(num_microbatches, 1))
    moe_utils.clear_aux_losses_tracker()
    return out


class MoEAuxLossLogging(Extension):
    """Puts the MoE auxiliary losses into ``metrics.extra`` (progress line, metrics file, TensorBoard)."""

    name = "moe-aux-loss"

    def after_iteration(self, trainer: "TrainerLike", metrics: IterationMetrics) -> None:
        metrics.extra.update(moe_aux_losses(len(getattr(trainer, "last_batches", ()) or ())))


@register_extension("moe-aux-loss")
def _moe_aux_loss_factory(cfg: "RunConfig") -> Extension | None:
    from megatron_ext.engines import engine

    on = cfg.model.num_experts is not None and engine(cfg.parallel.engine).supports("mixture_of_experts")
    return MoEAuxLossLogging() if on else None

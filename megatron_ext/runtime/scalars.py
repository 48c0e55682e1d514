"""Where the run's scalars go on the logging rank: TensorBoard (``--tensorboard-dir``) and Weights &
Biases (``--wandb-project``), under Megatron-LM's names, so that a Megatron-LM user's dashboards and
the scripts that read its event files find them.

Megatron-LM's names (``megatron/training/training.py``, core_v0.16.1): ``lm loss``,
``learning-rate``, ``batch-size``, ``loss-scale``, ``grad-norm``, ``world-size``, each also
``<tag> vs samples`` over the consumed samples; at a log interval ``iteration-time`` (seconds) and
``throughput`` (TFLOP/s per device), timers as ``<name>-time``; validation ``lm loss validation``
(and ``... vs samples``, ``... ppl``, ``... ppl vs samples``); the MoE load-balancing loss as its
tracker's name (``load_balancing_loss``). Weights & Biases gets the same names without the ``vs
samples`` series (``samples vs steps`` instead), as in Megatron-LM. What Megatron-LM has no name for
keeps ours: ``train/tokens_per_s``, ``train/<extension field>`` (bubbles, the squeezer's,
ResiHP's progress fields) and the extensions' own tags (``resihp/*``).

wandb is imported only when ``--wandb-project`` is given (``LoggingConfig`` checks that it is
installed before any rank starts).
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping

SAMPLES = " vs samples"


def perplexity(loss: float) -> float:
    """Megatron-LM's validation perplexity: exp of the loss, capped at exp(20)."""
    return math.exp(min(20.0, loss))


class Scalars:
    """TensorBoard and Weights & Biases as one writer: ``add_scalar(tag, value, step)`` is what an
    extension calls (``trainer.tensorboard``). ``samples``: the consumed samples at ``step``, for
    Megatron-LM's ``<tag> vs samples`` series (TensorBoard only)."""

    def __init__(self, tensorboard: Any = None, wandb_run: Any = None) -> None:
        self.tb = tensorboard
        self.wandb = wandb_run

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.add_scalars({tag: value}, step)

    def add_scalars(self, values: Mapping[str, float], step: int, *, samples: int | None = None,
                    wandb_extra: Mapping[str, float] | None = None) -> None:
        values = {k: float(v) for k, v in values.items() if v is not None}
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
                if samples is not None:
                    self.tb.add_scalar(tag + SAMPLES, value, samples)
        if self.wandb is not None and (values or wandb_extra):
            self.wandb.log({**values, **(wandb_extra or {})}, step=step)


def open_tensorboard(log_dir: str, *, purge_step: int | None, queue_size: int) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir, purge_step=purge_step, max_queue=queue_size)


def open_wandb(logging: Any, *, config: Mapping[str, Any], save: str | None) -> Any:
    """A Weights & Biases run as Megatron-LM starts one: ``--wandb-project``, ``--wandb-exp-name``,
    ``--wandb-entity``, files under ``--wandb-save-dir`` (default ``<--save>/wandb``), the run's flat
    config as its config. ``WANDB_MODE=offline`` keeps it in those files."""
    import wandb

    save_dir = logging.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
    kwargs: dict[str, Any] = {"project": logging.wandb_project, "name": logging.wandb_exp_name,
                              "config": dict(config)}
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
        kwargs["dir"] = save_dir
    if logging.wandb_entity:
        kwargs["entity"] = logging.wandb_entity
    return wandb.init(**kwargs)

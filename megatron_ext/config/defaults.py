"""The defaults the run configuration took from Megatron-LM (issue 44), and what they were before.

Where Megatron-LM (core_v0.16.1) has a default, the config's is the same (``config/run.py``); the
small-model defaults Megatron-LM leaves to the user (``--num-layers 4 --hidden-size 64`` ...) stay
ours, so ``python pretrain_gpt.py --train-iters 50`` still trains a tiny model on the embedded corpus.
``CHANGED`` says which defaults moved; a config, test or benchmark written before them gives
``FORMER_DEFAULTS`` explicitly to keep its meaning (no dropout: every layout computes the same loss).
Light on purpose (no torch, no megatron): the tools that launch ranks import it.
"""
from __future__ import annotations

from megatron_ext.config.base import flag_name

CHANGED: dict[str, tuple[object, object]] = {
    "hidden_dropout": (0.0, 0.1),
    "attention_dropout": (0.0, 0.1),
    "adam_beta2": (0.95, 0.999),
    "lr_decay_style": ("cosine", "linear"),
    "min_lr": (1e-4, 0.0),
}
"""Flag -> (its default before, Megatron-LM's and now the config's). Also Megatron-LM's: the vocabulary
padded to --make-vocab-size-divisible-by (128) x --tensor-model-parallel-size, where it was 128 alone."""

FORMER_DEFAULTS = {key: before for key, (before, _) in CHANGED.items()}


def former_default_flags() -> list[str]:
    """``FORMER_DEFAULTS`` as command-line flags, for the tools that launch pretrain_gpt.py."""
    return [arg for key, value in FORMER_DEFAULTS.items() for arg in (flag_name(key), str(value))]

"""Optimizer, LR schedule and gradient clipping.

CPU: ``torch.optim.AdamW`` over ``param.main_grad`` (megatron DDP accumulates gradients there);
megatron's optimizer does not run on CPU (FEASIBILITY.md). GPU: megatron's ``get_megatron_optimizer``.
The LR schedule is megatron-core's ``OptimizerParamScheduler`` in both cases.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_ext.config.run import TrainingConfig

logger = logging.getLogger(__name__)


def _param_groups(params: Iterable[torch.nn.Parameter]) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for p in params:
        if not p.requires_grad:
            continue
        # Biases and norm gains are 1-D: no weight decay (as in megatron).
        (no_decay if p.ndim == 1 else decay).append(p)
    return [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]


class CPUOptimizer:
    """AdamW over ``main_grad`` with model-parallel-aware clipping; megatron-optimizer-like API."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainingConfig) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.clip_grad = cfg.clip_grad
        self.optimizer = torch.optim.AdamW(_param_groups(self.params), lr=cfg.lr,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def grad_norm(self) -> float:
        """Global L2 norm over the whole model: each shard counted once across TP/PP ranks."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            g = getattr(p, "main_grad", None)
            if g is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(p):
                continue
            sq += g.double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sqrt())

    def step(self) -> tuple[bool, float]:
        """Clip and apply the gradients; returns (applied, grad norm before clipping)."""
        for p in self.params:
            p.grad = getattr(p, "main_grad", p.grad)
        norm = self.grad_norm()
        if not torch.isfinite(torch.tensor(norm)):
            logger.warning("non-finite gradient norm %s: skipping this update", norm)
            self.zero_grad()
            return False, norm
        if self.clip_grad > 0 and norm > self.clip_grad:
            coef = self.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.zero_grad()
        return True, norm

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def param_state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """Per-parameter optimizer tensors (exp_avg, exp_avg_sq) and step, for resharding checkpoints."""
        return self.optimizer.state.get(p, {})


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainingConfig, on_gpu: bool, model_chunks=None):
    if not on_gpu:
        return CPUOptimizer(params, cfg)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                           adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                           clip_grad=cfg.clip_grad, bf16=cfg.bf16, params_dtype=torch.float32)
    return get_megatron_optimizer(ocfg, model_chunks)


def build_scheduler(optimizer: Any, cfg: TrainingConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_iters > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters,
        lr_decay_steps=max(cfg.lr_decay_iters, cfg.lr_warmup_iters + 1),
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.train_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )

"""Optimizer, LR schedule, gradient clipping, and per-parameter optimizer state for checkpoints.

fp32 on CPU: ``torch.optim.AdamW`` over ``param.main_grad`` (megatron DDP accumulates gradients
there). GPU, and ``--bf16`` on CPU: megatron's ``get_megatron_optimizer`` (``Float16OptimizerWith
Float16Params``, or ``DistributedOptimizer`` when the DDP wrapper was built for it); on CPU it runs
under the compat shims and ``cuda_type_names()`` (``compat/megatron_cpu.py``). The LR schedule is
megatron-core's ``OptimizerParamScheduler`` in all cases.

``collect_param_states`` / ``restore_param_states`` give the checkpoint code one view of every
optimizer: per model parameter, its fp32 master copy (when the optimizer keeps one apart from the
model weight), its Adam moments and its step count, all in the parameter's own (TP/PP-local) shape.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_ext.config.run import TrainingConfig

logger = logging.getLogger(__name__)


def _param_groups(params: Iterable[torch.nn.Parameter], cfg: TrainingConfig | None = None) -> list[dict[str, Any]]:
    """Weight-decayed and not; with --decoupled-lr, the embedding and output weights (megatron marks
    them ``is_embedding_or_output_parameter``) in groups of their own, whose ``max_lr`` / ``min_lr`` the
    scheduler follows, as in megatron's optimizer."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    decoupled = cfg is not None and cfg.decoupled_lr is not None
    for p in params:
        if not p.requires_grad:
            continue
        # Biases and norm gains are 1-D: no weight decay (as in megatron).
        own = decoupled and getattr(p, "is_embedding_or_output_parameter", False)
        groups.setdefault((p.ndim > 1, own), []).append(p)
    out = []
    for decay in (True, False):
        out.append({"params": groups.get((decay, False), []), "wd_mult": 1.0 if decay else 0.0})
        if (decay, True) in groups:
            out.append({"params": groups[(decay, True)], "wd_mult": 1.0 if decay else 0.0, "max_lr": cfg.decoupled_lr,
                        "min_lr": cfg.min_lr if cfg.decoupled_min_lr is None else cfg.decoupled_min_lr})
    return out


class CPUOptimizer:
    """AdamW over ``main_grad`` with model-parallel-aware clipping; megatron-optimizer-like API."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainingConfig, pgs: Any = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.clip_grad = cfg.clip_grad
        self.count_zeros = cfg.log_num_zeros_in_grad
        self.pgs = pgs  # the layout's process groups (DistContext.pgs); None: one rank
        self.optimizer = torch.optim.AdamW(_param_groups(self.params, cfg), lr=cfg.lr,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def grad_norm(self) -> float:
        """Global L2 norm over the whole model: each shard counted once across TP/PP ranks, and
        expert-parallel weights (``allreduce=False``: each EP rank holds other experts) summed over
        the expert TP x EP x PP group, as megatron's clip_grads does."""
        return float(self._grad_sum(lambda g: g.double().pow(2).sum()).sqrt())

    def num_zeros(self) -> int:
        """Zero entries of the gradient over the whole model, each shard counted once (megatron's
        count_zeros_fp32 over the same parameters as the norm)."""
        return int(self._grad_sum(lambda g: (g == 0).sum().double()))

    def _grad_sum(self, of: Any) -> torch.Tensor:
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        total = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            g = getattr(p, "main_grad", None)
            if g is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(p):
                continue
            if getattr(p, "allreduce", True):
                total += of(g)
            else:
                expert += of(g)
        if dist.is_initialized() and self.pgs is not None:
            dist.all_reduce(total, group=self.pgs.mp)
            # Uniform over ranks: with EP > 1 every rank holds expert weights.
            if dist.get_world_size(self.pgs.ep) > 1:
                dist.all_reduce(expert, group=self.pgs.tp_ep_pp)
        return total + expert

    def step(self) -> tuple[bool, float, int | None]:
        """Clip and apply the gradients; returns (applied, grad norm before clipping, zeros in the
        gradient with --log-num-zeros-in-grad), as megatron's optimizers do."""
        for p in self.params:
            p.grad = getattr(p, "main_grad", p.grad)
        norm = self.grad_norm()
        zeros = self.num_zeros() if self.count_zeros else None
        if not torch.isfinite(torch.tensor(norm)):
            logger.warning("non-finite gradient norm %s: skipping this update", norm)
            self.zero_grad()
            return False, norm, zeros
        if self.clip_grad > 0 and norm > self.clip_grad:
            coef = self.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.zero_grad()
        return True, norm, zeros

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


class MegatronOptimizerOnCPU:
    """megatron's optimizer on CPU ranks: every step runs inside ``cuda_type_names()``.

    ``clip_grads`` asserts that gradients are ``'torch.cuda.FloatTensor'`` on every step, so the
    context is needed beyond construction. Everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: Any) -> None:
        self.__dict__["megatron_optimizer"] = optimizer

    def step(self) -> Any:
        from megatron_ext.compat.megatron_cpu import cuda_type_names

        with cuda_type_names():
            return self.megatron_optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["megatron_optimizer"], name)


def _uses_distributed_optimizer(model_chunks: Any) -> bool:
    ddp_configs = [getattr(c, "ddp_config", None) for c in model_chunks or []]
    return any(getattr(d, "use_distributed_optimizer", False) for d in ddp_configs)


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainingConfig, on_gpu: bool, model_chunks=None,
                    pgs: Any = None):
    """AdamW for fp32 CPU runs; megatron's optimizer on GPUs and for ``--bf16`` (master weights).
    ``pgs``: the layout's process groups (``DistContext.pgs``).

    The distributed optimizer is used exactly when the DDP wrappers were built for it (their
    ``ddp_config.use_distributed_optimizer``): megatron requires the two to agree."""
    if not on_gpu and not cfg.bf16 and not cfg.fp16 and not _uses_distributed_optimizer(model_chunks):
        return CPUOptimizer(params, cfg, pgs)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if not model_chunks:
        raise ValueError("megatron's optimizer needs the DDP-wrapped model chunks (model_chunks=...)")
    ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                           adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                           clip_grad=cfg.clip_grad, bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=torch.float32,
                           loss_scale=cfg.loss_scale, initial_loss_scale=cfg.initial_loss_scale,
                           min_loss_scale=cfg.min_loss_scale, loss_scale_window=cfg.loss_scale_window,
                           hysteresis=cfg.hysteresis, decoupled_lr=cfg.decoupled_lr,
                           decoupled_min_lr=cfg.decoupled_min_lr, log_num_zeros_in_grad=cfg.log_num_zeros_in_grad,
                           use_distributed_optimizer=_uses_distributed_optimizer(model_chunks))
    # The layout's groups, explicitly; megatron's gloo twins are not asked for (its optimizer uses
    # them only for its own checkpoint format, which this runtime does not write).
    groups = dict(pg_collection=pgs, use_gloo_process_groups=False) if pgs is not None else {}
    if on_gpu:
        return _scaling_losses(get_megatron_optimizer(ocfg, model_chunks, **groups), model_chunks)
    from megatron_ext.compat.megatron_cpu import applied, cuda_type_names

    if not applied():
        raise RuntimeError("megatron's optimizer on CPU needs the compat shims: call "
                           "megatron_ext.compat.megatron_cpu.apply() (distributed.setup does on CPU)")
    with cuda_type_names():
        return _scaling_losses(MegatronOptimizerOnCPU(get_megatron_optimizer(ocfg, model_chunks, **groups)),
                               model_chunks)


def _scaling_losses(optimizer: Any, model_chunks: Any) -> Any:
    """Under --fp16 megatron's schedule multiplies each micro-batch's loss by the optimizer's loss scale
    before backward (``config.grad_scale_func``, which Megatron-LM's training sets too); the optimizer
    divides the gradients by it again and skips an iteration whose gradients overflowed. Runs without
    a loss scaler keep the schedule as it was (no multiplication by 1)."""
    from megatron.core.utils import get_model_config

    if any(getattr(opt, "grad_scaler", None) is not None for opt in _megatron_parts(optimizer)):
        get_model_config(model_chunks[0]).grad_scale_func = optimizer.scale_loss
    return optimizer


# --- per-parameter optimizer state (checkpoints) --------------------------------------------

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class _Slot:
    """Where one model parameter's optimizer state lives.

    ``inner``: the torch-level optimizer holding the state; ``key``: its state key, the master copy
    (``None`` when this data-parallel rank owns no part of the parameter); ``separate_main``: the
    master is a different tensor from the model weight (mixed precision); ``flat_range``: for the
    distributed optimizer, the part of the flattened parameter this rank owns; ``dp_group``: the
    group over which the owned parts are spread."""

    inner: Any
    group: dict[str, Any] | None
    key: torch.Tensor | None
    separate_main: bool
    flat_range: tuple[int, int] | None = None
    dp_group: Any = None


def _megatron_parts(optimizer: Any) -> list[Any]:
    opt = getattr(optimizer, "megatron_optimizer", optimizer)
    return list(getattr(opt, "chained_optimizers", [opt]))


def _group_of(inner: Any, key: torch.Tensor) -> dict[str, Any] | None:
    for g in inner.param_groups:
        if any(p is key for p in g["params"]):
            return g
    return None


def _slots(optimizer: Any) -> dict[int, _Slot]:
    """Map id(model parameter) -> _Slot for every parameter the optimizer updates."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    slots: dict[int, _Slot] = {}
    for part in _megatron_parts(optimizer):
        inner = getattr(part, "optimizer", part)
        if isinstance(part, DistributedOptimizer):
            # data_parallel_group: the ranks one distributed-optimizer instance shards state over.
            group = part.data_parallel_group
            # Every parameter of the instance's buffers takes part in the gather, also those of
            # which this rank owns nothing (model_param_gbuf_map lists only owned ones).
            for buffer in part.buffers:
                for model_param in buffer.param_index_map:
                    key, lo_hi = None, (0, 0)
                    if model_param in part.model_param_gbuf_map:
                        rng = part._get_model_param_range_map(model_param)["param"]
                        lo_hi = (rng.start, rng.end)
                    if model_param in part.model_param_group_index_map:
                        gi, go = part.model_param_group_index_map[model_param]
                        key = inner.param_groups[gi]["params"][go]
                    slots[id(model_param)] = _Slot(inner=inner, group=None if key is None else _group_of(inner, key),
                                                   key=key, separate_main=True, flat_range=lo_hi, dp_group=group)
        elif isinstance(part, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(part.float16_groups, part.fp32_from_float16_groups):
                for model_param, main_param in zip(model_group, main_group):
                    slots[id(model_param)] = _Slot(inner, _group_of(inner, main_param), main_param, True)
            for fp32_group in part.fp32_from_fp32_groups:
                for p in fp32_group:
                    slots[id(p)] = _Slot(inner, _group_of(inner, p), p, False)
        else:  # CPUOptimizer, megatron's FP32Optimizer: the state is keyed by the model weight itself
            for g in inner.param_groups:
                for p in g["params"]:
                    slots[id(p)] = _Slot(inner, g, p, False)
    return slots


def _per_param_step(inner: Any) -> bool:
    """torch's Adam/AdamW count steps per parameter (``state['step']``); the fused Adams of
    Transformer Engine and apex count them per group (``group['step']``)."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _local_state(slot: _Slot) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], float | None]:
    """(master copy or None, moments, step) as this rank holds them (flattened slice if distributed)."""
    if slot.key is None:
        return None, {}, None
    st = slot.inner.state.get(slot.key, {})
    moments = {k: st[k] for k in MOMENT_KEYS if k in st}
    step = st.get("step") if _per_param_step(slot.inner) else (slot.group or {}).get("step")
    if len(moments) < len(MOMENT_KEYS):
        moments, step = {}, None
    return (slot.key if slot.separate_main else None), moments, (None if step is None else float(step))


def _view_of_param(p: torch.Tensor, slots: dict[int, _Slot]) -> tuple[torch.Tensor, int] | None:
    """(parameter, flat offset) when ``p`` is a contiguous view into a parameter the optimizer
    updates: a SwiGLU ``linear_fc1`` checkpoints as its W and V halves (runtime/model.py)."""
    base = p._base
    if base is None or id(p) in slots or id(base) not in slots:
        return None
    if not (p.is_contiguous() and base.is_contiguous()):
        raise ValueError(f"optimizer state of a non-contiguous view {tuple(p.shape)} of a parameter "
                         f"{tuple(base.shape)} cannot be sliced")
    return base, p.storage_offset() - base.storage_offset()


def _bases(params: list[torch.Tensor], views: list[Any]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct parameters behind ``params`` (a view stands for its parameter), and where each
    of ``params`` is in that list."""
    targets: list[torch.Tensor] = []
    where: dict[int, int] = {}
    index = []
    for p, v in zip(params, views):
        base = v[0] if v else p
        if id(base) not in where:
            where[id(base)] = len(targets)
            targets.append(base)
        index.append(where[id(base)])
    return targets, index


def collect_param_states(optimizer: Any, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """As ``_collect_param_states``; a view into a parameter gets its slice of the parameter's state."""
    slots = _slots(optimizer)
    views = [_view_of_param(p, slots) for p in params]
    if not any(views):
        return _collect_param_states(optimizer, params)
    targets, index = _bases(params, views)
    full = _collect_param_states(optimizer, targets)
    out = []
    for p, v, i in zip(params, views, index):
        if not v:
            out.append(full[i])
            continue
        start, n = v[1], p.numel()
        out.append({k: (t.reshape(-1)[start:start + n].view(p.shape).clone() if isinstance(t, torch.Tensor) else t)
                    for k, t in full[i].items()})
    return out


def _collect_param_states(optimizer: Any, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Per parameter: ``{"main": fp32 master (mixed precision only), "exp_avg", "exp_avg_sq",
    "step"}`` in the parameter's shape, on CPU; ``{}`` for a parameter without optimizer state.

    Collective over data-parallel groups when the distributed optimizer shards the state: each rank
    contributes the part it owns and every replica receives the whole (all-reduces over flat buffers
    of at most ``GATHER_CHUNK_ELEMENTS`` parameters x three fp32 kinds on the device; the whole
    result lands in host memory)."""
    slots = _slots(optimizer)
    out: list[dict[str, Any]] = [{} for _ in params]
    distributed: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        slot = slots.get(id(p))
        if slot is None:
            continue
        if slot.flat_range is not None:
            distributed.setdefault(slot.dp_group, []).append(i)
            continue
        main, moments, step = _local_state(slot)
        if main is not None:
            out[i]["main"] = main.detach().float().cpu().clone()
        if step is not None:
            out[i].update({k: v.detach().float().cpu().clone() for k, v in moments.items()}, step=step)
    for group, indices in distributed.items():
        _gather_sharded(group, [params[i] for i in indices], [slots[id(params[i])] for i in indices],
                        [out[i] for i in indices])
    return out


# Elements per all-reduce of the distributed optimizer's gather: bounds the flat buffer (three fp32
# kinds: 768 MiB at this size) whatever the model size.
GATHER_CHUNK_ELEMENTS = 1 << 26


def _chunks(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive index runs whose sizes sum to at most ``limit`` (a larger tensor runs alone)."""
    runs: list[list[int]] = []
    total = limit + 1
    for i, n in enumerate(sizes):
        if total + n > limit:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs


def _gather_sharded(group: Any, params: list[torch.Tensor], slots: list[_Slot], outs: list[dict[str, Any]]) -> None:
    device = params[0].device
    local = [_local_state(slot) for slot in slots]
    # [has-moments flag, step]: MAX over the group (ranks owning nothing contribute zeros).
    meta = torch.zeros(2, dtype=torch.float64, device=device)
    for main, _, step in local:
        if main is not None and step is not None:
            meta[0] = 1.0
            meta[1] = max(float(meta[1]), step)
    many = dist.is_initialized() and dist.get_world_size(group) > 1
    if many:
        dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)
    has_moments, step = bool(meta[0] > 0), float(meta[1])
    kinds = ("main",) + MOMENT_KEYS
    for run in _chunks([p.numel() for p in params], GATHER_CHUNK_ELEMENTS):
        sizes = [params[i].numel() for i in run]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        flat = torch.zeros(len(kinds), sum(sizes), dtype=torch.float32, device=device)
        for i, base in zip(run, starts):
            main, moments, st = local[i]
            if main is None:
                continue
            lo, hi = slots[i].flat_range
            flat[0, base + lo:base + hi] = main.detach().view(-1).float()
            if st is not None:
                for k, name in enumerate(MOMENT_KEYS, start=1):
                    flat[k, base + lo:base + hi] = moments[name].detach().view(-1).float()
        if many:
            dist.all_reduce(flat, group=group)  # owned ranges are disjoint: the sum is the concatenation
        flat = flat.cpu()
        for i, base in zip(run, starts):
            p, out, n = params[i], outs[i], params[i].numel()
            out["main"] = flat[0, base:base + n].view(p.shape).clone()
            if has_moments:
                out.update({name: flat[k, base:base + n].view(p.shape).clone()
                            for k, name in enumerate(MOMENT_KEYS, start=1)}, step=step)


def restore_param_states(optimizer: Any, params: list[torch.Tensor], states: list[dict[str, Any]], *,
                         load_moments: bool = True) -> None:
    """As ``_restore_param_states``; views into one parameter are joined into its whole state first."""
    slots = _slots(optimizer)
    views = [_view_of_param(p, slots) for p in params]
    if not any(views):
        _restore_param_states(optimizer, params, states, load_moments=load_moments)
        return
    targets, index = _bases(params, views)
    pieces: list[list[tuple[int, int, dict[str, Any]]]] = [[] for _ in targets]
    for p, v, i, st in zip(params, views, index, states):
        pieces[i].append((v[1] if v else 0, p.numel(), st))
    joined = []
    for base, parts in zip(targets, pieces):
        if len(parts) == 1 and parts[0][1] == base.numel():
            joined.append(parts[0][2])
            continue
        if sum(n for _, n, _ in parts) != base.numel():
            raise ValueError(f"views of a parameter {tuple(base.shape)} do not cover it: "
                             f"{sorted((o, n) for o, n, _ in parts)}")
        state: dict[str, Any] = {}
        for kind in ("main",) + MOMENT_KEYS:
            if all(kind in st for _, _, st in parts):
                flat = torch.empty(base.numel(), dtype=torch.float32)
                for off, n, st in parts:
                    flat[off:off + n] = st[kind].reshape(-1).float()
                state[kind] = flat.view(base.shape)
        steps = {st.get("step") for _, _, st in parts}
        if len(steps) == 1 and None not in steps and all(k in state for k in MOMENT_KEYS):
            state["step"] = steps.pop()
        joined.append(state)
    _restore_param_states(optimizer, targets, joined, load_moments=load_moments)


def _restore_param_states(optimizer: Any, params: list[torch.Tensor], states: list[dict[str, Any]], *,
                          load_moments: bool = True) -> None:
    """Inverse of ``collect_param_states`` (no communication: every rank gets whole local tensors).

    The master copy is always set (from ``"main"``, or from the parameter's new value when the
    checkpoint has none, e.g. one written by an fp32 run): a mixed-precision optimizer would
    otherwise overwrite the loaded weights with its stale master on the next step. Moments and step
    are set when ``load_moments`` and the checkpoint has them."""
    slots = _slots(optimizer)
    with torch.no_grad():
        for p, state in zip(params, states):
            slot = slots.get(id(p))
            if slot is None or slot.key is None:
                continue
            lo, hi = slot.flat_range if slot.flat_range is not None else (0, p.numel())

            def part(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(-1)[lo:hi].view_as(slot.key).to(slot.key.device, torch.float32)

            if slot.separate_main:
                main = state.get("main")
                slot.key.copy_(part(main) if main is not None else part(p.detach().float()))
            if not load_moments or state.get("step") is None:
                continue
            step = state["step"]
            new = {k: part(state[k]).clone() for k in MOMENT_KEYS}
            if _per_param_step(slot.inner):
                new["step"] = torch.tensor(step, dtype=torch.float32)
            elif slot.group is not None:
                slot.group["step"] = int(step)
            slot.inner.state[slot.key] = new


def scheduler_settings(cfg: TrainingConfig) -> dict[str, Any]:
    """The schedule's settings as megatron-core's OptimizerParamScheduler takes and saves them (lengths
    in the schedule's unit: ``config/samples.schedule_steps``)."""
    from megatron_ext.config.samples import schedule_steps

    steps = schedule_steps(cfg)
    return {"init_lr": cfg.lr_warmup_init if steps.warmup > 0 else cfg.lr, "max_lr": cfg.lr, "min_lr": cfg.min_lr,
            "lr_warmup_steps": steps.warmup, "lr_decay_steps": max(steps.decay, int(steps.warmup) + 1),
            "lr_decay_style": cfg.lr_decay_style, "start_wd": cfg.weight_decay, "end_wd": cfg.weight_decay,
            "wd_incr_steps": steps.wd_incr}


class SampleScheduler:
    """megatron-core's scheduler counting samples, as Megatron-LM's does (--train-samples,
    --rampup-batch-size), stepped like the iteration-counting one: ``step(n)`` advances n iterations,
    each by the global batch at the data position it starts from. The scheduler's own count is that
    position, so a resumed or rolled-back run steps on from the right batch."""

    def __init__(self, scheduler: Any, batch_at: Any) -> None:
        self.__dict__.update(scheduler=scheduler, batch_at=batch_at)

    def step(self, iterations: int) -> None:
        if iterations == 0:
            self.scheduler.step(0)
        for _ in range(iterations):
            self.scheduler.step(self.batch_at(self.scheduler.num_steps))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def build_scheduler(optimizer: Any, cfg: TrainingConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.config.samples import schedule_steps

    scheduler = OptimizerParamScheduler(
        optimizer, **scheduler_settings(cfg), wd_incr_style="constant",
        # Megatron-LM's pair: the checkpoint's schedule wins on resume, unless the flags are to.
        use_checkpoint_opt_param_scheduler=not cfg.override_opt_param_scheduler,
        override_opt_param_scheduler=cfg.override_opt_param_scheduler,
    )
    if schedule_steps(cfg).unit == "samples":
        return SampleScheduler(scheduler, cfg.global_batch_at)
    return scheduler
